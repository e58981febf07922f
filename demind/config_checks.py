"""A command's whole config check: what :func:`demind.config.load_config` checks (types, declared
rules, each section's ``config_problems()``), then what the command will write, before its body runs
(:func:`check_command_config`, called by :func:`demind.cli.common.run_config_command`).

A field declares what it writes, ``out: str = setting("runs/x", output="dir")``: the folder is
created and a file written and removed there (the only test a read-only mount or an ACL answers
truly; the folders the probe made are removed again), so ``run.output_dir=/proc/x`` or a folder under a file is one ``error:`` line naming the
key, before any model loads or image is encoded. A section says what an output that already holds
something means with ``output_problems() -> [(key, message), ...]`` (another model: refused
without ``--overwrite``). ``tests/test_config_checks.py`` walks every console script's keys and
tries each declared check with a value it must refuse, or finds the key named free
(:func:`demind.settings.setting`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from demind.errors import ConfigError, OutputLocationError
from demind.io import check_output_dir, check_output_file


def check_output_key(key: str, path: str | Path, *, file: bool = False) -> Path:
    """Refuse an output folder (or, ``file``, an output file) this process cannot write, when the
    config is checked: one :class:`~demind.errors.ConfigError` naming ``key``, before any model loads. The folder is
    created and probed (:func:`demind.io.check_output_dir`)."""

    created = _first_missing(Path(path).parent if file else Path(path))
    try:
        return (check_output_file if file else check_output_dir)(path)
    except OutputLocationError as e:
        raise ConfigError(f"config key {key!r} = {str(path)!r}: {e}", key=key) from None
    except OSError as e:  # e.g. ENOENT under /proc or a vanished mount: not an output place
        raise ConfigError(f"config key {key!r} = {str(path)!r}: cannot create or write it ({e.strerror}); "
                          f"choose a folder this process can write", key=key) from None
    finally:
        _remove_probe_folders(Path(path).parent if file else Path(path), created)


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder of ``folder``'s path that does not exist yet (None: it exists)."""
    folder, missing = folder.absolute(), None
    while not folder.exists() and folder != folder.parent:
        folder, missing = folder.parent, folder
    return missing


def _remove_probe_folders(folder: Path, created: Path | None) -> None:
    """Remove the empty folders the probe made, ``folder`` up to ``created``: a refused run, or one that
    never writes there, leaves no trace; the command creates what it writes when it writes it."""
    if created is None:
        return
    folder = folder.absolute()
    for candidate in (folder, *folder.parents):
        try:
            candidate.rmdir()  # only an empty folder goes
        except OSError:
            return
        if candidate == created:
            return


NOT_WRITTEN = frozenset({"none", "null"})  # an output turned off by name (``--plot none``), as data.features off


def declared_outputs(cfg: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, path, ``"dir"``/``"file"``) of every field of ``cfg`` declared
    ``setting(output=...)`` that holds a path (None, ``""``, ``none``: not written), nested sections included."""
    found: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cfg):
        key, value = prefix + f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            found += declared_outputs(value, key + ".")
        elif f.metadata.get("output") and value not in (None, "") and str(value).strip().lower() not in NOT_WRITTEN:
            found.append((key, str(value), f.metadata["output"]))
    return found


def check_outputs(cfg: Any) -> None:
    """Every declared output of ``cfg`` (:func:`declared_outputs`) writable, each checked by
    :func:`check_output_key`: the first that is not is one ConfigError naming its key. A command whose
    config extends another's lists the outputs it never writes in ``UNUSED_OUTPUTS`` (demind-features
    reads a train recipe but writes no run folder): those are not created."""
    unused = set(getattr(type(cfg), "UNUSED_OUTPUTS", ()))
    for key, path, kind in declared_outputs(cfg):
        if key not in unused:
            check_output_key(key, path, file=kind == "file")


def declared_inputs(cfg: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, value, kind) of every field of ``cfg`` declared ``setting(input=...)`` that is set
    (None or ``""``: not read), nested sections included; a list value is one row."""
    found: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(cfg):
        key, value = prefix + f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            found += declared_inputs(value, key + ".")
        elif f.metadata.get("input") and value not in (None, "", []):
            found.append((key, value, f.metadata["input"]))
    return found


def _is_remote(value: str) -> bool:
    """A Hub reference or a URL: its loader resolves it (offline, naming the reference)."""
    return value.startswith("hf-hub:") or "://" in value


def check_inputs(cfg: Any) -> None:
    """Every declared input of ``cfg`` (:func:`declared_inputs`) exists as the kind it declares: the
    first that does not is one ConfigError naming its key, before any model loads."""
    wanted = {"dir": ("folder", Path.is_dir), "file": ("file", Path.is_file), "path": ("file or folder", Path.exists)}
    for key, value, kind in declared_inputs(cfg):
        what, exists = wanted[kind]
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if _is_remote(str(item)) or exists(Path(item)):
                continue
            found = " (it is a folder)" if Path(item).is_dir() else " (it is a file)" if Path(item).is_file() else ""
            raise ConfigError(f"config key {key!r} = {str(item)!r}: no such {what}{found}; give the path of "
                              f"an existing {what}", key=key)


def check_command_config(cfg: Any) -> None:
    """A command's whole config check, after :func:`~demind.config.load_config` (types, declared rules, each
    section's ``config_problems()``) and before any model loads: the folders and files it writes
    (:func:`check_outputs`), then each section's ``output_problems()`` (what an output already
    holds: another model, another run; ``[(key, message), ...]``), as one ConfigError. The files and
    folders it reads (:func:`check_inputs`) come first."""
    check_inputs(cfg)
    raise_section_problems(cfg, "input_problems")
    check_outputs(cfg)
    raise_section_problems(cfg, "output_problems")


def raise_section_problems(cfg: Any, method: str) -> None:
    """Each section's ``method()`` (``input_problems``: files it names that do not exist;
    ``output_problems``: what an output already holds), nested sections included, as one ConfigError
    naming the first key."""
    problems: list[tuple[str, str]] = []

    def visit(section: Any, prefix: str) -> None:
        for f in dataclasses.fields(section):
            if dataclasses.is_dataclass(getattr(section, f.name)):
                visit(getattr(section, f.name), prefix + f.name + ".")
        own = getattr(section, method, None)
        if callable(own):
            problems.extend((prefix + key, message) for key, message in own())

    visit(cfg, "")
    if problems:
        raise ConfigError("; ".join(f"config key {key!r}: {message}" for key, message in problems),
                          key=problems[0][0])
