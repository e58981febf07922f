"""ExclCOCO: exclusion queries ("a dog and a frisbee but not a person") from COCO-format annotations.

The benchmark of *Being Positive about Negative Queries* (ExclMM paper, section 4), built from any
data set in COCO's format: ``instances_{split}.json`` (images, categories, object instances) and
``captions_{split}.json`` (five captions per image in COCO). Steps (:func:`build_exclcoco`):

1. **Labels per image** = the categories of its instances, plus *caption-word labels*: words of
   its captions that appear in the captions of at least ``caption_min_images`` distinct images of
   the split (default 50; 0 = categories only), are alphabetic, at least 3 letters long, not in
   :data:`~demind.exclcoco_labels.STOPWORDS` (function words, verbs, colours, numbers, sizes,
   scene words like "photo") and not a word of a category's name or synonyms ("man" counts as
   person; "bat" of "baseball bat" is no label of its own).
2. **Word normalisation.** Lower case, ``[a-z]+`` tokens, each singularised by
   :func:`~demind.exclcoco_labels.singular` (irregular table, then ``-ies -> -y``,
   ``-ches/-shes/-xes/-sses/-zes -> drop -es``, ``-s -> drop`` except ``-ss/-us/-is``), applied
   to captions and label names alike, so "dogs" mentions "dog" and "skis" / "ski" are one label.
   Category names match as contiguous token sequences ("traffic light"), also through
   :data:`~demind.exclcoco_labels.SYNONYMS` ("man", "woman", "people" -> person; "bike" ->
   bicycle; "plane" -> airplane; "sofa" -> couch; "phone" -> cell phone; ...).
3. **Pairs.** The labels a caption mentions (each must also be in its image's label set; a
   caption that mentions an absent category is not used for it). A caption mentioning n >= 2
   labels gives n combinations (exclude one, include the rest); up to ``max_per_caption`` of them
   are kept, drawn with ``random.Random(seed, caption id)``. A combination already formed from
   another caption of the same image is a duplicate and dropped.
4. **Ground truth** = every image of the split whose label set holds all include labels and not
   the exclude label (the positive image never qualifies: it shows the excluded label). Queries
   with no ground truth are dropped, as are those with more than ``max_ground_truth`` (default
   none); ``max_queries`` keeps a seeded random subset (default all). Ground truth is stored
   explicitly, so the file grows with |queries| x |ground truth|: about 200 MB for a val2017-sized
   split with no caps; for train2017 cap both (e.g. 200,000 queries, 500 ground-truth images).
5. **Query text** from :data:`TEMPLATES` ("… without …", "… but not …", "… with no …",
   "… except for …"; one per query, seeded), or from an LLM through the data_gen engines with
   the few-shot prompt ``demind/gen/exclusion_prompts/<version>.txt`` (``query_source="llm"``);
   an LLM text that fails the quality checks or does not name the excluded label falls back to
   the template and is counted.

Everything is seeded and deterministic; :class:`BuildCounts` (captions read, pairs formed, kept,
dropped by reason) is logged and written into the output.

Output: ``OUT/exclcoco.json`` (format ``demind-exclcoco/1``), read by
:mod:`demind.eval.exclcoco` (``python -m demind.eval --benchmark exclcoco --data-root OUT``)::

    {"format": "demind-exclcoco/1", "split": "val2017",
     "image_root": "../coco/val2017",        # relative to OUT (or absolute)
     "images": {"139": "000000000139.jpg", ...},        # every image = the gallery
     "labels": {"categories": [...], "caption_words": [...]},
     "config": {...}, "counts": {...}, "query_source": "template", "prompt": null,
     "queries": [{"id": "9-0", "image_id": "139", "caption_id": 9,
                  "positive_query": "A dog and a person play with a frisbee.",
                  "query": "a photo of a dog and a frisbee without a person",
                  "include": ["dog", "frisbee"], "exclude": "person",
                  "ground_truth": ["724", ...], "hard_negatives": ["139", ...],
                  "text_source": "template"}, ...]}

``image_id`` is the positive image (the caption's own, showing every label); ``ground_truth``
are image ids (strings, keys of ``images``), sorted; ``hard_negatives`` (optional for readers:
files written before it lack it) the images with every include label *and* the exclude label,
the positive image among them -- what the exclusion AUC ranks the ground truth against.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from demind.coco_files import CAPTION_FIELDS, INSTANCE_FIELDS, load_coco
from demind.exclcoco_labels import (LabelIndex, caption_word_labels, category_phrases, contains_phrase,
                                    image_labels, tokens)
from demind.errors import InputError
from demind.settings import setting
from demind.io import write_json_atomic

log = logging.getLogger(__name__)

FORMAT = "demind-exclcoco/1"
QUERY_SOURCES = ("template", "llm")

# {inc}: "a dog and a frisbee"; {exc}: "a person" (with article); {exc_bare}: "person"
TEMPLATES = (
    "a photo of {inc} without {exc}",
    "{inc} but not {exc}",
    "{inc} with no {exc_bare}",
    "{inc} except for {exc}",
)


@dataclass
class ExclCocoConfig:
    """Choices of the builder (defaults = the documented ExclCOCO recipe)."""

    caption_min_images: int = setting(50, ge=0, help="a caption word becomes a label if it is in the captions of "
                                                     "at least this many images (0: off)")
    max_per_caption: int = setting(3, ge=0, help="exclusion combinations kept per caption")
    max_ground_truth: int = setting(0, ge=0, help="drop queries with more ground-truth images (0: no cap)")
    max_queries: int = setting(0, ge=0, help="keep a seeded random subset of this many queries (0: all)")
    seed: int = setting(0, ge=0, help="seed of the query subset and the LLM's sampling")
    query_source: str = setting("template", choices=("template", "llm"))
    prompt_version: str = setting("v1", refuses="no-such-prompt", help="demind/gen/exclusion_prompts/<version>.txt (llm only)")
    llm_max_tokens: int = setting(40, ge=1)
    image_max_side: int = setting(672, ge=1, help="positive image shrunk before the LLM sees it")


@dataclass
class BuildCounts:
    """What the builder read, formed, kept and dropped (by reason)."""

    images: int = 0
    captions_read: int = 0
    captions_without_image: int = 0
    captions_with_two_labels: int = 0
    mentions_not_in_image: int = 0   # a caption naming a category its instances lack: that mention is unused
    pairs_formed: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    text_sources: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def summary(self) -> str:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        return (f"images {self.images}, captions read {self.captions_read} "
                f"({self.captions_without_image} naming no known image), captions with >= 2 labels "
                f"{self.captions_with_two_labels} ({self.mentions_not_in_image} mentions of labels absent from the "
                f"image unused), pairs formed {self.pairs_formed}, kept {self.kept}; "
                f"dropped: {drops}; query text: {self.text_sources}")


def ground_truth(include: list[str], exclude: str, images_with: dict[str, set[int]]) -> list[int]:
    """Image ids whose label set holds every include label and not the exclude label, sorted.

    images_with: label -> ids of the images whose label set holds it (an inverted index, so a
    query costs set intersections rather than a pass over every image).
    """
    found = set.intersection(*(images_with.get(x, set()) for x in include))
    return sorted(found - images_with.get(exclude, set()))


def hard_negatives(include: list[str], exclude: str, images_with: dict[str, set[int]]) -> list[int]:
    """Image ids whose label set holds every include label *and* the exclude label, sorted: the
    images a method that ignores the exclusion cannot tell from the ground truth (the positive
    image among them)."""
    found = set.intersection(*(images_with.get(x, set()) for x in include))
    return sorted(found & images_with.get(exclude, set()))


def invert(labels: dict[int, frozenset[str]]) -> dict[str, set[int]]:
    """image id -> labels  =>  label -> image ids."""
    out: dict[str, set[int]] = defaultdict(set)
    for image_id, have in labels.items():
        for x in have:
            out[x].add(image_id)
    return dict(out)


def with_article(label: str) -> str:
    return f"{'an' if label[0] in 'aeiou' else 'a'} {label}"


def template_text(include: list[str], exclude: str, rng: random.Random) -> str:
    """One of :data:`TEMPLATES` filled in (the choice is drawn from ``rng``)."""
    inc = " and ".join(with_article(x) for x in include)
    return rng.choice(TEMPLATES).format(inc=inc, exc=with_article(exclude), exc_bare=exclude)


def form_pairs(captions: list[dict[str, Any]], labels: dict[int, frozenset[str]], index: LabelIndex,
               cfg: ExclCocoConfig, counts: BuildCounts) -> list[dict[str, Any]]:
    """Step 3: (caption, include, exclude) combinations, before ground truth."""
    pairs = []
    seen: set[tuple[int, tuple[str, ...], str]] = set()
    for cap in sorted(captions, key=lambda c: c["id"]):
        counts.captions_read += 1
        if cap["image_id"] not in labels:
            counts.captions_without_image += 1
            continue
        have = labels[cap["image_id"]]
        named = index.mentioned(tokens(cap["caption"]))
        present = [x for x in named if x in have]
        if len(named) > len(present):
            counts.mentions_not_in_image += len(named) - len(present)
        if len(present) < 2:
            continue
        counts.captions_with_two_labels += 1
        combos = [([x for x in present if x != ex], ex) for ex in present]
        counts.pairs_formed += len(combos)
        rng = random.Random(f"{cfg.seed}:{cap['id']}")
        rng.shuffle(combos)
        if len(combos) > cfg.max_per_caption:
            counts.drop("over max_per_caption", len(combos) - cfg.max_per_caption)
            combos = combos[:cfg.max_per_caption]
        for k, (include, exclude) in enumerate(combos):
            key = (cap["image_id"], tuple(include), exclude)
            if key in seen:
                counts.drop("duplicate of another caption of the same image")
                continue
            seen.add(key)
            pairs.append({"id": f"{cap['id']}-{k}", "image_id": str(cap["image_id"]), "caption_id": cap["id"],
                          "positive_query": cap["caption"].strip(), "include": include, "exclude": exclude,
                          "_rng": rng})
    return pairs


def build_exclcoco(instances_path: str | Path, captions_path: str | Path, out_dir: str | Path,
                   image_root: str | Path, cfg: ExclCocoConfig | None = None,
                   llm: Callable[[list[dict[str, Any]]], list[str | None]] | None = None,
                   split: str | None = None) -> tuple[Path, BuildCounts]:
    """Build the benchmark into ``out_dir/exclcoco.json``; returns (that path, counts).

    image_root: folder of the split's images (``file_name`` of each image is relative to it).
    llm: for ``query_source="llm"``, a function from query dicts (``positive_query``, ``include``,
        ``exclude``, ``image_path``) to texts (None = rejected, template used); see
        :func:`demind.gen.exclusion.llm_query_writer` for the data_gen-engine one.
    """
    cfg = _check_build_request(cfg, llm)
    started = time.perf_counter()
    instances_path, captions_path, out_dir = Path(instances_path), Path(captions_path), Path(out_dir)
    instances = load_coco(instances_path, INSTANCE_FIELDS)
    captions = load_coco(captions_path, CAPTION_FIELDS)["annotations"]
    counts = BuildCounts(images=len(instances["images"]))
    categories, words, index, labels = build_labels(instances, captions, cfg)
    pairs = form_pairs(captions, labels, index, cfg, counts)
    file_of = {img["id"]: img["file_name"] for img in instances["images"]}
    queries = subsample(attach_ground_truth(pairs, invert(labels), cfg, counts), cfg, counts)
    prompt_record = None
    if cfg.query_source == "llm":
        prompt_record = apply_llm_texts(queries, llm, Path(image_root), file_of)
    counts.kept = len(queries)
    counts.text_sources = dict(Counter(q["text_source"] for q in queries))
    data = benchmark_record(instances, instances_path, captions_path, out_dir, image_root, split, categories, words,
                            cfg, counts, prompt_record, queries)
    path = write_json_atomic(out_dir / "exclcoco.json", data)
    log.info("ExclCOCO %s: %s (%.1f s)", data["split"], counts.summary(), time.perf_counter() - started)
    return path, counts


def _check_build_request(cfg: ExclCocoConfig | None, llm: Callable | None) -> ExclCocoConfig:
    """The recipe to build (the default one for None), refused before any file is read."""
    cfg = cfg or ExclCocoConfig()
    if cfg.query_source not in QUERY_SOURCES:
        raise InputError(f"query_source must be one of {QUERY_SOURCES}, got {cfg.query_source!r}")
    if cfg.query_source == "llm" and llm is None:
        raise ValueError("query_source='llm' needs an llm function (see demind.gen.exclusion.llm_query_writer)")
    return cfg


def build_labels(instances: dict[str, Any], captions: list[dict[str, Any]], cfg: ExclCocoConfig
                 ) -> tuple[list[str], list[str], LabelIndex, dict[int, frozenset[str]]]:
    """Steps 1-2: (category names in id order, caption-word labels, the index of their phrases,
    image id -> its label set)."""
    categories = [c["name"] for c in sorted(instances["categories"], key=lambda c: c["id"])]
    phrases = category_phrases(categories)
    claimed = {t for ph in phrases.values() for p in ph for t in p}  # "bat" of "baseball bat" is no word label
    captions_by_image: dict[int, list[list[str]]] = defaultdict(list)
    for cap in captions:
        captions_by_image[cap["image_id"]].append(tokens(cap["caption"]))
    words = caption_word_labels(captions_by_image, claimed, cfg.caption_min_images)
    phrases.update({w: [(w,)] for w in words})
    index = LabelIndex(categories, words, phrases)
    return categories, words, index, image_labels(instances, captions_by_image, index)


def attach_ground_truth(pairs: list[dict[str, Any]], images_with: dict[str, set[int]], cfg: ExclCocoConfig,
                        counts: BuildCounts) -> list[dict[str, Any]]:
    """Step 4: the pairs with ground truth (within ``max_ground_truth``), given their template text,
    ground truth and hard negatives; the others dropped and counted."""
    queries = []
    for pair in pairs:
        gt = ground_truth(pair["include"], pair["exclude"], images_with)
        if not gt:
            counts.drop("no ground truth")
            continue
        if cfg.max_ground_truth and len(gt) > cfg.max_ground_truth:
            counts.drop("over max_ground_truth")
            continue
        rng = pair.pop("_rng")
        pair["query"] = template_text(pair["include"], pair["exclude"], rng)
        pair["ground_truth"] = [str(i) for i in gt]
        pair["hard_negatives"] = [str(i) for i in hard_negatives(pair["include"], pair["exclude"], images_with)]
        pair["text_source"] = "template"
        queries.append(pair)
    return queries


def subsample(queries: list[dict[str, Any]], cfg: ExclCocoConfig, counts: BuildCounts) -> list[dict[str, Any]]:
    """A seeded random subset of ``max_queries`` queries in their order (all of them when 0 or fewer)."""
    if cfg.max_queries and len(queries) > cfg.max_queries:
        keep = set(random.Random(f"{cfg.seed}:subset").sample(range(len(queries)), cfg.max_queries))
        counts.drop("over max_queries (seeded subset)", len(queries) - cfg.max_queries)
        queries = [q for k, q in enumerate(queries) if k in keep]
    return queries


def benchmark_record(instances: dict[str, Any], instances_path: Path, captions_path: Path, out_dir: Path,
                     image_root: str | Path, split: str | None, categories: list[str], words: list[str],
                     cfg: ExclCocoConfig, counts: BuildCounts, prompt_record: dict[str, Any] | None,
                     queries: list[dict[str, Any]]) -> dict[str, Any]:
    """The content of ``exclcoco.json`` (format in the module docstring)."""
    root_rel = os.path.relpath(Path(image_root).resolve(), out_dir.resolve()) if not Path(image_root).is_absolute() \
        else str(image_root)
    return {
        "format": FORMAT,
        "split": split or instances_path.stem.replace("instances_", ""),
        "source": {"instances": str(instances_path), "captions": str(captions_path)},
        "image_root": root_rel,
        "images": {str(img["id"]): img["file_name"] for img in sorted(instances["images"], key=lambda i: i["id"])},
        "labels": {"categories": categories, "caption_words": words},
        "config": asdict(cfg),
        "counts": asdict(counts),
        "query_source": cfg.query_source,
        "prompt": prompt_record,
        "queries": queries,
    }


def apply_llm_texts(queries: list[dict[str, Any]], llm: Callable, image_root: Path, file_of: dict[int, str]
                    ) -> dict[str, Any] | None:
    """Replace template texts by the LLM's where it names the excluded label (the template stays,
    marked ``template (llm output rejected)``, otherwise). Returns the prompt record of ``llm``."""
    requests = [{**q, "image_path": image_root / file_of[int(q["image_id"])]} for q in queries]
    texts = llm(requests) if requests else []
    if len(texts) != len(queries):
        raise RuntimeError(f"the llm returned {len(texts)} texts for {len(queries)} queries")
    for q, text in zip(queries, texts):
        if text and contains_phrase(tokens(text), tuple(tokens(q["exclude"]))):
            q["query"], q["text_source"] = text, "llm"
        else:
            q["text_source"] = "template (llm output rejected)"
    return getattr(llm, "record", None)
