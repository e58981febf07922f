"""The common query/gallery structure every benchmark reader produces.

A reader turns an official on-disk format into a :class:`BenchmarkData`: one or more
:class:`QueryGroup` (FashionIQ categories, ImageNet-R domains, or a single ``all``), each
with its gallery (a list of :class:`ImageRef`) and its queries (:class:`Query`). Gallery
entries are identified by *name* (image name without folder or extension), so reference
exclusion and ground truth never depend on how a path is spelled. Images and queries themselves
(:class:`ImageRef`, :class:`Query`) belong to the retrieval layer (:mod:`demind.retrieval`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demind.errors import DemindError, InputError
from demind.retrieval import IMAGE_EXTENSIONS, ImageRef, Query


class DataLayoutError(DemindError, FileNotFoundError):
    """An annotation file or image folder is not where the benchmark's layout puts it."""


@dataclass
class QueryGroup:
    """Queries scored against one gallery, with one metric family.

    metric: ``recall`` (hit rate), ``fraction_recall`` (Pic2Word's ImageNet-R recall), ``map`` or
        ``exclusion`` (the ExclMM paper's eight metrics, :func:`demind.eval.metrics.exclusion_metrics`).
    skipped: queries that could not be evaluated, each ``{"qid", "reason", "detail"}`` (counted, reported).
    gallery_missing: gallery names listed by the annotations but absent from disk.
    hard_negatives: query id -> gallery names with every included object and the excluded one
        (ExclCOCO files that list them); with it the group also reports exclusion and inclusion AUC
        (:func:`demind.eval.metrics.exclusion_aucs`). None: not known, no AUCs.
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
    hard_negatives: dict[str, tuple[str, ...]] | None = None

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

