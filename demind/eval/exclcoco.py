"""ExclCOCO exclusion queries (format ``demind-exclcoco/1``) -> :class:`BenchmarkData`.

The folder written by :func:`demind.exclcoco.build_exclcoco` (the format is documented there)::

    DATA_ROOT/exclcoco.json
    DATA_ROOT/<image_root>/<file_name> ...   (image_root is relative to DATA_ROOT, or absolute)

Text-to-image retrieval: each query's text is its exclusion query (``query``); the gallery is
every image of the split; the relevant images are ``ground_truth`` (every image with all the
include labels and without the exclude label). The positive image (the caption's own, which
shows the excluded label) is *not* removed from the ranking: it is the natural hard negative.
It is the query's ``reference`` only so that composed methods have an image to read.
Metrics: the ExclMM paper's eight (AP@1, AP@5, MRR@5, MRR@10, NDCG@5, NDCG@10, Hits@5,
Hits@10), defined in :mod:`demind.eval.metrics`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from demind.errors import InputError
from demind.retrieval import ImageRef, Query
from demind.io import read_json
from demind.eval.structures import BenchmarkData, QueryGroup, check_query_file, raise_if_missing, require_file
from demind.model import TEMPLATES, fill_template

FORMAT = "demind-exclcoco/1"
KS = (1, 5, 10)
LAYOUT = """  DATA_ROOT/
    exclcoco.json          format demind-exclcoco/1 (python -m demind.cli.build_exclcoco; see demind/exclcoco.py)
    <image_root>/<file>    the split's images (image_root as recorded in exclcoco.json)"""
QUERY_KEYS = ("id", "image_id", "positive_query", "query", "include", "exclude", "ground_truth")


def check_exclcoco(data: Any, path: Path) -> None:
    """Validate a parsed ``exclcoco.json``; anything malformed is an error naming the file and query."""
    check_query_file(data, path, FORMAT, ("images", "queries", "image_root"), QUERY_KEYS,
                     "build it with python -m demind.cli.build_exclcoco")
    images = data["images"]
    for q in data["queries"]:
        if not q["ground_truth"]:
            raise InputError(f"{path}: query {q['id']} has no ground truth")
        unknown = [i for i in [q["image_id"], *q["ground_truth"]] if i not in images]
        if unknown:
            raise InputError(f"{path}: query {q['id']} names image ids not in 'images': {unknown[:3]}")
        if q["image_id"] in q["ground_truth"]:
            raise InputError(f"{path}: query {q['id']}: its positive image {q['image_id']} shows the excluded "
                             f"label, so it cannot be ground truth")


def load_exclcoco(root: str | Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """Parsed and checked ``root/exclcoco.json`` and image id -> file path."""
    root = Path(root)
    path = require_file(root / "exclcoco.json", LAYOUT)
    data = read_json(path)
    check_exclcoco(data, path)
    image_root = root / data["image_root"]
    return data, {i: image_root / f for i, f in data["images"].items()}


def read_exclcoco(root: str | Path, split: str = "val", limit: int | None = None) -> BenchmarkData:
    """Read an ExclCOCO folder (one split per folder; ``split`` is only recorded)."""
    data, files = load_exclcoco(root)
    gallery = [ImageRef(i, p) for i, p in files.items()]
    raise_if_missing([g.path for g in gallery], "exclcoco", LAYOUT)
    by_id = {g.name: g for g in gallery}
    entries = data["queries"][:limit] if limit is not None else data["queries"]
    queries = [Query(qid=str(q["id"]), reference=by_id[q["image_id"]],
                     prompt=fill_template(TEMPLATES["cirr"], text=q["query"]), text=q["query"],
                     targets=tuple(q["ground_truth"]), exclude=None) for q in entries]
    notes = [f"exclcoco ({data.get('split', '?')}): text -> image retrieval of the exclusion query over every image; "
             "the positive image stays in the ranking; metrics as defined in demind/eval/metrics.py.",
             f"query text source: {data.get('query_source', '?')}; build counts: {data.get('counts', {})}"]
    group = QueryGroup("all", queries, gallery, metric="exclusion", ks=KS)
    return BenchmarkData("exclcoco", data.get("split", split), [group], notes=notes,
                         options={"query_source": data.get("query_source"), "prompt": data.get("prompt")})
