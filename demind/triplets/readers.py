"""Training triplets (reference image, modification text, target image) from three sources.

* CIRR's training split in its official rc2 layout: ``captions/cap.rc2.train.json`` (entries
  ``pairid``, ``reference``, ``target_hard``, ``caption``) and ``image_splits/split.rc2.train.json``
  (name -> ``./train/NN/name.png``), images under DATA_ROOT or DATA_ROOT/img_raw (as the evaluation
  reader, :mod:`demind.eval.cirr`). Every image must be present (an error naming the first missing).
* FashionIQ's training split: ``captions/cap.{dress,shirt,toptee}.train.json`` (or ``json/...``, as the
  evaluation reader accepts; entries ``candidate``, ``target``, ``captions: [c1, c2]``), images
  ``images/<id>.png|jpg``; ``limit`` takes the first N entries of each category (as ``demind-eval``'s). The two captions are joined as
  the evaluation reader joins them (:func:`demind.eval.fashioniq.fashioniq_texts`, same defaults), so
  the model is trained on the text it is evaluated with. The dataset's dead links: a triplet whose
  image is missing is skipped, counted and logged.
* A user's own file, JSON lines (``.jsonl``) or CSV (``.csv``, a header row, one record per line: a
  quote left open is refused naming the line that opened it, never read on into the rows after it): ``reference``,
  ``modification``, ``target`` (image paths relative to the file's folder, or absolute; decoded with
  their EXIF orientation, as a user's photos are in search; cached features keyed by file size and
  modification time besides the path). Optional
  ``hard_modification``: a wrong text naming the same kind of edit with another outcome (the toy
  triplets carry it; hard noise injection needs it), ``id``.

Two triplets under one id (CIRR's ``pairid``, a file's ``id`` column) with different content are
refused naming the file and the id.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path

from demind.errors import InputError
from demind.eval import (
    FASHIONIQ_CATEGORIES, captions_file, fashioniq_texts, find_image_root, index_image_folder, raise_if_missing,
    require_dir, require_file)
from demind.io import read_json, read_jsonl
from demind.json_fields import check_entries, check_string_map, check_unique_ids
from demind.retrieval import ImageRef, file_version
from demind.triplets.config import SOURCES

log = logging.getLogger(__name__)

FILE_FIELDS = ("reference", "modification", "target")
CIRR_LAYOUT = """  DATA_ROOT/
    captions/cap.rc2.train.json
    image_splits/split.rc2.train.json
    train/NN/train-*.png                (or img_raw/train/...: the relative paths in the split file)"""
FASHIONIQ_LAYOUT = """  DATA_ROOT/
    captions/cap.{dress,shirt,toptee}.train.json   (json/ is accepted too, as in Pic2Word's layout)
    images/<id>.png or images/<id>.jpg"""


@dataclass(frozen=True)
class Triplet:
    """One training triplet; ``hard_modification``: a same-kind wrong text (toy data), else None."""

    qid: str
    reference: ImageRef
    modification: str
    target: ImageRef
    hard_modification: str | None = None
    hard_negatives: tuple[ImageRef, ...] = ()  # generated triplets: images mined beside the pair


@dataclass
class TripletSet:
    """The triplets of one source, and what was skipped (qid -> reason)."""

    triplets: list[Triplet]
    skipped: dict[str, str]
    source: str


def read_cirr_train(root: str | Path, limit: int | None = None) -> TripletSet:
    """CIRR's training triplets (reference, caption, target_hard)."""
    root = Path(root)
    captions_path = require_file(root / "captions" / "cap.rc2.train.json", CIRR_LAYOUT)
    fields = {"pairid": int, "reference": str, "target_hard": str, "caption": str}
    entries = check_entries(read_json(captions_path), fields, str(captions_path))
    split_path = require_file(root / "image_splits" / "split.rc2.train.json", CIRR_LAYOUT)
    relpaths = check_string_map(read_json(split_path), str(split_path))
    image_root = find_image_root(root, list(relpaths.values()))
    check_unique_ids(((e["pairid"], e) for e in entries), str(captions_path), "pairid")
    entries = entries[:limit] if limit is not None else entries
    unknown = [n for e in entries for n in (e["reference"], e["target_hard"]) if n not in relpaths]
    if unknown:
        raise InputError(f"{captions_path} names {len(unknown)} image(s) absent from {split_path}, e.g. {unknown[0]!r}")
    refs = {n: ImageRef(n, image_root / relpaths[n]) for e in entries for n in (e["reference"], e["target_hard"])}
    raise_if_missing([r.path for r in refs.values()], "CIRR train", CIRR_LAYOUT)
    triplets = [Triplet(str(e["pairid"]), refs[e["reference"]], e["caption"], refs[e["target_hard"]])
                for e in entries]
    return TripletSet(triplets, {}, "cirr")


def read_fashioniq_train(root: str | Path, categories: tuple[str, ...] = FASHIONIQ_CATEGORIES,
                         caption_order: str = "released", text_form: str = "released",
                         limit: int | None = None) -> TripletSet:
    """FashionIQ's training triplets of ``categories``; the text as :func:`fashioniq_texts` builds the
    Text-only text for ``caption_order`` / ``text_form`` (default: ``demind-eval``'s defaults, so the
    combiner is evaluated on the text form it was trained on). ``limit``: the first N entries of each
    category. Triplets with a missing image are skipped and counted."""
    root = Path(root)
    unknown = [c for c in categories if c not in FASHIONIQ_CATEGORIES]
    if unknown:
        raise InputError(f"FashionIQ categories must be among {FASHIONIQ_CATEGORIES}, got {unknown}")
    images = index_image_folder(require_dir(root / "images", FASHIONIQ_LAYOUT))
    triplets, skipped = [], {}
    for category in categories:
        path = captions_file(root, category, "train", FASHIONIQ_LAYOUT)
        entries = check_entries(read_json(path), {"candidate": str, "target": str, "captions": list}, str(path))
        for index, entry in enumerate(entries[:limit] if limit is not None else entries):
            qid = f"{category}:{index}"
            missing = [i for i in (entry["candidate"], entry["target"]) if i not in images]
            if missing:
                skipped[qid] = f"image {missing[0]} missing from images/"
                continue
            try:
                text = fashioniq_texts(entry["captions"], caption_order, text_form)[1]
            except InputError as e:
                raise InputError(f"{path}[{index}]: {e}") from None
            triplets.append(Triplet(qid, ImageRef(entry["candidate"], images[entry["candidate"]]), text,
                                    ImageRef(entry["target"], images[entry["target"]])))
    if skipped:
        log.warning("FashionIQ train: skipped %d of %d triplets (missing images), e.g. %s",
                    len(skipped), len(skipped) + len(triplets), next(iter(skipped.items())))
    return TripletSet(triplets, skipped, "fashioniq")


def _csv_record(path: Path, number: int, raw: bytes) -> list[str]:
    """The fields of line ``number``: one CSV record per physical line, so a quote left open is
    refused here, at the line that opened it, instead of swallowing the rows after it into one text."""
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff" if number == 1 else "")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}:{number}: not UTF-8 (byte 0x{raw[e.start]:02x}); save the file as UTF-8") from None
    try:
        rows = list(csv.reader([text.rstrip("\r\n")], strict=True))
    except csv.Error as e:
        raise InputError(f"{path}:{number}: not one CSV record ({e}): a quote opened on this line is not closed "
                         f"on it; close it (a CSV triplet is one line; use .jsonl for texts with line breaks)") from None
    return rows[0] if rows else []


