"""CIRCO in its official layout -> :class:`BenchmarkData` (beyond the paper's tables).

``annotations/{val,test}.json``: ``{"id", "reference_img_id", "target_img_id",
"relative_caption", "shared_concept", "gt_img_ids"}`` (no targets on test). Gallery = every
image of ``COCO2017_unlabeled/annotations/image_info_unlabeled2017.json`` under
``COCO2017_unlabeled/unlabeled2017/``. mAP@5/10/25/50 over ``gt_img_ids``.
The reference is not excluded from the ranking, as in CIRCO's and SEARLE's evaluation code.
Gallery names are file stems (``000000243611``); the test submission uses integer ids.
"""

from __future__ import annotations

from pathlib import Path

from demind.errors import InputError
from demind.retrieval import ImageRef, Query, canonical_name
from demind.io import read_json
from demind.eval.structures import (BenchmarkData, DataLayoutError, QueryGroup, index_image_folder, require_dir,
                                    require_file)
from demind.json_fields import check_entries, check_object, check_unique_ids
from demind.templates import TEMPLATES, fill_template

MAP_KS = (5, 10, 25, 50)
LAYOUT = """  DATA_ROOT/
    annotations/{val,test}.json
    COCO2017_unlabeled/annotations/image_info_unlabeled2017.json
    COCO2017_unlabeled/unlabeled2017/000000243611.jpg ..."""


QUERY_FIELDS = {"id": int, "reference_img_id": int, "relative_caption": str}
"""What each query of ``annotations/{split}.json`` must hold (``gt_img_ids`` too, in val)."""


def read_circo(root: str | Path, split: str = "val", limit: int | None = None) -> BenchmarkData:
    """Read CIRCO ``split`` (``val`` or ``test``) under ``root``."""
    root = Path(root)
    if split not in ("val", "test"):
        raise InputError(f"CIRCO split must be 'val' or 'test', got {split!r}")
    annotations_path = require_file(root / "annotations" / f"{split}.json", LAYOUT)
    fields = {**QUERY_FIELDS, "gt_img_ids": list} if split == "val" else QUERY_FIELDS
    annotations = check_entries(read_json(annotations_path), fields, str(annotations_path))
    info_path = require_file(root / "COCO2017_unlabeled" / "annotations" / "image_info_unlabeled2017.json", LAYOUT)
    info = check_object(read_json(info_path), {"images": list}, str(info_path))
    check_entries(info["images"], {"id": int, "file_name": str}, f"{info_path}: images")
    check_unique_ids(((a["id"], a) for a in annotations), str(annotations_path))  # rankings are keyed by query id
    check_unique_ids(((im["id"], im["file_name"]) for im in info["images"]), f"{info_path}: images", "image")
    on_disk = index_image_folder(require_dir(root / "COCO2017_unlabeled" / "unlabeled2017", LAYOUT))

    stem_by_id = {int(im["id"]): canonical_name(im["file_name"]) for im in info["images"]}
    missing = [s for s in stem_by_id.values() if s not in on_disk]
    if missing:
        raise DataLayoutError(f"{len(missing)} of {len(stem_by_id)} CIRCO gallery images are missing from "
                              f"{root / 'COCO2017_unlabeled' / 'unlabeled2017'}, e.g. {missing[:5]}.\n"
                              f"Expected layout:\n{LAYOUT}")
    gallery = [ImageRef(s, on_disk[s]) for s in stem_by_id.values()]
    by_name = {g.name: g for g in gallery}

    has_gt = split == "val"
    if limit is not None:
        annotations = annotations[:limit]
    queries = [_query(a, stem_by_id, by_name, has_gt) for a in annotations]
    group = QueryGroup("all", queries, gallery, metric="map", ks=MAP_KS)
    notes = ["CIRCO: mAP@K over all gt_img_ids, AP@K = sum_{i<=K} P@i*rel_i / min(K, #gt); "
             "the reference is not excluded (official protocol).",
             f"prompt: {TEMPLATES['cirr']!r}"]
    return BenchmarkData("circo", split, [group], has_ground_truth=has_gt, notes=notes,
                         options={"template": TEMPLATES["cirr"]},
                         submission_ids={v: k for k, v in stem_by_id.items()})


def _query(entry: dict, stem_by_id: dict[int, str], by_name: dict[str, ImageRef], has_gt: bool) -> Query:
    def name_of(image_id: int) -> str:
        if int(image_id) not in stem_by_id:
            raise InputError(f"CIRCO query {entry['id']} names image id {image_id}, absent from image_info_unlabeled2017.json")
        return stem_by_id[int(image_id)]

    caption = entry["relative_caption"]
    return Query(
        qid=str(entry["id"]),
        reference=by_name[name_of(entry["reference_img_id"])],
        prompt=fill_template(TEMPLATES["cirr"], text=caption),
        text=caption,
        targets=tuple(name_of(i) for i in entry["gt_img_ids"]) if has_gt else (),
    )
