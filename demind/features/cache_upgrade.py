"""Training feature caches written before images were decoded with their EXIF orientation: the one
home of that form (:func:`demind.features.cache.shards_to_build` calls in here and nowhere else knows it).

Such a shard's record has no ``decode``. It is reused, and the field recorded (so the next run reads
no header), when no image of its shard is stored rotated: decoding it upright gives the very pixels
that were encoded. A shard with a rotated image was encoded sideways there and is rebuilt, only that
shard (:func:`check_unoriented`; the same rule for the builder and the trainer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tarfile
from pathlib import Path
from typing import Any

from demind.imaging import orientation_changes_pixels
from demind.io import write_json_atomic
from demind.shard_format import IMAGE_FIELDS, shard_name

logger = logging.getLogger("demind.features.cache")  # the reader's log (shards_to_build), as if it said them


def check_unoriented(records: dict[str, tuple[dict[str, Any], Path]], decode: str) -> dict[str, str]:
    """Of the current (not stale) shard caches ``records`` (shard -> (its record, the record's path)),
    those cached before EXIF orientation was applied (no ``decode``) that must be rebuilt, with why;
    every other such one is reused and its record gets ``decode`` (so the next run reads no header).

    Reused is a shard none of whose cached images is stored rotated (EXIF or XMP orientation 2..8,
    :func:`demind.imaging.orientation_changes_pixels`). Headers only: ~0.06 ms per image, no pixel decoded."""
    unoriented = {shard: (index, path) for shard, (index, path) in records.items() if "decode" not in index}
    if not unoriented:
        return {}
    rebuild: dict[str, str] = {}
    for shard, (index, path) in unoriented.items():
        try:
            rotated = rotated_images(shard, index.get("keys", []))
        except (OSError, tarfile.TarError) as exn:  # the rebuild reads it the usual way and reports it
            rebuild[shard] = f"cached before EXIF orientation was applied, and its images cannot be checked ({exn})"
        else:
            if rotated:
                rebuild[shard] = (f"cached before EXIF orientation was applied; rotated images (EXIF orientation "
                                  f"2-8), encoded sideways there: {rotated} of {len(index.get('keys', []))}")
            else:
                record_decode(path, index, decode)
        if shard in rebuild:
            logger.info("feature cache of %s is rebuilt: %s", shard_name(shard), rebuild[shard])
    logger.info("%d cached shards checked for EXIF orientation: %d reused, %d rebuilt (rotated images)",
                len(unoriented), len(unoriented) - len(rebuild), len(rebuild))
    return rebuild


def rotated_images(shard: str | Path, keys: list[str]) -> int:
    """How many images of the samples ``keys`` of ``shard`` EXIF orientation turns (an unreadable
    one counts), read from their headers inside the tar: members are opened in place, not extracted.

    A sample's image is the member the reader decodes: the first of :data:`IMAGE_FIELDS` it has,
    its key and field split as WebDataset splits a member name (at the first dot of its base name,
    the field lower-cased). Raises ``OSError`` / ``tarfile.TarError`` when the tar cannot be read."""
    from webdataset.tariterators import base_plus_ext

    wanted, images = set(keys), {}
    rank = {field: i for i, field in enumerate(IMAGE_FIELDS)}
    with tarfile.open(shard, "r:") as tar:
        for member in tar:
            key, field = base_plus_ext(member.name) if member.isreg() else (None, None)
            field = field.lower() if field else None
            if key in wanted and field in rank and (key not in images or rank[field] < images[key][0]):
                images[key] = (rank[field], member)
        return sum(orientation_changes_pixels(tar.extractfile(member)) for _, member in images.values())


def record_decode(path: Path, index: dict[str, Any], decode: str) -> None:
    """Add ``decode`` to a shard's record at ``path``, atomically; a cache that cannot be written (a
    read-only copy) is still used, and checked again next time."""
    # a temp name of this process's own: the processes of a distributed run each find the cache and
    # may record the same shard at once (the record is the same; the shared ``.tmp`` name is not safe)
    own = path.with_name(f"{path.name}.{socket.gethostname()}-{os.getpid()}")
    try:
        os.replace(write_json_atomic(own, {**index, "decode": decode}), path)
    except OSError as exn:
        with contextlib.suppress(OSError):
            own.unlink(missing_ok=True)
        logger.warning("could not record in %s that its images need no EXIF orientation (%s); "
                       "they are checked again next run", path, exn)
