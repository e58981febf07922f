"""ExclCOCO exclusion queries (format ``demind-exclcoco/1``) -> :class:`BenchmarkData`.

The folder written by :func:`demind.exclcoco_builder.build_exclcoco` (the format is documented there)::

    DATA_ROOT/exclcoco.json
    DATA_ROOT/<image_root>/<file_name> ...   (image_root is relative to DATA_ROOT, or absolute)

Text-to-image retrieval: each query's text is its exclusion query (``query``); the gallery is
every image of the split; the relevant images are ``ground_truth`` (every image with all the
include labels and without the exclude label). The positive image (the caption's own, which
shows the excluded label) is *not* removed from the ranking: it is the natural hard negative.
It is the query's ``reference`` only so that composed methods have an image to read.
Metrics: the ExclMM paper's eight (AP@1, AP@5, MRR@5, MRR@10, NDCG@5, NDCG@10, Hits@5,
Hits@10), and, when the file lists each query's ``hard_negatives`` (images with every included
object and the excluded one), exclusion AUC and inclusion AUC over every gallery score (the
group's ``hard_negatives``); all defined in :mod:`demind.eval.metrics`. A file written before the
builder recorded hard negatives is read as before; a note says why it has no AUCs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from demind.errors import InputError
from demind.retrieval import ImageRef, Query
from demind.io import read_json
from demind.eval.structures import BenchmarkData, QueryGroup, check_query_file, raise_if_missing, require_file
from demind.json_fields import check_unique_ids
from demind.templates import TEMPLATES, fill_template

FORMAT = "demind-exclcoco/1"
KS = (1, 5, 10)
LAYOUT = """  DATA_ROOT/
    exclcoco.json          format demind-exclcoco/1 (python -m demind.cli.build_exclcoco; see demind/exclcoco_builder.py)
    <image_root>/<file>    the split's images (image_root as recorded in exclcoco.json)"""
QUERY_KEYS = ("id", "image_id", "positive_query", "query", "include", "exclude", "ground_truth")


def check_exclcoco(data: Any, path: Path) -> None:
    """Validate a parsed ``exclcoco.json``; anything malformed is an error naming the file and query."""
    check_query_file(data, path, FORMAT, ("images", "queries", "image_root"), QUERY_KEYS,
                     "build it with python -m demind.cli.build_exclcoco")
    images = data["images"]
    check_unique_ids(((q["id"], q) for q in data["queries"]), str(path))  # results are keyed by query id
    for q in data["queries"]:
        if not q["ground_truth"]:
            raise InputError(f"{path}: query {q['id']} has no ground truth")
        unknown = [i for i in [q["image_id"], *q["ground_truth"]] if i not in images]
        if unknown:
            raise InputError(f"{path}: query {q['id']} names image ids not in 'images': {unknown[:3]}")
        if q["image_id"] in q["ground_truth"]:
            raise InputError(f"{path}: query {q['id']}: its positive image {q['image_id']} shows the excluded "
                             f"label, so it cannot be ground truth")
    check_hard_negatives(data["queries"], images, path)


def check_hard_negatives(queries: list[dict[str, Any]], images: dict[str, str], path: Path) -> None:
    """``hard_negatives`` is optional, but all or none: a file with it on some queries only, an id
    not in ``images`` or one that is also ground truth would give AUCs that mean nothing."""
    having = [q for q in queries if "hard_negatives" in q]
    if not having:
        return
    if len(having) < len(queries):
        lacking = next(q for q in queries if "hard_negatives" not in q)
        raise InputError(f"{path}: query {lacking['id']} lacks 'hard_negatives', which {len(having)} of the "
                         f"{len(queries)} queries have; rebuild the file with python -m demind.cli.build_exclcoco")
    for q in having:
        hard = q["hard_negatives"]
        if not isinstance(hard, list):
            raise InputError(f"{path}: query {q['id']}: 'hard_negatives' must be a list of image ids, "
                             f"got {type(hard).__name__}")
        unknown = [i for i in hard if i not in images]
        if unknown:
            raise InputError(f"{path}: query {q['id']}: 'hard_negatives' names image ids not in 'images': "
                             f"{unknown[:3]}")
        both = sorted(set(hard) & set(q["ground_truth"]))
        if both:
            raise InputError(f"{path}: query {q['id']}: images {both[:3]} are both ground truth and hard "
                             f"negatives (a hard negative shows the excluded label)")


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
    hard = None
    if entries and "hard_negatives" in entries[0]:
        hard = {str(q["id"]): tuple(q["hard_negatives"]) for q in entries}
        notes.append("exclusion AUC: P(a ground-truth image outscores a hard negative), among the images showing "
                     "every included object; inclusion AUC: those images against the rest of the gallery; "
                     "over every gallery score, ties 1/2, averaged over queries.")
    elif entries:
        notes.append(f"{Path(root) / 'exclcoco.json'} lists no hard_negatives (written before the builder recorded "
                     "them): exclusion AUC and inclusion AUC are not reported; rebuild it with "
                     "python -m demind.cli.build_exclcoco to get them.")
    group = QueryGroup("all", queries, gallery, metric="exclusion", ks=KS, hard_negatives=hard)
    return BenchmarkData("exclcoco", data.get("split", split), [group], notes=notes,
                         options={"query_source": data.get("query_source"), "prompt": data.get("prompt")})
