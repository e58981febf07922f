"""FashionIQ (validation) in its official layout -> :class:`BenchmarkData`.

One group per category (dress, shirt, toptee): queries from ``captions/cap.{cat}.val.json``
(entries ``{"target", "candidate", "captions": [c1, c2]}``), gallery = the category's
``image_splits/split.{cat}.val.json``, images ``images/<id>.png`` or ``.jpg``.

The dataset has known dead links. A query whose reference or target image is missing,
or whose target is not in the gallery split, is *skipped and counted* (reason per query id);
a missing gallery image is left out of the gallery and counted. Nothing is dropped silently.

Caption order: Pic2Word's released code (whose protocol the compared papers follow)
builds ``a photo of * , {captions[1]} and {captions[0]}``; that is the default
(``caption_order="released"``). ``caption_order="file"`` keeps the file's order
(``{captions[0]} and {captions[1]}``, as SEARLE and CLIP4Cir do).

Text-only and Image+Text text: Pic2Word's ``evaluate_fashion`` encodes the whole prompt,
literal ``*`` included (``a photo of * , {cap2} and {cap1}``); that is the default
(``text_form="released"``). ``text_form="captions"`` encodes only the joined captions.
"""

from __future__ import annotations

import logging
from pathlib import Path

from demind.errors import InputError
from demind.retrieval import ImageRef, Query
from demind.io import read_json
from demind.eval.structures import BenchmarkData, QueryGroup, index_image_folder, require_dir, require_file
from demind.json_fields import check_entries
from demind.templates import fill_template

log = logging.getLogger(__name__)

FASHIONIQ_CATEGORIES = ("dress", "shirt", "toptee")
CAPTION_ORDERS = ("released", "file")
TEXT_FORMS = ("released", "captions")
TEMPLATE = "a photo of * , {text}"
RECALL_KS = (10, 50)
LAYOUT = """  DATA_ROOT/
    captions/cap.{dress,shirt,toptee}.val.json   (json/ is accepted too, as in Pic2Word's layout)
    image_splits/split.{dress,shirt,toptee}.val.json
    images/<id>.png or images/<id>.jpg"""


def join_captions(captions: list[str], order: str) -> str:
    """The two relative captions as one text, in the chosen order."""
    if order not in CAPTION_ORDERS:
        raise InputError(f"FashionIQ caption order must be one of {CAPTION_ORDERS}, got {order!r}")
    if len(captions) != 2 or not all(isinstance(c, str) for c in captions):
        raise InputError(f"FashionIQ entries have two captions (strings), got {captions!r}")
    first, second = (captions[1], captions[0]) if order == "released" else (captions[0], captions[1])
    return f"{first.strip()} and {second.strip()}"


def fashioniq_texts(captions: list[str], order: str, text_form: str) -> tuple[str, str]:
    """(composed prompt with one ``*``, Text-only / Image+Text text) for one entry's two captions."""
    if text_form not in TEXT_FORMS:
        raise InputError(f"FashionIQ text form must be one of {TEXT_FORMS}, got {text_form!r}")
    joined = join_captions(captions, order)
    prompt = fill_template(TEMPLATE, text=joined)
    return prompt, prompt if text_form == "released" else joined


def captions_file(root: Path, category: str, split: str = "val", layout: str = LAYOUT) -> Path:
    """``captions/cap.{category}.{split}.json``, or ``json/...`` (Pic2Word's layout); the training
    reader (:mod:`demind.triplets.readers`) finds its split here too."""
    for folder in ("captions", "json"):
        path = root / folder / f"cap.{category}.{split}.json"
        if path.is_file():
            return path
    return require_file(root / "captions" / f"cap.{category}.{split}.json", layout)


