"""CIRR (rc2) in its official layout -> :class:`BenchmarkData`.

Queries come from ``captions/cap.rc2.{val,test1}.json``; the gallery is every image of
``image_splits/split.rc2.{val,test1}.json`` (name -> relative path such as
``./dev/dev-244-0-img0.png``). The reference is excluded from its own ranking by name.
Recall@1/5/10/50 and Recall_subset@1/2/3 over ``img_set.members`` minus the reference.
"""

from __future__ import annotations

import logging
from pathlib import Path

from demind.errors import InputError
from demind.retrieval import ImageRef, Query, canonical_name
from demind.io import read_json
from demind.eval.structures import BenchmarkData, DataLayoutError, QueryGroup, raise_if_missing, require_file
from demind.json_fields import check_entries, check_object, check_string_map, check_unique_ids
from demind.templates import TEMPLATES, fill_template

log = logging.getLogger(__name__)

SPLITS = {"val": "val", "test": "test1", "test1": "test1"}
LAYOUT = """  DATA_ROOT/
    captions/cap.rc2.{val,test1}.json
    image_splits/split.rc2.{val,test1}.json
    dev/dev-*.png, test1/test1-*.png      (or img_raw/dev/..., img_raw/test1/...: the relative paths
                                          in the split file, under DATA_ROOT or DATA_ROOT/img_raw)"""
RECALL_KS = (1, 5, 10, 50)
SUBSET_KS = (1, 2, 3)


def find_image_root(root: Path, relpaths: list[str]) -> Path:
    """The folder the split's relative paths start from: DATA_ROOT or DATA_ROOT/img_raw."""
    top = Path(relpaths[0] if relpaths else "./dev/x.png").parent  # "./dev/x.png" -> dev
    for candidate in (root, root / "img_raw"):
        if (candidate / top).is_dir():
            return candidate
    raise DataLayoutError(
        f"expected image folder {root / top} (or {root / 'img_raw' / top}) does not exist.\nExpected layout:\n{LAYOUT}"
    )


CAPTION_FIELDS = {"pairid": int, "reference": str, "caption": str, "img_set": dict}
"""What each entry of ``cap.rc2.{split}.json`` must hold (``target_hard`` too, where there is ground truth)."""


def read_cirr(root: str | Path, split: str = "val", limit: int | None = None) -> BenchmarkData:
    """Read CIRR ``split`` (``val`` or ``test``/``test1``) from ``root``."""
    root = Path(root)
    if split not in SPLITS:
        raise InputError(f"CIRR split must be one of {sorted(SPLITS)}, got {split!r}")
    name = SPLITS[split]
    captions_path = require_file(root / "captions" / f"cap.rc2.{name}.json", LAYOUT)
    fields = CAPTION_FIELDS if name == "test1" else {**CAPTION_FIELDS, "target_hard": str}
    captions = check_entries(read_json(captions_path), fields, str(captions_path))
    for i, entry in enumerate(captions):
        check_object(entry["img_set"], {"members": list}, f"{captions_path}[{i}].img_set")
    check_unique_ids(((e["pairid"], e) for e in captions), str(captions_path), "pairid")  # rankings are keyed by it
    split_path = require_file(root / "image_splits" / f"split.rc2.{name}.json", LAYOUT)
    name_to_relpath: dict[str, str] = check_string_map(read_json(split_path), str(split_path))
    image_root = find_image_root(root, list(name_to_relpath.values()))

    gallery = [ImageRef(canonical_name(n), image_root / rel) for n, rel in name_to_relpath.items()]
    raise_if_missing([g.path for g in gallery], f"CIRR {name}", LAYOUT)
    by_name = {g.name: g for g in gallery}

    has_gt = name != "test1"
    queries = [_query(entry, by_name, has_gt, name) for entry in captions]
    if limit is not None:
        queries = queries[:limit]
    group = QueryGroup("all", queries, gallery, metric="recall", ks=RECALL_KS, subset_ks=SUBSET_KS)
    notes = [
        "CIRR: Recall@K = fraction of queries whose target is in the top K of the whole split "
        "(reference excluded); Recall_subset@K ranks only img_set.members minus the reference.",
        f"prompt: {TEMPLATES['cirr']!r}",
    ]
    return BenchmarkData("cirr", name, [group], has_ground_truth=has_gt, notes=notes,
                         options={"template": TEMPLATES["cirr"]})


def _query(entry: dict, by_name: dict[str, ImageRef], has_gt: bool, split: str) -> Query:
    """One caption entry -> Query; names not in the split file are an error naming them."""
    pairid = str(entry["pairid"])
    ref_name = canonical_name(entry["reference"])
    members = [canonical_name(m) for m in entry["img_set"]["members"]]
    needed = [ref_name, *members] + ([canonical_name(entry["target_hard"])] if has_gt else [])
    unknown = [n for n in needed if n not in by_name]
    if unknown:
        raise InputError(f"CIRR {split} pairid {pairid} names images {unknown} absent from split.rc2.{split}.json")
    subset = tuple(m for m in members if m != ref_name)
    targets = (canonical_name(entry["target_hard"]),) if has_gt else ()
    return Query(
        qid=pairid,
        reference=by_name[ref_name],
        prompt=fill_template(TEMPLATES["cirr"], text=entry["caption"]),
        text=entry["caption"],
        targets=targets,
        exclude=ref_name,
        subset=subset,
        target_description=entry.get("target_description"),  # toy CIRR only: the oracle's text
    )
