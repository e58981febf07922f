"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one.

Every long job in the project writes through these (tmp file in the same folder, then
``os.replace``), so a killed run leaves either nothing or a complete file behind.
A full disk or a read-only output becomes one :class:`~demind.errors.OutputLocationError`
naming the path; :func:`check_output_dir` finds it before the expensive work starts.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


from demind.errors import InputError, MissingInputError, OutputLocationError


def temp_path(path: str | Path) -> Path:
    """``path + '.tmp'``: where :func:`atomic_path` writes before the rename (a killed run leaves it)."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield ``path + '.tmp'`` to write to; on success it replaces ``path``, on error it is removed.

    For writers that want a file name (``torch.save``, safetensors, tar and CSV writers)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with reporting_output_errors(path):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = None,
                      default: Callable[[Any], Any] | None = None) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=default))


# --------------------------------------------------------------------------- output checks

# errno values that mean "this output place is unusable", not "the program has a bug".
OUTPUT_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system",
                 errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                 errno.EDQUOT: "disk quota exceeded", errno.ENOTDIR: "a part of the path is a file, not a folder",
                 errno.EISDIR: "it is a folder, not a file",
                 errno.EFBIG: "file too large for this file system or for the shell's file-size limit "
                              "(ulimit -f; FAT32 holds at most 4 GiB per file)"}
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")  # how Rust writers (safetensors) report the errno


def _hidden_errno(path: Path, exc: BaseException) -> int | None:
    """The errno of a writer that hides it: safetensors keeps it in its text (``os error 27``);
    torch.save says ``unexpected pos`` when a write stopped short, which at the file-size limit
    (``ulimit -f``) is EFBIG: the partly written file then reaches that limit."""
    found = _OS_ERROR_IN_TEXT.search(str(exc))
    if found:
        return int(found.group(1))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        for candidate in (path, temp_path(path)):
            try:
                if candidate.is_file() and candidate.stat().st_size >= limit:
                    return errno.EFBIG
            except OSError:
                continue
    return None


class _RepeatedKey(ValueError):
    """A JSON object that names one key twice with two values (json.load would keep the last silently)."""


def _object_without_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out and out[key] != value:
            raise _RepeatedKey(f"the key {key!r} appears twice in one object, with different values")
        out[key] = value
    return out


def read_json(path: str | Path, fix: str = "re-download the annotation file") -> Any:
    """Parse a JSON file; a malformed one (truncated, not UTF-8, or an object naming one key twice with
    different values, which json.load would resolve by dropping one silently) raises InputError naming
    the file and ``fix``."""
    try:
        with Path(path).open("r", encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=_object_without_repeated_keys)
    except _RepeatedKey as e:
        raise InputError(f"{path}: {e}; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON ({e}); {fix}") from None


def read_jsonl(path: str | Path, what: str = "file", bad_lines: list[tuple[int, str]] | None = None
               ) -> list[tuple[int, Any]]:
    """The values of a JSON-lines file as (line number, value), blank lines skipped.

    A missing file is a MissingInputError and a malformed line (not JSON, not UTF-8) an InputError,
    each naming the file (and the line), so callers only check the values' own shape. With
    ``bad_lines`` a malformed line is appended there as (line number, message) and skipped instead.
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder; give the JSON-lines file")
    if not path.is_file():
        raise MissingInputError(f"{what} {path} does not exist")
    rows = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            rows.append((number, json.loads(line)))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            message = f"{path}:{number}: not {'UTF-8' if isinstance(e, UnicodeDecodeError) else 'JSON'} ({e})"
            if bad_lines is None:
                raise InputError(message) from None
            bad_lines.append((number, message))
    return rows


def file_version(stat: os.stat_result) -> str:
    """What makes a file "changed" without reading it, as git's index keeps it: size, modification
    and change times (ns) and inode. A file replaced by another of the same size with its mtime put
    back (``touch -r``, ``cp -p``, ``rsync -t``) has another inode or change time, which no program
    can set. The one rule of the digest memo (:class:`demind.mllm.digest_memo.DigestMemo`), the search
    index and the triplet file reader (:attr:`demind.retrieval.ImageRef.version`)."""
    return f"{stat.st_size}-{stat.st_mtime_ns}-{stat.st_ctime_ns}-{stat.st_ino}"


def earlier_file_version(version: str) -> str:
    """The version the rule before :func:`file_version` gave the same file: size and mtime only."""
    return "-".join(version.split("-")[:2])


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def output_error(path: str | Path, exc: BaseException) -> OutputLocationError | None:
    """An :class:`OutputLocationError` naming ``path`` when ``exc`` means the output place is unusable.

    Recognises OSError's ENOSPC/EROFS/EACCES/EPERM/EDQUOT/EFBIG, and writers that hide the errno
    (safetensors' ``os error N``, torch.save's ``unexpected pos`` at the file-size limit) or
    (torch.save reports ``basic_ios::clear: iostream error``) when the disk is (nearly) full.
    Returns None for anything else (a bug, which should keep its traceback)."""
    if isinstance(exc, OutputLocationError):
        return exc
    code = getattr(exc, "errno", None)
    if code is None:
        code = _hidden_errno(Path(path), exc)
    reason = OUTPUT_ERRNOS.get(code)
    if reason is None and code is None and isinstance(exc, (OSError, RuntimeError)):
        try:
            if free_bytes(path) < 1 << 20:
                reason = "no space left on device"
        except OSError:
            return None
    if reason is None:
        return None
    if code == errno.EFBIG:
        return OutputLocationError(f"cannot write {path}: {reason}; raise the limit or write to another file system")
    if code in (errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputLocationError(f"cannot write {path}: {reason}; choose another output location")
    try:
        free = f"; {_human(free_bytes(path))} free there"
    except OSError:
        free = ""
    return OutputLocationError(f"cannot write {path}: {reason}{free}; free space or choose another output location")


@contextmanager
def reporting_output_errors(path: str | Path) -> Iterator[None]:
    """Turn a disk-full / read-only / permission failure inside the block into one OutputLocationError naming ``path``."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 -- re-raised unless it names an unusable output place
        error = output_error(path, exc)
        if error is None or error is exc:
            raise
        raise error from exc


def check_output_dir(path: str | Path, need_bytes: int = 0) -> Path:
    """Create folder ``path`` if needed and make sure a file can be written there, before expensive work.

    Writes and removes a probe file (the only reliable test for read-only mounts and ACLs) and,
    when ``need_bytes`` > 0, checks the free space. Raises OutputLocationError naming the folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputLocationError(f"cannot write into {path}: it is a file, not a folder; choose another output location")
    with reporting_output_errors(path):
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".demind-write-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"ok")
        finally:
            probe.unlink(missing_ok=True)
    if need_bytes > 0 and free_bytes(path) < need_bytes:
        raise OutputLocationError(f"cannot write {path}: {_human(free_bytes(path))} free, about {_human(need_bytes)} "
                                  "needed; free space or choose another output location")
    return path


def check_output_file(path: str | Path) -> Path:
    """Make sure file ``path`` can be written (its folder created and probed, the path not a folder)
    before the work that produces it. Raises OutputLocationError naming the path."""
    path = Path(path)
    if path.is_dir():
        raise OutputLocationError(f"cannot write {path}: it is a folder, not a file; give a file name")
    check_output_dir(path.parent if str(path.parent) else Path("."))
    return path
