"""The released MegaPairs data set's layout (``data.source=megapairs``).

MegaPairs (huggingface.co/datasets/JUNJIE99/MegaPairs) releases its 26 M triplets as rows of
``q_img`` (the query image's path), ``q_text`` (the instruction; a list of them is read as one triplet
each), ``t_img`` (the target image's path) and ``hns`` (hard-negative image paths), beside the image
folders. ``data.path`` is such a file, JSON lines (``.jsonl``) or Parquet (``.parquet``); image paths
are relative to its folder (or absolute). A row whose image is missing is a counted skip (the
images are a separate, large download); a row without ``q_img``, ``q_text`` or ``t_img`` is an
error naming the file and row.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from demind.errors import InputError
from demind.io import read_jsonl
from demind.retrieval import ImageRef, file_version
from demind.triplets.readers import Triplet, TripletSet

log = logging.getLogger(__name__)

FIELDS = ("q_img", "q_text", "t_img", "hns")


def _rows(path: Path) -> list[tuple[int, Any]]:
    if path.suffix == ".jsonl":
        return read_jsonl(path, "MegaPairs file")
    if path.suffix == ".parquet":
        if not path.is_file():
            raise InputError(f"MegaPairs file {path} does not exist")
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    raise InputError(f"data.path={path}: a MegaPairs file ends in .jsonl or .parquet (rows of {', '.join(FIELDS)})")


def read_megapairs(path: str | Path, limit: int | None = None) -> TripletSet:
    """The rows of a MegaPairs-layout file as triplets (each instruction one), hard negatives attached."""
    path = Path(path)
    folder, refs, skipped, triplets = path.parent, {}, {}, []

    def ref(name: str) -> ImageRef | None:
        if name not in refs:
            image = Path(name) if Path(name).is_absolute() else folder / name
            refs[name] = ImageRef(name, image, version=file_version(image.stat())) if image.is_file() else None
        return refs[name]

    for row_number, row in _rows(path):
        where = f"{path}:{row_number}"
        if not isinstance(row, dict) or not all(isinstance(row.get(k), (str, list)) and row.get(k)
                                                for k in ("q_img", "q_text", "t_img")):
            raise InputError(f"{where}: a MegaPairs row needs q_img, q_text and t_img (got {sorted(row) if isinstance(row, dict) else row!r})")
        texts = row["q_text"] if isinstance(row["q_text"], list) else [row["q_text"]]
        texts = [t.strip() for t in texts if isinstance(t, str) and t.strip()]
        query, target = ref(str(row["q_img"])), ref(str(row["t_img"]))
        if query is None or target is None or not texts:
            skipped[str(row_number)] = "image missing" if texts else "no instruction"
            continue
        hard = tuple(r for r in (ref(str(n)) for n in (row.get("hns") or [])) if r is not None)
        for i, text in enumerate(texts):
            triplets.append(Triplet(f"{row_number}:{i}", query, text, target, None, hard))
        if limit is not None and len(triplets) >= limit:
            triplets = triplets[:limit]
            break
    if skipped:
        log.warning("MegaPairs %s: skipped %d rows (an image missing), e.g. row %s", path, len(skipped),
                    next(iter(skipped)))
    if not triplets:
        raise InputError(f"{path} gives no triplet whose images are present (images relative to its folder)")
    return TripletSet(triplets, skipped, "megapairs")
