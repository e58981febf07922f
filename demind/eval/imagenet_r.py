"""ImageNet-R domain conversion (Pic2Word's lists) -> :class:`BenchmarkData`.

``imgnet_real_query.txt``: ``path label`` per line, real ImageNet images of 200 classes.
``imgnet_targets.txt``: ``path label`` with label = class + 1000 * domain index (cartoon 0,
origami 1, toy 2, sculpture 3; the real-image distractors carry 6000 + class).
One group per domain, in the order cartoon, origami, toy, sculpture; prompt ``a {domain} of *``.
A target is relevant when its label is the query's class + 1000 * the domain's index.

Recall@K follows Pic2Word's released code: per query, the fraction of *all* its relevant
targets found in the top K, averaged over queries (not a hit rate); a query whose class has
no image in the domain contributes 0. The count of such queries is reported.
Paths in the lists start with ``imgnet/``; they are resolved against DATA_ROOT or its parent.
"""

from __future__ import annotations

import logging
from pathlib import Path

from demind.errors import InputError
from demind.retrieval import ImageRef, Query, strip_image_extension
from demind.eval.structures import BenchmarkData, DataLayoutError, QueryGroup, raise_if_missing, require_file
from demind.json_fields import check_unique_ids
from demind.templates import TEMPLATES, fill_template

log = logging.getLogger(__name__)

DOMAINS = ("cartoon", "origami", "toy", "sculpture")
CLASS_OFFSET = 1000
RECALL_KS = (10, 50)
RECALL_DEFINITION = (
    "ImageNet-R: Recall@K (Pic2Word's definition) = per query, the fraction of ALL its relevant targets "
    "(same class, target domain) found in the top K, averaged over queries; NOT a hit rate."
)
LAYOUT = """  DATA_ROOT/                        (Pic2Word's data/imgnet folder)
    imgnet_real_query.txt           lines 'imgnet/real/<wnid>/<file>.JPEG <class>'
    imgnet_targets.txt              lines 'imgnet/imagenet-r/<wnid>/<domain>_<i>.jpg <class + 1000*domain>'
    real/<wnid>/..., imagenet-r/<wnid>/...   (list paths resolve against DATA_ROOT's parent, or DATA_ROOT)"""


def read_image_list(path: Path) -> list[tuple[str, int]]:
    """``path label`` lines -> [(relative path, label)]; a malformed line is an error naming it."""
    items = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise InputError(f"{path}:{line_no}: expected 'path label', got {line!r}")
        try:
            items.append((parts[0], int(parts[1])))
        except ValueError:
            raise InputError(f"{path}:{line_no}: label {parts[1]!r} is not an integer") from None
    return items


def find_list_base(root: Path, relpaths: list[str]) -> Path:
    """The folder the lists' paths are relative to: DATA_ROOT's parent (Pic2Word's data/) or DATA_ROOT."""
    if not relpaths:
        return root
    for base in (root.parent, root):
        if (base / relpaths[0]).is_file():
            return base
    raise DataLayoutError(
        f"image {relpaths[0]} from the lists is neither under {root.parent} nor under {root}.\nExpected layout:\n{LAYOUT}"
    )


def read_imagenet_r(root: str | Path, split: str = "val", limit: int | None = None,
                    domains: tuple[str, ...] = DOMAINS) -> BenchmarkData:
    """Read Pic2Word's ImageNet-R domain-conversion lists under ``root``."""
    root = Path(root)
    if split != "val":
        raise InputError(f"ImageNet-R domain conversion has one split; use 'val', got {split!r}")
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise InputError(f"unknown ImageNet-R domains {unknown}; known: {DOMAINS}")
    query_items = read_image_list(require_file(root / "imgnet_real_query.txt", LAYOUT))
    target_items = read_image_list(require_file(root / "imgnet_targets.txt", LAYOUT))
    # a target is found by name: listed twice under two labels, it would be relevant to both classes
    check_unique_ids(((strip_image_extension(p), label) for p, label in target_items), str(root / "imgnet_targets.txt"),
                     "image")
    if limit is not None:
        query_items = query_items[:limit]
    base = find_list_base(root, [p for p, _ in target_items])
    gallery = [ImageRef(strip_image_extension(p), base / p) for p, _ in target_items]
    references = [ImageRef(strip_image_extension(p), base / p) for p, _ in query_items]
    raise_if_missing([g.path for g in gallery] + [r.path for r in references], "ImageNet-R", LAYOUT)

    grouped: dict[int, list[str]] = {}
    for ref, (_, label) in zip(gallery, target_items):
        grouped.setdefault(label, []).append(ref.name)
    # One shared tuple per label: 40k queries point at a few hundred tuples.
    names_by_label = {label: tuple(names) for label, names in grouped.items()}
    groups = [_domain_group(d, references, query_items, gallery, names_by_label) for d in domains]
    notes = [RECALL_DEFINITION, f"prompt: {TEMPLATES['domain']!r}; domains in order {', '.join(domains)}"]
    for g in groups:
        n_empty = sum(1 for q in g.queries if not q.targets)
        if n_empty:
            notes.append(f"{g.name}: {n_empty} of {len(g.queries)} queries have no relevant target "
                         "(their class has no image in this domain) and count 0, as in Pic2Word's code")
    return BenchmarkData("imagenet-r", "val", groups, notes=notes,
                         options={"domains": list(domains), "template": TEMPLATES["domain"]})


def _domain_group(domain: str, references: list[ImageRef], query_items: list[tuple[str, int]],
                  gallery: list[ImageRef], names_by_label: dict[int, tuple[str, ...]]) -> QueryGroup:
    offset = CLASS_OFFSET * DOMAINS.index(domain)
    prompt = fill_template(TEMPLATES["domain"], domain=domain)
    text = prompt.replace("*", "").strip()  # Pic2Word's Text-only: the prompt without the slot
    queries = [
        Query(qid=f"{i}:{domain}", reference=ref, prompt=prompt, text=text,
              targets=names_by_label.get(label + offset, ()))
        for i, (ref, (_, label)) in enumerate(zip(references, query_items))
    ]
    return QueryGroup(domain, queries, gallery, metric="fraction_recall", ks=RECALL_KS)
