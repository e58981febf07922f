"""Where ``demind-publish`` writes a checkpoint's folder: what it may replace, and how.

A published folder lists every file it holds in its ``config.json`` (:data:`PUBLISHED_FILES_KEY`)
beside ``"library_name": "demind"``, and its card ends with the marker; together they say
"demind-publish wrote this". ``--overwrite`` replaces only such a folder, and only when it holds
nothing else (a file added by hand, another run's checkpoint): nothing is deleted that the
command did not write. The new folder is built beside the old one and swapped in when complete,
so a failed publish leaves the old folder as it was, and the result holds exactly the new
publish's files (no stale card, results or backbone files of an earlier publish).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from demind.errors import DemindError
from demind.release.folders_upgrade import earlier_published_files
from demind.io import check_output_dir, reporting_output_errors

PUBLISHED_FILES_KEY = "files"
"""Key of ``config.json``: every file of the folder, relative paths (config.json included)."""
CARD_MARKER = "<!-- written by demind-publish -->"
"""Ends every card we write: a README.md without it is the user's and is never overwritten."""


class PublishError(DemindError, ValueError):
    """Something to publish that cannot be published as asked (the message says what to do)."""


def folder_files(folder: Path) -> set[str]:
    """Every file under ``folder`` (hidden ones included), as relative POSIX paths."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}


def published_files(folder: Path) -> set[str] | None:
    """The files demind-publish wrote into ``folder`` (its config.json's list; a folder published
    before the list was kept: :mod:`demind.release.folders_upgrade`), or None when demind-publish did
    not write the folder (no demind config.json, or a card without the marker)."""
    try:
        manifest = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        card = (folder / "README.md").read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("library_name") != "demind" or CARD_MARKER not in card:
        return None
    listed = manifest.get(PUBLISHED_FILES_KEY)
    if isinstance(listed, list) and all(isinstance(f, str) for f in listed):
        return set(listed)
    return earlier_published_files(folder_files(folder))


def check_publish_target(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file, a non-empty folder without ``overwrite``, or (with it)
    a folder demind-publish did not write or that holds files it did not write."""
    if out.exists() and not out.is_dir():
        raise PublishError(f"--out {out} is a file, not a folder; give a new or empty folder (or one "
                                 "demind-publish wrote, with --overwrite)")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise PublishError(f"output folder {out} is not empty; give an empty or new --out, or --overwrite "
                                 "to replace a folder demind-publish wrote")
    ours = published_files(out)
    if ours is None:
        raise PublishError(f"--overwrite refused: {out} was not written by demind-publish (no config.json "
                                 "of demind-publish and card with its marker); nothing there was changed; choose "
                                 "another --out")
    others = sorted(folder_files(out) - ours)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise PublishError(f"--overwrite refused: {out} holds file(s) demind-publish did not write: {shown}; "
                                 "move them away or choose another --out (nothing was changed)")


@contextmanager
def building_beside(out: Path) -> Iterator[Path]:
    """A new empty folder beside ``out`` (same file system, so the swap is a rename); removed
    when the block fails."""
    build = out.parent / f".{out.name}.publish-new-{os.getpid()}"
    if build.exists():
        shutil.rmtree(build)  # left by a killed publish of this process id: ours
    check_output_dir(build)
    try:
        yield build
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def swap_in(build: Path, out: Path) -> None:
    """Put the finished folder ``build`` at ``out``: a rename; an earlier publish there (checked by
    :func:`check_publish_target`) is renamed aside first and deleted once the new one is in place."""
    with reporting_output_errors(out):
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            os.replace(build, out)
            return
        old = out.parent / f".{out.name}.publish-old-{os.getpid()}"
        os.replace(out, old)
        try:
            os.replace(build, out)
        except OSError:
            os.replace(old, out)  # the old publish back where it was
            raise
        shutil.rmtree(old)


__all__ = ["CARD_MARKER", "PUBLISHED_FILES_KEY", "PublishError", "building_beside", "check_publish_target",
           "published_files", "swap_in"]
