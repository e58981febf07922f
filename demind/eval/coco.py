"""COCO object composition (Pic2Word's protocol) -> :class:`BenchmarkData`.

Two sources of queries:

* built from ``annotations/instances_val2017.json`` with a fixed seed
  (:func:`build_coco_queries`): per image, one non-crowd object whose box covers a fraction
  of the image within ``[min_area, max_area]`` is drawn with ``random.Random(seed)`` (images
  in ascending id order); its background is masked white with its instance mask and the box
  is cropped -> reference image. The image's other classes -> text. Masks are decoded by
  :mod:`demind.retrieval.masks` (no pycocotools needed).
  Pic2Word's ``prepare_data.py`` compares the *pixel* box area with 0.05, i.e. it has no real
  lower bound; ours is a fraction (default 5%), so the built set differs from theirs. To
  evaluate on their exact list, read their CSV.
* a query list in Pic2Word's CSV format (``id,query_regions,query_class,classes``, box
  ``x1;y1;x2;y2``, classes ``;``-separated): the box is cropped from ``val2017_masked/`` when
  that folder exists (made by their ``prepare_data.py``), else from ``val2017/`` with a warning.

Prompts: ``released`` (default) is what Pic2Word's released code builds,
``a photo of * and {query_class} and {other classes}`` (Text-only:
``a photo of {query_class} and {other classes}``), including its dangling ``and`` when the
image has no other class (``a photo of * and airplane and ``); ``trimmed`` is the same
without that dangling ``and``; ``prose`` is the papers' wording,
``a photo of * , {obj1} and {obj2}`` (Text-only: ``a photo of {obj1} and {obj2}``).

Query crops: ``released`` (default) resizes the (masked) region straight to the backbone's
input square, as Pic2Word does (``Resize((n_px, n_px))``, no centre-crop);
``center-crop`` gives it the backbone's resize + centre-crop like every other image.
Ground truth = the original image; gallery = all query images; Recall@1/5/10.
"""

from __future__ import annotations

import csv
import logging
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demind.coco_files import load_coco
from demind.errors import InputError
from demind.retrieval import ImageRef, Query, canonical_name
from demind.eval.structures import BenchmarkData, QueryGroup, raise_if_missing, require_dir, require_file
from demind.templates import PLACEHOLDER

log = logging.getLogger(__name__)

PROMPT_FORMS = ("released", "trimmed", "prose")
# query-crop option -> ImageRef.resize (see demind.retrieval.refs.RESIZE_MODES)
QUERY_RESIZES = {"released": "squash", "center-crop": "backbone"}
RECALL_KS = (1, 5, 10)
CSV_HEADER = ["id", "query_regions", "query_class", "classes"]
LAYOUT = """  DATA_ROOT/
    annotations/instances_val2017.json
    val2017/000000000139.jpg ...
    val2017_masked/...              (only with --coco-csv: Pic2Word's prepare_data.py output)
    coco_eval.csv                   (only with --coco-csv: id,query_regions,query_class,classes)"""


@dataclass(frozen=True)
class CocoQuerySpec:
    """One object-composition query before images are attached.

    box: (x1, y1, x2, y2) pixels; segmentation: COCO polygons/RLE or None (CSV queries).
    """

    file_name: str
    box: tuple[float, float, float, float]
    query_class: str
    other_classes: tuple[str, ...]
    segmentation: Any = None


def coco_texts(query_class: str, others: tuple[str, ...], form: str) -> tuple[str, str]:
    """(composed prompt with one ``*``, Text-only text) for one query."""
    if form not in PROMPT_FORMS:
        raise InputError(f"COCO prompt form must be one of {PROMPT_FORMS}, got {form!r}")
    clean = lambda s: " ".join(s.replace(PLACEHOLDER, " ").split())  # noqa: E731 - tiny local helper
    others = tuple(clean(o) for o in others if clean(o))
    if form == "released" and not others:
        # Pic2Word reads an empty ``classes`` field as [""], so " and ".join keeps a dangling "and".
        words = f"{clean(query_class)} and "
        return f"a photo of * and {words}", f"a photo of {words}"
    if form in ("released", "trimmed"):
        words = " and ".join([clean(query_class), *others])
        return f"a photo of * and {words}", f"a photo of {words}"
    if not others:
        return "a photo of *", "a photo"
    words = " and ".join(others)
    return f"a photo of * , {words}", f"a photo of {words}"


QUERY_FIELDS = {"images": {"id": int, "file_name": str, "width": int, "height": int},
                "annotations": {"image_id": int, "category_id": int, "bbox": list},
                "categories": {"id": int, "name": str}}
"""What :func:`build_coco_queries` reads of ``instances_val2017.json`` (key -> {field: JSON type})."""


def build_coco_queries(instances: dict, seed: int = 0, min_area: float = 0.05, max_area: float = 0.5) -> list[CocoQuerySpec]:
    """Draw one object per image from COCO instances, reproducibly.

    An object qualifies when it is not a crowd region and its box area is a fraction of the
    image area strictly between ``min_area`` and ``max_area``. Images without one are left out.
    """
    names = {c["id"]: c["name"] for c in instances["categories"]}
    anns_by_image: dict[int, list[dict]] = defaultdict(list)
    for ann in instances["annotations"]:
        anns_by_image[ann["image_id"]].append(ann)
    rng = random.Random(seed)
    specs = []
    for image in sorted(instances["images"], key=lambda im: im["id"]):
        anns = anns_by_image.get(image["id"], [])
        area = float(image["width"] * image["height"])
        candidates = [a for a in anns if not a.get("iscrowd", 0) and min_area < a["bbox"][2] * a["bbox"][3] / area < max_area]
        if not candidates:
            continue
        chosen = candidates[rng.randrange(len(candidates))]
        query_class = names[chosen["category_id"]]
        classes = list(dict.fromkeys(names[a["category_id"]] for a in anns))  # distinct, annotation order
        x, y, w, h = chosen["bbox"]
        specs.append(CocoQuerySpec(
            file_name=image["file_name"],
            box=(x, y, x + w, y + h),
            query_class=query_class,
            other_classes=tuple(c for c in classes if c != query_class),
            segmentation=chosen["segmentation"],
        ))
    return specs


