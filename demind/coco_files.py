"""COCO-format annotation files (``instances_{split}.json``, ``captions_{split}.json``), read with the
fields each reader uses checked.

A missing file, one that is not JSON, or an entry whose field is absent or of the wrong JSON type
is one error naming the file, the entry (``annotations[3]``) and the field. COCO ids are numbers:
a string id (``"category_id": "2"``) would silently match nothing, so it is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from demind.errors import InputError, MissingInputError
from demind.io import read_json
from demind.json_fields import check_entries, check_unique_ids

INSTANCE_FIELDS = {"images": {"id": int, "file_name": str}, "annotations": {"image_id": int, "category_id": int},
                   "categories": {"id": int, "name": str}}
"""What the ExclCOCO builder reads of ``instances_{split}.json``: top-level key -> {field: JSON type}."""

CAPTION_FIELDS = {"annotations": {"id": int, "image_id": int, "caption": str}}
"""What the ExclCOCO builder and ExclMM read of ``captions_{split}.json``."""


def load_coco(path: str | Path, fields: dict[str, dict[str, type]]) -> dict[str, Any]:
    """The COCO file at ``path``, each ``data[key]`` checked to be a list of objects holding
    ``fields[key]`` with their JSON types; else MissingInputError / InputError naming the file,
    the entry and the field."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path} does not exist (expected a COCO-format annotation file)")
    data = read_json(path)
    if not isinstance(data, dict):
        raise InputError(f"{path} holds a JSON {type(data).__name__}, not a COCO-format object; is it the right file?")
    absent = [k for k in fields if k not in data]
    if absent:
        raise InputError(f"{path} lacks the COCO key(s) {absent}; is it the right file?")
    for key, wanted in fields.items():
        check_entries(data[key], wanted, f"{path}: {key}")
        if "id" in wanted:  # images, categories and annotations are looked up by id
            check_unique_ids(((e["id"], e) for e in data[key]), f"{path}: {key}", key.removesuffix("s"))
    return data
