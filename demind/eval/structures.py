"""The common query/gallery structure every benchmark reader produces, and image loading.

A reader turns an official on-disk format into a :class:`BenchmarkData`: one or more
:class:`QueryGroup` (FashionIQ categories, ImageNet-R domains, or a single ``all``), each
with its gallery (a list of :class:`ImageRef`) and its queries (:class:`Query`). Gallery
entries are identified by *name* (image name without folder or extension), so reference
exclusion and ground truth never depend on how a path is spelled.
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
from demind.eval.masks import decode_segmentation
from demind.io import to_rgb

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# How an image is brought to the backbone's input size: "backbone" = the backbone's own eval
# preprocessing (resize the short side, centre-crop); "squash" = resize straight to the input
# square, no crop (Pic2Word's COCO query regions).
RESIZE_MODES = ("backbone", "squash")


class DataLayoutError(DemindError, FileNotFoundError):
    """An annotation file or image folder is not where the benchmark's layout puts it."""


class ImageReadError(DemindError, OSError):
    """An image file exists but cannot be decoded."""


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
    version: optional file version (the search index uses size and mtime), so a cached
        feature of an edited file no longer matches.
    span: optional (byte offset, length) of the image inside ``path``, for a member of an
        uncompressed tar shard (the search index reads shards without unpacking them).
    """

    name: str
    path: Path
    box: tuple[float, float, float, float] | None = None
    segmentation: Any = field(default=None, compare=False, hash=False)
    version: str | None = None
    span: tuple[int, int] | None = None
    resize: str = "backbone"

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


@dataclass
class QueryGroup:
    """Queries scored against one gallery, with one metric family.

    metric: ``recall`` (hit rate), ``fraction_recall`` (Pic2Word's ImageNet-R recall), ``map`` or
        ``exclusion`` (the ExclMM paper's eight metrics, :func:`demind.eval.metrics.exclusion_metrics`).
    skipped: queries that could not be evaluated, each ``{"qid", "reason", "detail"}`` (counted, reported).
    gallery_missing: gallery names listed by the annotations but absent from disk.
    """

    name: str
    queries: list[Query]
    gallery: list[ImageRef]
    metric: str = "recall"
    ks: tuple[int, ...] = (1, 5, 10, 50)
    subset_ks: tuple[int, ...] = ()
    skipped: list[dict[str, str]] = field(default_factory=list)
    gallery_missing: list[str] = field(default_factory=list)
    total_queries: int | None = None

    def __post_init__(self) -> None:
        if self.total_queries is None:
            self.total_queries = len(self.queries) + len(self.skipped)


@dataclass
class BenchmarkData:
    """A benchmark split read from disk: groups, notes to print, reader options to record.

    submission_ids: gallery name -> the id a test server expects (CIRCO), else None.
    """

    benchmark: str
    split: str
    groups: list[QueryGroup]
    has_ground_truth: bool = True
    notes: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    submission_ids: dict[str, int] | None = None


def require_file(path: Path, layout: str) -> Path:
    """``path`` if it is a file, else a :class:`DataLayoutError` naming it and the layout."""
    if not path.is_file():
        raise DataLayoutError(f"expected annotation file {path} does not exist.\nExpected layout:\n{layout}")
    return path


def require_dir(path: Path, layout: str) -> Path:
    """``path`` if it is a folder, else a :class:`DataLayoutError` naming it and the layout."""
    if not path.is_dir():
        raise DataLayoutError(f"expected image folder {path} does not exist.\nExpected layout:\n{layout}")
    return path


def read_json(path: Path, fix: str = "re-download the annotation file") -> Any:
    """Parse a JSON file; a malformed one (truncated, not UTF-8) raises InputError naming the file and ``fix``."""
    try:
        with path.open("r", encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON ({e}); {fix}") from None


def check_query_file(data: Any, path: Path, fmt: str, top_keys: tuple[str, ...], query_keys: tuple[str, ...],
                     build_hint: str = "") -> None:
    """The checks every JSON query-file format shares: its ``format`` tag, top-level keys, and the
    keys of each query. Each failure is a ValueError naming the file (and the query)."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise InputError(f"{path}: expected format {fmt!r}, got {got!r}" + (f" ({build_hint})" if build_hint else ""))
    for key in top_keys:
        if key not in data:
            raise InputError(f"{path}: missing top-level key {key!r}")
    for q in data["queries"]:
        absent = [k for k in query_keys if k not in q]
        if absent:
            raise InputError(f"{path}: query {q.get('id', '?')} lacks {absent}")


def raise_if_missing(paths: list[Path], what: str, layout: str) -> None:
    """Fail naming the first missing files, for datasets where every image must be present."""
    missing = [p for p in paths if not p.is_file()]
    if missing:
        shown = "\n  ".join(str(p) for p in missing[:5])
        raise DataLayoutError(
            f"{len(missing)} of {len(paths)} {what} images are missing, e.g.\n  {shown}\nExpected layout:\n{layout}"
        )


def index_image_folder(folder: Path) -> dict[str, Path]:
    """Map image stem -> path for every image in ``folder`` (one directory scan, not one stat
    per id). When a stem exists as both .png and .jpg, .png wins (FashionIQ mirrors differ)."""
    found: dict[str, Path] = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            stem, ext = os.path.splitext(entry.name)
            if ext.lower() not in IMAGE_EXTENSIONS or not entry.is_file():
                continue
            if stem not in found or ext.lower() == ".png":
                found[stem] = Path(entry.path)
    return found


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


def load_image(ref: ImageRef) -> Image.Image:
    """Decode ``ref`` to an RGB PIL image: mask the background white, then crop.

    A file that cannot be decoded raises :class:`ImageReadError` naming it.
    """
    try:
        with Image.open(_span_bytes(ref.path, ref.span) if ref.span else ref.path) as img:
            image = to_rgb(img)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageReadError(f"cannot read image {ref.path}: {e}; re-download or remove it from the split") from e
    if ref.segmentation is not None:
        mask = decode_segmentation(ref.segmentation, image.height, image.width)
        white = Image.new("RGB", image.size, (255, 255, 255))
        image = Image.composite(image, white, Image.fromarray(mask * 255))
    if ref.box is not None:
        image = image.crop(_pixel_box(ref.box, image.width, image.height))
    return image
