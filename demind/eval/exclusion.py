"""Exclusion ("... without the red square") retrieval -> :class:`BenchmarkData`.

A negation-aware benchmark in this project's own format ``demind-toy-exclusion/1``,
written by the toy world (:func:`toyworld.benchmarks.write_exclusion`)::

    DATA_ROOT/exclusion.json
    {"format": "demind-toy-exclusion/1",
     "images": {NAME: "images/NAME.png", ...},
     "queries": [{"id": 0, "reference": NAME, "target": NAME,
                  "text": "a photo of a blue circle on grass without the red square",
                  "modification": "without the red square",
                  "positives": [NAME, ...], "hard_negatives": [NAME, ...],
                  "target_description": "A photo of ..." (optional: the oracle method's text), ...}, ...]}

Composed query: the reference image (which shows the excluded object) with
``modification`` in the CIRR template; Text-only uses ``text``. Gallery = every image
in ``images``; the reference itself is excluded from its ranking, as in CIRR. A query
is answered by any of its ``positives`` (every kept object, the same background and
style, no excluded object), so the metric is mAP@K over the positives, as in CIRCO.
``hard_negatives`` (the same scene *with* the excluded object) are what a method that
ignores "without" ranks first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from demind.errors import InputError
from demind.retrieval import ImageRef, Query
from demind.io import read_json
from demind.eval.structures import BenchmarkData, QueryGroup, check_query_file, raise_if_missing, require_file
from demind.templates import TEMPLATES, fill_template

FORMAT = "demind-toy-exclusion/1"
EXCLUSION_FORMAT = FORMAT  # the name demind.eval gives it
MAP_KS = (1, 5, 10, 25)
LAYOUT = """  DATA_ROOT/
    exclusion.json                  format demind-toy-exclusion/1 (see demind/eval/exclusion.py)
    images/NAME.png ..."""
QUERY_KEYS = ("id", "reference", "modification", "text", "positives")


def check_exclusion(data: Any, path: Path) -> None:
    """Validate a parsed exclusion file; anything malformed is an error naming the file and query."""
    check_query_file(data, path, FORMAT, ("images", "queries"), QUERY_KEYS)
    images = data["images"]
    for q in data["queries"]:
        named = [q["reference"], *q["positives"], *q.get("hard_negatives", [])] + ([q["target"]] if "target" in q else [])
        missing = [n for n in named if n not in images]
        if missing:
            raise InputError(f"{path}: query {q['id']} names images not in 'images': {missing[:3]}")
        if not q["positives"]:
            raise InputError(f"{path}: query {q['id']} has no positives")
        if "target" in q and q["target"] not in q["positives"]:
            raise InputError(f"{path}: query {q['id']}: target {q['target']} is not among its positives")
        if q["reference"] in q["positives"]:
            raise InputError(f"{path}: query {q['id']}: its reference {q['reference']} cannot be a positive")


def read_exclusion(root: str | Path, split: str = "val", limit: int | None = None) -> BenchmarkData:
    """Read ``root/exclusion.json`` and its images (``split`` must be ``val``)."""
    root = Path(root)
    if split != "val":
        raise InputError(f"the exclusion benchmark has one split, 'val'; got {split!r}")
    path = require_file(root / "exclusion.json", LAYOUT)
    data = read_json(path)
    check_exclusion(data, path)
    gallery = [ImageRef(name, root / rel) for name, rel in data["images"].items()]
    raise_if_missing([g.path for g in gallery], "exclusion", LAYOUT)
    by_name = {g.name: g for g in gallery}
    entries = data["queries"][:limit] if limit is not None else data["queries"]
    queries = [Query(qid=str(q["id"]), reference=by_name[q["reference"]],
                     prompt=fill_template(TEMPLATES["cirr"], text=q["modification"]), text=q["text"],
                     targets=tuple(q["positives"]), exclude=q["reference"],
                     target_description=q.get("target_description")) for q in entries]
    notes = ["exclusion: mAP@K over each query's positives (kept objects present, excluded object absent); "
             "the reference is excluded from its own ranking.", f"prompt: {TEMPLATES['cirr']!r}"]
    return BenchmarkData("exclusion", "val", [QueryGroup("all", queries, gallery, metric="map", ks=MAP_KS)],
                         notes=notes, options={"template": TEMPLATES["cirr"]})
