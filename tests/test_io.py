"""Atomic writes: a failed write leaves the old file and no temp file behind."""

from __future__ import annotations

import json

import pytest

from demind.io import atomic_path, write_json_atomic, write_text_atomic


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = write_text_atomic(tmp_path / "sub" / "a.txt", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert path.read_text() == "old" and not (tmp_path / "sub" / "a.txt.tmp").exists()


def test_json_round_trip_with_default(tmp_path):
    path = write_json_atomic(tmp_path / "r.json", {"p": tmp_path}, indent=2, default=str)
    assert json.loads(path.read_text()) == {"p": str(tmp_path)}
