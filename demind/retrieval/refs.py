"""What retrieval works on: images by reference (:class:`ImageRef`), composed queries
(:class:`Query`), and reading a reference's pixels (:func:`load_image`).

An :class:`ImageRef` names an image file, a member of an uncompressed tar shard, or a COCO
region (box, mask); :func:`load_image` reads it through the one decoder
(:func:`demind.imaging.decode_image`). Benchmarks, the search index and the page all refer to
images this way, so the gallery cache (:mod:`demind.retrieval.cache`) keys them alike.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from PIL import Image

from demind.errors import DemindError, InputError
from demind.imaging import ImageDecodeError, decode_image, orientation_changes_pixels
from demind.retrieval.masks import decode_segmentation

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# How an image is brought to the backbone's input size: "backbone" = the backbone's own eval
# preprocessing (resize the short side, centre-crop); "squash" = resize straight to the input
# square, no crop (Pic2Word's COCO query regions).
RESIZE_MODES = ("backbone", "squash")


class ImageReadError(DemindError, OSError):
    """An image file exists but cannot be decoded."""


BENCHMARK_ADVICE = "re-download or remove it from the split"
"""What :func:`load_image`'s error tells a benchmark's reader; other readers say their own (:func:`reword`)."""


LEFT_OUT_ADVICE = "fix or remove the file (it is left out until it changes)"
"""What a skipped image of a user's gallery (a search index) tells its owner."""


def reword(message: str, advice: str) -> str:
    """An unreadable image's message (an :class:`ImageReadError`'s text, also as it comes back from a
    DataLoader worker) with the benchmark's advice replaced by ``advice``: a search index or a search
    query is not a benchmark split."""
    return message.replace(BENCHMARK_ADVICE, advice)


def canonical_name(path_or_name: str) -> str:
    """Image name without folder or image extension: ``./dev/dev-1-0-img0.png`` -> ``dev-1-0-img0``.

    Used on both sides of every comparison (gallery, reference, ground truth), so
    ``dev-1-0-img0``, ``dev/dev-1-0-img0.png`` and ``dev\\dev-1-0-img0.png`` are one image.
    """
    base = PurePosixPath(str(path_or_name).replace("\\", "/")).name
    stem, ext = os.path.splitext(base)
    return stem if ext.lower() in IMAGE_EXTENSIONS else base


def strip_image_extension(relpath: str) -> str:
    """``imgnet/imagenet-r/n01/toy_3.jpg`` -> ``imgnet/imagenet-r/n01/toy_3`` (folders kept)."""
    stem, ext = os.path.splitext(relpath.replace("\\", "/"))
    return stem if ext.lower() in IMAGE_EXTENSIONS else relpath


@dataclass(frozen=True)
class ImageRef:
    """One image to encode.

    name: gallery-style name (unique within a benchmark role; the cache is keyed by it).
    path: file on disk.
    box: optional crop (x1, y1, x2, y2) in pixels, applied after masking.
    segmentation: optional COCO polygon list or RLE dict; pixels outside it become white
        (Pic2Word's masked query images).
    resize: one of :data:`RESIZE_MODES`; how the loaded image reaches the backbone's input size.
    version: optional file version (:func:`demind.io.file_version`: size, times, inode), so a
        cached feature of an edited file no longer matches.
    span: optional (byte offset, length) of the image inside ``path``, for a member of an
        uncompressed tar shard (the search index reads shards without unpacking them).
    orient: apply the file's EXIF orientation when decoding (a user's photos, as a viewer shows
        them); off for benchmark images, whose protocols decode without it.
    """

    name: str
    path: Path
    box: tuple[float, float, float, float] | None = None
    segmentation: Any = field(default=None, compare=False, hash=False)
    version: str | None = None
    span: tuple[int, int] | None = None
    resize: str = "backbone"
    orient: bool = False

    def __post_init__(self) -> None:
        if self.resize not in RESIZE_MODES:
            raise InputError(f"ImageRef {self.name}: resize must be one of {RESIZE_MODES}, got {self.resize!r}")

    @property
    def cache_key(self) -> str:
        """What the cached feature depends on, independent of where the data root lives."""
        key = "/".join(self.path.parts[-2:])
        if self.box is not None:
            key += "|box=" + ";".join(f"{v:g}" for v in self.box)
        if self.segmentation is not None:
            seg = json.dumps(self.segmentation, sort_keys=True, default=str).encode()
            key += "|mask=" + hashlib.sha256(seg).hexdigest()[:16]
        if self.resize != "backbone":  # the default adds nothing, so caches written before this field stay valid
            key += "|resize=" + self.resize
        if self.orient:  # off adds nothing, so caches written before this field stay valid
            key += "|orient"
        if self.version is not None:
            key += "|v=" + self.version
        return key


