"""Atomic per-shard output: the tar is written under a temporary name and renamed when
complete; ``{shard}_stats.json`` is renamed into place last and marks the shard done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import webdataset as wds

from demind.gen.shards import ShardOutput


def encode_sample(
    key: str, image_ext: str, image_bytes: bytes, caption: str, rewritten: str, intent: str, meta: dict[str, Any]
) -> dict[str, Any]:
    """The intent-shard sample (schema in shards/README.md), all values as bytes."""
    return {
        "__key__": key,
        image_ext: image_bytes,
        "txt": caption.encode("utf-8"),
        "rew.txt": rewritten.encode("utf-8"),
        "int.txt": intent.encode("utf-8"),
        "json": json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8"),
    }


class ShardWriter:
    """Write samples to ``output.tmp_tar``; :meth:`commit` renames it to ``output.tar``.

    If the process dies (or an exception escapes) before ``commit``, only the ``.tmp``
    file exists, which no reader takes for a finished shard and the next run removes.
    """

    def __init__(self, output: ShardOutput):
        self.output = output
        output.tar.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(output.tmp_tar, "wb")
        self._tar = wds.TarWriter(self._file, encoder=False, mode=0o644)
        self.count = 0

    def write(self, sample: dict[str, Any]) -> None:
        self._tar.write(sample)
        self.count += 1

    def commit(self) -> None:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.output.tmp_tar, self.output.tar)

    def abandon(self) -> None:
        """Close the file handle after a failure, leaving the ``.tmp`` file for the next run to remove."""
        if not self._file.closed:
            try:
                self._tar.close()  # flush tarfile's buffer now, not in a destructor after the file is gone
            finally:
                self._file.close()


def write_stats(output: ShardOutput, stats: dict[str, Any]) -> None:
    """Write the stats JSON atomically; this is the shard's done-marker, so it comes last."""
    output.tmp_stats.write_text(json.dumps(stats, indent=2, sort_keys=False, ensure_ascii=False) + "\n")
    os.replace(output.tmp_stats, output.stats)


def read_stats(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
