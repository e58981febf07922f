"""``search.json``: what a finished run offers to search, written into its folder.

A pipeline that trains a model and renders a gallery (the toy quickstart) writes the manifest;
``demind-serve --quickstart DIR`` reads it, so the search commands need nothing from the
package that wrote it. Paths are stored relative to the folder, so a moved or copied run
folder still serves::

    {"format": 1, "checkpoint": "train/<backbone>/demind-seed0/demind.safetensors",
     "images": "benchmarks/cirr/dev", "index": "search-index"}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from demind.errors import DemindError, MissingInputError
from demind.io import write_json_atomic

MANIFEST_NAME = "search.json"
MANIFEST_FORMAT = 1
KEYS = ("checkpoint", "images", "index")


class SearchManifestError(DemindError, ValueError):
    """A ``search.json`` that cannot be read; the message names the file and the fix."""


def write_search_manifest(folder: str | Path, checkpoint: str | Path, images: str | Path, index: str | Path) -> Path:
    """Write ``<folder>/search.json`` (atomically) with each path relative to ``folder``; returns its path."""
    folder = Path(folder)
    paths = {"checkpoint": checkpoint, "images": images, "index": index}
    data = {"format": MANIFEST_FORMAT,
            **{k: Path(os.path.relpath(Path(v).absolute(), folder.absolute())).as_posix() for k, v in paths.items()}}
    path = folder / MANIFEST_NAME
    write_json_atomic(path, data, indent=1)
    return path


def read_search_manifest(folder: str | Path) -> dict[str, Path]:
    """``{"checkpoint", "images", "index"}`` -> paths (under ``folder``) from ``<folder>/search.json``.

    FileNotFoundError when there is none (the run has not finished); SearchManifestError when it is
    not a manifest of this format."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise MissingInputError(f"no {MANIFEST_NAME} in {folder}: run the quickstart first "
                                f"(demind-quickstart workdir={folder}), which writes it when it finishes")
    fix = "rerun the quickstart to rewrite it, or give --index and --checkpoint instead of --quickstart"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise SearchManifestError(f"{path} is not a search manifest (not JSON: {err}); {fix}") from None
    if (not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT
            or not all(isinstance(data.get(k), str) for k in KEYS)):
        raise SearchManifestError(f"{path} is not a search manifest (expected a JSON object of format "
                                  f"{MANIFEST_FORMAT} with string paths {', '.join(KEYS)}); {fix}")
    return {k: Path(folder) / data[k] for k in KEYS}
