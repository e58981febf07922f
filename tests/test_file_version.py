"""The one rule for "has this file changed?" without reading it (:func:`demind.io.file_version`): size,
modification and change times, inode, as git's index keeps them. A file replaced by another of the
same size with its mtime put back (``touch -r``, ``cp -p``, ``rsync -t``) is changed; an index built
under the earlier rule (size and mtime) is not encoded again for the new one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image

import demind.search.index as index_module
from demind.io import earlier_file_version, file_version
from demind.search.index import build_index
from test_search import one_torch_thread  # noqa: F401  (module fixture: one torch thread)


def write_png(path: Path, seed: int, change_pixel: bool = False) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    if change_pixel:
        pixels[0, 0] = 255 - pixels[0, 0]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, compress_level=0)  # stored: a changed pixel keeps the size
    return path


def test_the_version_holds_what_git_holds(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"a" * 10)
    stat = path.stat()
    version = file_version(stat)
    assert version == f"{stat.st_size}-{stat.st_mtime_ns}-{stat.st_ctime_ns}-{stat.st_ino}"
    assert earlier_file_version(version) == f"{stat.st_size}-{stat.st_mtime_ns}"
    path.write_bytes(b"b" * 10)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # touch -r: same size, mtime put back
    assert file_version(path.stat()) != version


def test_an_index_of_the_earlier_rule_is_reused_then_an_edit_with_its_mtime_kept_is_encoded(
        tmp_path, tiny_backbone, monkeypatch, caplog):
    gallery, index = tmp_path / "photos", tmp_path / "index"
    images = [write_png(gallery / f"{i}.png", seed=i) for i in range(3)]
    with monkeypatch.context() as patch:  # built before the rule held change time and inode
        patch.setattr(index_module, "file_version", lambda stat: f"{stat.st_size}-{stat.st_mtime_ns}")
        assert build_index(gallery, index, tiny_backbone, progress=False).encoded == 3
    with caplog.at_level(logging.INFO):
        upgraded = build_index(gallery, index, tiny_backbone, progress=False)
    assert (upgraded.encoded, upgraded.cached, upgraded.indexed) == (0, 3, 3)  # not encoded again
    assert sum("3 images reused from before file versions held change time and inode" in r.getMessage()
               for r in caplog.records) == 1
    assert build_index(gallery, index, tiny_backbone, progress=False).encoded == 0

    stat = images[1].stat()
    write_png(images[1], seed=1, change_pixel=True)
    os.utime(images[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the edit keeps size and mtime
    assert images[1].stat().st_size == stat.st_size
    edited = build_index(gallery, index, tiny_backbone, progress=False)
    assert (edited.encoded, edited.cached) == (1, 2)  # before: 0, the old feature kept for the new pixels
