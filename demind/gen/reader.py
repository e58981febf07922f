"""Reading img2dataset-style input shards (``KEY.jpg``, ``KEY.txt``, ``KEY.json``) with webdataset.

Samples stream one at a time; images stay as their original encoded bytes (written
unchanged to the output) and are decoded and shrunk only for the engine.
Every unusable sample comes back as a :class:`SkippedSample` with a reason, never dropped.
"""

from __future__ import annotations

import json
import logging
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from webdataset.tariterators import base_plus_ext

from demind.errors import DemindError

from demind.imaging import decode_image
from demind.shard_format import CAPTION_FIELD, IMAGE_FIELDS, JSON_FIELD

logger = logging.getLogger(__name__)


class InputShardError(DemindError, RuntimeError):
    """An input shard that cannot be read as a tar archive."""


@dataclass
class RawSample:
    """One input sample before decoding. ``image_bytes`` are the file's bytes, untouched."""

    key: str
    image_ext: str
    image_bytes: bytes
    caption: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SkippedSample:
    key: str
    reason: str  # a short category, counted in the stats ("undecodable image", "missing caption", ...)
    detail: str = ""  # the specifics (decoder message, lengths), kept in the per-sample list


def _validate(raw: dict[str, Any], max_caption_chars: int) -> RawSample | SkippedSample:
    """Turn one webdataset record (extension -> bytes) into a RawSample, or say why not."""
    key = raw["__key__"]
    image_ext = next((ext for ext in IMAGE_FIELDS if ext in raw), None)
    if image_ext is None:
        return SkippedSample(key, "missing image")
    if CAPTION_FIELD not in raw:
        return SkippedSample(key, "missing caption")
    try:
        caption = raw[CAPTION_FIELD].decode("utf-8").strip()
    except UnicodeDecodeError:
        return SkippedSample(key, "caption is not UTF-8")
    if not caption:
        return SkippedSample(key, "missing caption")
    if len(caption) > max_caption_chars:
        return SkippedSample(key, "caption too long", f"{len(caption)} chars > io.max_caption_chars={max_caption_chars}")
    meta: dict[str, Any] = {}
    if JSON_FIELD in raw:
        try:
            meta = json.loads(raw[JSON_FIELD].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return SkippedSample(key, "malformed json")
        if not isinstance(meta, dict):
            return SkippedSample(key, "malformed json", "not a JSON object")
    return RawSample(key=key, image_ext=image_ext, image_bytes=raw[image_ext], caption=caption, meta=meta)


def tar_records(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a tar in file order, webdataset's convention: consecutive members with the same
    key (``a1.jpg``, ``a1.txt``) form one record ``{"__key__": "a1", "jpg": ..., "txt": ...}``.

    Unlike webdataset's ``group_by_keys``, which raises ``duplicate file name in tar file`` and
    so ends the whole shard, a member whose extension the current record already has starts a
    new record with the same key; :func:`iter_shard` then skips it as a duplicate key."""
    record: dict[str, Any] | None = None
    with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tar:
        for info in tar:
            if not info.isreg() or re.match(r"__[^/]*__($|/)", info.name):
                continue
            key, ext = base_plus_ext(info.name)
            if key is None:
                continue
            ext = ext.lower()
            data = tar.extractfile(info).read()
            tar.members = []  # streaming: do not keep every member's header in memory
            if record is None or key != record["__key__"] or ext in record:
                if record is not None:
                    yield record
                record = {"__key__": key}
            record[ext] = data
    if record is not None:
        yield record


def iter_shard(path: Path, max_caption_chars: int = 2000) -> Iterator[RawSample | SkippedSample]:
    """Stream the samples of one tar shard in file order.

    Keys seen twice in a shard are skipped (and counted) on the second occurrence so that
    the output never holds duplicate keys. Raises InputShardError for an unreadable tar.
    """
    seen: set[str] = set()
    try:
        for raw in tar_records(path):
            item = _validate(raw, max_caption_chars)
            if item.key in seen:
                yield SkippedSample(item.key, "duplicate key", "a sample with this key came earlier in the shard; kept the first")
                continue
            seen.add(item.key)
            yield item
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise InputShardError(
            f"input shard {path} is not a readable tar ({type(e).__name__}: {e}); "
            "re-download or rebuild it, or leave it out with --shard"
        ) from e


def decode_and_shrink(data: bytes, max_side: int) -> Image.Image:
    """Decode to RGB as a viewer shows it (EXIF orientation applied) and shrink (never enlarge) so
    that max(width, height) <= max_side (:func:`demind.imaging.decode_image`).

    Raises ValueError with the decoder's message when the bytes are not a readable image.
    """
    return decode_image(data, orient=True, max_side=max_side)