def read_fashioniq(
    root: str | Path,
    split: str = "val",
    limit: int | None = None,
    caption_order: str = "released",
    categories: tuple[str, ...] = FASHIONIQ_CATEGORIES,
    text_form: str = "released",
) -> BenchmarkData:
    """Read the FashionIQ validation split (the test split has no public ground truth).

    caption_order: one of :data:`CAPTION_ORDERS`; text_form: one of :data:`TEXT_FORMS`.
    """
    root = Path(root)
    if split != "val":
        raise InputError(f"FashionIQ is evaluated on its validation split; got split {split!r}")
    images = index_image_folder(require_dir(root / "images", LAYOUT))
    groups = [_read_category(root, c, images, caption_order, text_form, limit) for c in categories]
    notes = [
        "FashionIQ: Recall@K = fraction of queries whose target is in the top K of the category's gallery; "
        "average = mean over categories.",
        f"prompt: 'a photo of * , {{caption{2 if caption_order == 'released' else 1}}} and "
        f"{{caption{1 if caption_order == 'released' else 2}}}' (caption order {caption_order!r})",
        "Text-only / Image+Text text: " + ("the whole prompt, '*' included (Pic2Word)" if text_form == "released"
                                           else "the two captions only"),
    ]
    for g in groups:
        if g.skipped or g.gallery_missing:
            notes.append(
                f"WARNING {g.name}: {len(g.skipped)} of {g.total_queries} queries skipped (missing images), "
                f"{len(g.gallery_missing)} gallery images missing; metrics are over the {len(g.queries)} evaluated queries"
            )
    return BenchmarkData("fashioniq", "val", groups, notes=notes,
                         options={"caption_order": caption_order, "text_form": text_form, "template": TEMPLATE})


CAPTION_FIELDS = {"candidate": str, "target": str, "captions": list}
"""What each entry of ``cap.{category}.val.json`` must hold."""


def _read_category(root: Path, category: str, images: dict[str, Path], order: str, text_form: str,
                   limit: int | None) -> QueryGroup:
    captions_path = captions_file(root, category)
    entries = check_entries(read_json(captions_path), CAPTION_FIELDS, str(captions_path))
    if limit is not None:
        entries = entries[:limit]  # the first entries keep their file index as query id
    split_path = require_file(root / "image_splits" / f"split.{category}.val.json", LAYOUT)
    split = read_json(split_path)
    if not isinstance(split, list) or not all(isinstance(i, str) for i in split):
        raise InputError(f"{split_path} must be a list of image ids (strings); re-download the annotation file")
    split_ids = list(split)
    gallery = [ImageRef(i, images[i]) for i in split_ids if i in images]
    gallery_missing = [i for i in split_ids if i not in images]
    in_gallery = {g.name for g in gallery}

    queries, skipped = [], []
    for index, entry in enumerate(entries):
        qid = f"{category}:{index}"
        reason = _skip_reason(entry, images, in_gallery)
        if reason:
            skipped.append({"qid": qid, **reason})
            continue
        prompt, text = fashioniq_texts(entry["captions"], order, text_form)
        queries.append(Query(
            qid=qid,
            reference=ImageRef(str(entry["candidate"]), images[str(entry["candidate"])]),
            prompt=prompt,
            text=text,
            targets=(str(entry["target"]),),
        ))
    if skipped or gallery_missing:
        log.warning("FashionIQ %s: skipped %d of %d queries, %d gallery images missing",
                    category, len(skipped), len(entries), len(gallery_missing))
    return QueryGroup(category, queries, gallery, metric="recall", ks=RECALL_KS,
                      skipped=skipped, gallery_missing=gallery_missing, total_queries=len(entries))


def _skip_reason(entry: dict, images: dict[str, Path], in_gallery: set[str]) -> dict[str, str] | None:
    """Why a query cannot be evaluated (``{"reason": code, "detail": text}``), or None."""
    reference, target = str(entry["candidate"]), str(entry["target"])
    if reference not in images:
        return {"reason": "missing_reference", "detail": f"reference image {reference} missing from images/"}
    if target not in images:
        return {"reason": "missing_target", "detail": f"target image {target} missing from images/"}
    if target not in in_gallery:
        return {"reason": "target_not_in_gallery", "detail": f"target {target} not in the category's gallery split"}
    return None