def _csv_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of a CSV triplet file: a header row, then one record per line."""
    if not path.is_file():
        raise InputError(f"triplet file {path} does not exist")
    header, rows = None, []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            fields = _csv_record(path, number, raw)
            if header is None:
                header = [h.strip() for h in fields]
                missing = [k for k in FILE_FIELDS if k not in header]
                if missing:
                    raise InputError(f"{path}: the header row must name the columns {', '.join(FILE_FIELDS)} "
                                     f"(missing {', '.join(missing)}; got {header})")
            elif len(fields) != len(header):
                raise InputError(f"{path}:{number}: {len(fields)} fields, the header has {len(header)} "
                                 f"({', '.join(header)}); quote fields that hold commas")
            else:
                rows.append((number, dict(zip(header, fields))))
    if header is None:
        raise InputError(f"triplet file {path} is empty; it needs a header row naming {', '.join(FILE_FIELDS)}")
    return rows


def _file_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of a .jsonl or .csv triplet file."""
    if path.suffix == ".jsonl":
        return read_jsonl(path, "triplet file")
    if path.suffix == ".csv":
        return _csv_rows(path)
    raise InputError(f"triplet file {path} must end in .jsonl or .csv (columns {', '.join(FILE_FIELDS)})")


def read_triplet_file(path: str | Path, limit: int | None = None) -> TripletSet:
    """A user's triplets; every referenced image must exist (an error naming the file, line and image)."""
    path = Path(path)
    folder = path.parent
    triplets, refs = [], {}
    for line, row in _file_rows(path):
        if not isinstance(row, dict):
            raise InputError(f"{path}:{line}: a triplet must be an object with {', '.join(FILE_FIELDS)}")
        for key in FILE_FIELDS:
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise InputError(f"{path}:{line}: {key!r} must be a non-empty string (got {row.get(key)!r})")
        images = []
        for key in ("reference", "target"):
            name = row[key]
            if name not in refs:
                image = Path(name) if Path(name).is_absolute() else folder / name
                if not image.is_file():
                    raise InputError(f"{path}:{line}: {key} image {image} does not exist (paths are relative "
                                     f"to the triplet file's folder)")
                # an edited file is another cache key (as the search index keys files)
                refs[name] = ImageRef(name, image, version=file_version(image.stat()), orient=True)
            images.append(refs[name])
        hard = row.get("hard_modification") or None
        qid = row.get("id")
        triplets.append(Triplet(str(line if qid is None or qid == "" else qid), images[0], row["modification"],
                                images[1], hard))
        if limit is not None and len(triplets) >= limit:
            break
    if not triplets:
        raise InputError(f"triplet file {path} holds no triplets")
    check_unique_ids(((t.qid, t) for t in triplets), str(path), "triplet")
    return TripletSet(triplets, {}, "file")


def read_triplets(source: str, path: str | Path, *, limit: int | None = None,
                  categories: tuple[str, ...] = FASHIONIQ_CATEGORIES) -> TripletSet:
    """Dispatch on ``source`` (one of :data:`SOURCES`)."""
    if source == "cirr":
        return read_cirr_train(path, limit)
    if source == "fashioniq":
        return read_fashioniq_train(path, categories, limit=limit)
    if source == "file":
        return read_triplet_file(path, limit)
    raise InputError(f"data.source must be one of {SOURCES}, got {source!r}")