def read_pic2word_csv(path: Path) -> list[CocoQuerySpec]:
    """Parse Pic2Word's ``coco_eval.csv``; a wrong header is an error naming the file."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0]] != CSV_HEADER:
        raise InputError(f"{path}: expected header {','.join(CSV_HEADER)}, got {rows[0] if rows else 'an empty file'}")
    specs = []
    for line_no, row in enumerate(rows[1:], start=2):
        if len(row) != 4:
            raise InputError(f"{path}:{line_no}: expected 4 columns ({','.join(CSV_HEADER)}), got {row}")
        file_name, region, query_class, classes = (c.strip() for c in row)
        try:
            # Pic2Word reads the box with int(float(x)).
            box = tuple(float(int(float(v))) for v in region.split(";"))
        except ValueError:
            raise InputError(f"{path}:{line_no}: query_regions {region!r} is not x1;y1;x2;y2") from None
        if len(box) != 4:
            raise InputError(f"{path}:{line_no}: query_regions {region!r} is not x1;y1;x2;y2")
        others = tuple(c for c in classes.split(";") if c.strip()) if classes else ()
        specs.append(CocoQuerySpec(file_name, box, query_class, others))
    return specs


def read_coco(
    root: str | Path,
    split: str = "val",
    limit: int | None = None,
    csv_path: str | Path | None = None,
    prompt_form: str = "released",
    query_resize: str = "released",
    seed: int = 0,
    min_area: float = 0.05,
    max_area: float = 0.5,
) -> BenchmarkData:
    """Read (or build) the COCO object-composition queries under ``root``.

    prompt_form: one of :data:`PROMPT_FORMS`; query_resize: one of :data:`QUERY_RESIZES`.
    """
    root = Path(root)
    if query_resize not in QUERY_RESIZES:
        raise InputError(f"COCO query resize must be one of {tuple(QUERY_RESIZES)}, got {query_resize!r}")
    if split != "val":
        raise InputError(f"COCO object composition uses val2017; got split {split!r}")
    images_dir = require_dir(root / "val2017", LAYOUT)
    notes = ["COCO: Recall@K = fraction of queries whose original image is in the top K of all query images."]
    if csv_path is not None:
        specs = read_pic2word_csv(require_file(Path(csv_path), LAYOUT))
        crop_dir = root / "val2017_masked"
        if not crop_dir.is_dir():
            crop_dir = images_dir
            warning = (f"WARNING: {root / 'val2017_masked'} not found: query regions are cropped from val2017/ "
                       "with their background NOT masked (run Pic2Word's prepare_data.py to make it)")
            log.warning(warning)
            notes.append(warning)
        source = {"source": "csv", "csv": str(csv_path), "crop_folder": crop_dir.name}
    else:
        instances = load_coco(require_file(root / "annotations" / "instances_val2017.json", LAYOUT), QUERY_FIELDS)
        specs = build_coco_queries(instances, seed, min_area, max_area)
        crop_dir = images_dir
        source = {"source": "instances", "seed": seed, "min_area": min_area, "max_area": max_area}
        notes.append(f"queries built from instances_val2017.json with seed {seed}, box area fraction in "
                     f"({min_area}, {max_area}), background masked white")
    if limit is not None:
        specs = specs[:limit]
    group = _group(specs, images_dir, crop_dir, prompt_form, QUERY_RESIZES[query_resize])
    notes.append(f"prompt form {prompt_form!r}, e.g. {group.queries[0].prompt!r}" if group.queries else
                 f"prompt form {prompt_form!r}")
    notes.append("query regions resized straight to the backbone's input square, no crop (Pic2Word)"
                 if query_resize == "released" else "query regions resized and centre-cropped like every image")
    options = {"prompt_form": prompt_form, "query_resize": query_resize, **source}
    return BenchmarkData("coco", "val2017", [group], notes=notes, options=options)


def _group(specs: list[CocoQuerySpec], images_dir: Path, crop_dir: Path, form: str, resize: str) -> QueryGroup:
    seen: set[str] = set()
    gallery, queries = [], []
    for spec in specs:
        if spec.file_name in seen:
            raise InputError(f"COCO query list names image {spec.file_name} twice; one query per image expected")
        seen.add(spec.file_name)
        stem = canonical_name(spec.file_name)
        gallery.append(ImageRef(stem, images_dir / spec.file_name))
        box_tag = ";".join(f"{v:g}" for v in spec.box)
        reference = ImageRef(f"{stem}#query[{box_tag}]", crop_dir / spec.file_name, spec.box, spec.segmentation,
                             resize=resize)
        prompt, text = coco_texts(spec.query_class, spec.other_classes, form)
        queries.append(Query(qid=spec.file_name, reference=reference, prompt=prompt, text=text, targets=(stem,)))
    raise_if_missing([g.path for g in gallery] + [q.reference.path for q in queries], "COCO val2017", LAYOUT)
    return QueryGroup("all", queries, gallery, metric="recall", ks=RECALL_KS)
