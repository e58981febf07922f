"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one.

Every long job in the project writes through these (tmp file in the same folder, then
``os.replace``), so a killed run leaves either nothing or a complete file behind.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


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