@dataclass
class Query:
    """One composed query.

    qid: the id written to rankings (CIRR pairid, ``dress:12``, COCO file name, ...).
    reference: the reference image.
    prompt: the composed-query text with exactly one ``*`` (the pseudo-word slot).
    text: the Text-only and Image+Text baselines' text, encoded as plain text (a ``*`` in it is
        an ordinary token: Pic2Word's FashionIQ protocol encodes the whole prompt).
    targets: names of the relevant gallery images (empty on test splits).
    exclude: a gallery name never ranked for this query (CIRR: the reference itself).
    subset: CIRR ``img_set.members`` minus the reference (for Recall_subset).
    target_description: the target's ground-truth description, where the benchmark has one
        (the toy benchmarks' optional ``target_description`` field; the ``oracle`` method).
    """

    qid: str
    reference: ImageRef
    prompt: str
    text: str
    targets: tuple[str, ...] = ()
    exclude: str | None = None
    subset: tuple[str, ...] = ()
    target_description: str | None = None



def _pixel_box(box: tuple[float, float, float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """Float box -> integer pixel box covering it, clamped to the image, at least 1 px."""
    x1 = min(max(int(math.floor(box[0])), 0), width - 1)
    y1 = min(max(int(math.floor(box[1])), 0), height - 1)
    x2 = max(min(int(math.ceil(box[2])), width), x1 + 1)
    y2 = max(min(int(math.ceil(box[3])), height), y1 + 1)
    return x1, y1, x2, y2


def _span_bytes(path: Path, span: tuple[int, int]) -> io.BytesIO:
    """The bytes of one member inside an uncompressed archive (a tar shard)."""
    offset, length = span
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise OSError(f"{path} ends before the member at byte {offset} (length {length}): the shard was truncated")
    return io.BytesIO(data)


def orientation_changes(ref: ImageRef) -> bool:
    """Whether ``ref``'s EXIF orientation changes its pixels (read from the file's or the shard
    member's header: :func:`demind.imaging.orientation_changes_pixels`); True for an image that
    cannot be read, which then takes the ordinary decode path."""
    try:
        source = _span_bytes(ref.path, ref.span) if ref.span else ref.path
    except OSError:
        return True
    return orientation_changes_pixels(source)


def load_image(ref: ImageRef) -> Image.Image:
    """Decode ``ref`` to an RGB PIL image: mask the background white, then crop.

    ``ref.orient`` applies the EXIF orientation (a user's photos); benchmark references keep
    their protocol's decoding (no rotation). A file that cannot be decoded raises
    :class:`ImageReadError` naming it.
    """
    try:
        image = decode_image(_span_bytes(ref.path, ref.span) if ref.span else ref.path, orient=ref.orient)
    except (OSError, ImageDecodeError) as e:
        raise ImageReadError(f"cannot read image {ref.path}: {e}; {BENCHMARK_ADVICE}") from e
    if ref.segmentation is not None:
        mask = decode_segmentation(ref.segmentation, image.height, image.width)
        white = Image.new("RGB", image.size, (255, 255, 255))
        image = Image.composite(image, white, Image.fromarray(mask * 255))
    if ref.box is not None:
        image = image.crop(_pixel_box(ref.box, image.width, image.height))
    return image
