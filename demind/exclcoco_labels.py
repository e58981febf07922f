"""ExclCOCO's label vocabulary: words normalised, category names and synonyms, caption-word labels.

Steps 1-2 of :mod:`demind.exclcoco_builder` (the rules are documented there): :func:`singular`
and :func:`tokens` normalise words, :data:`SYNONYMS` names categories, :data:`STOPWORDS` keeps
function words out of the caption-word labels, :class:`LabelIndex` finds the labels a caption names.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

IRREGULAR = {
    "men": "man", "women": "woman", "people": "person", "persons": "person", "children": "child",
    "mice": "mouse", "knives": "knife", "teeth": "tooth", "feet": "foot", "geese": "goose",
    "sheep": "sheep", "leaves": "leaf", "shelves": "shelf", "loaves": "loaf", "wolves": "wolf",
    "halves": "half", "scarves": "scarf", "giraffes": "giraffe", "skis": "ski", "buses": "bus",
    "glasses": "glass", "dishes": "dish", "boxes": "box", "benches": "bench", "sandwiches": "sandwich",
    "ties": "tie", "pies": "pie", "movies": "movie", "cookies": "cookie", "hoodies": "hoodie",
}
KEEP_S = ("ss", "us", "is", "ous")

# Extra names of COCO categories (key: the category name as in instances_*.json).
SYNONYMS: dict[str, tuple[str, ...]] = {
    "person": ("man", "woman", "people", "boy", "girl", "child", "kid", "guy", "lady", "player",
               "men", "women", "skier", "surfer", "skateboarder", "rider", "baby", "gentleman"),
    "bicycle": ("bike", "cycle"), "motorcycle": ("motorbike", "motor bike", "scooter"),
    "airplane": ("plane", "jet", "aircraft", "airliner"), "car": ("sedan",), "truck": ("pickup",),
    "boat": ("ship", "sailboat", "canoe", "kayak"), "tv": ("television", "monitor"),
    "couch": ("sofa",), "dining table": ("table",), "cell phone": ("phone", "cellphone", "smartphone"),
    "laptop": ("computer", "notebook"), "sports ball": ("ball", "soccer ball", "baseball", "football"),
    "hot dog": ("hotdog",), "donut": ("doughnut",), "potted plant": ("plant", "houseplant"),
    "teddy bear": ("teddy", "stuffed bear"), "hair drier": ("hair dryer", "blow dryer"),
    "skis": ("ski",), "tie": ("necktie",), "cup": ("mug",),
    "handbag": ("purse",), "refrigerator": ("fridge",), "mouse": (), "remote": ("remote control",),
}

STOPWORDS = frozenset("""
a an the and or but not no nor of on in at to for with without from by over under near next into onto
up down out off about above below behind beside between along across around through while as than
is are was were be been being am has have had do does did can could will would should may might
it its this that these those there here their they them he she his her him we our you your who whom
what which where when how very some any all each both few many more most other such one two three four
five six seven eight nine ten several lots lot group bunch pair couple
sitting standing holding looking walking riding playing laying lying sits stands holds looks walks rides
plays lays lies eating parked parking flying hanging covered filled sitting topped wearing waiting
sits made using taking getting going being doing shows showing has having set sitting sit stand look
white black red blue green yellow brown orange pink purple gray grey silver gold dark light colorful
large small big little tall long short old young new different various other another same top side
front back view picture photo image photograph close closeup shot scene background area something
while very together just also near onto inside outside full empty open closed
""".split())


def singular(word: str) -> str:
    """English singular of a lower-case token by rule (see the module docstring)."""
    if word in IRREGULAR:
        return IRREGULAR[word]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    for suffix in ("ches", "shes", "xes", "sses", "zes"):
        if word.endswith(suffix):
            return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(KEEP_S):
        return word[:-1]
    return word


def tokens(text: str) -> list[str]:
    """Lower-case alphabetic tokens, singularised."""
    return [singular(t) for t in re.findall(r"[a-z]+", text.lower())]


def contains_phrase(seq: list[str], phrase: tuple[str, ...]) -> bool:
    """Whether the token list ``seq`` holds ``phrase`` as a contiguous run."""
    n = len(phrase)
    return any(tuple(seq[i:i + n]) == phrase for i in range(len(seq) - n + 1))


@dataclass
class LabelIndex:
    """Label names and the token phrases that mention them."""

    categories: list[str]
    caption_words: list[str]
    phrases: dict[str, list[tuple[str, ...]]]  # label -> token phrases

    def __post_init__(self) -> None:
        # phrase length -> {token tuple: label}, longest first (a dict lookup per position)
        by_length: dict[int, dict[tuple[str, ...], str]] = defaultdict(dict)
        for label, ph in self.phrases.items():
            for p in ph:
                by_length[len(p)].setdefault(p, label)
        self._by_length = sorted(by_length.items(), key=lambda kv: -kv[0])
        self._order = {label: k for k, label in enumerate(self.phrases)}

    def mentioned(self, caption_tokens: list[str]) -> list[str]:
        """Labels the caption names, in label order. Longer phrases claim their tokens first, so
        "a hot dog" names "hot dog" and not "dog"."""
        free = list(caption_tokens)
        found = set()
        for n, table in self._by_length:
            for i in range(len(free) - n + 1):
                label = table.get(tuple(free[i:i + n]))
                if label is not None:
                    found.add(label)
                    free[i:i + n] = [""] * n  # claimed
        return sorted(found, key=self._order.__getitem__)


def category_phrases(categories: list[str]) -> dict[str, list[tuple[str, ...]]]:
    """label -> its name and synonyms as singularised token tuples."""
    return {c: list(dict.fromkeys(tuple(tokens(p)) for p in (c, *SYNONYMS.get(c, ())) if tokens(p)))
            for c in categories}


def caption_word_labels(captions_by_image: dict[int, list[list[str]]], claimed: set[str],
                        min_images: int) -> list[str]:
    """Caption words in the captions of >= ``min_images`` images (see the module docstring)."""
    if min_images <= 0:
        return []
    images_with: Counter[str] = Counter()
    for caps in captions_by_image.values():
        images_with.update({t for toks in caps for t in toks})
    return sorted(w for w, n in images_with.items()
                  if n >= min_images and len(w) >= 3 and w not in STOPWORDS and w not in claimed)


def image_labels(instances: dict[str, Any], captions_by_image: dict[int, list[list[str]]],
                 index: LabelIndex) -> dict[int, frozenset[str]]:
    """image id -> categories of its instances plus the caption-word labels its captions name."""
    cat_name = {c["id"]: c["name"] for c in instances["categories"]}
    labels: dict[int, set[str]] = {img["id"]: set() for img in instances["images"]}
    for ann in instances["annotations"]:
        if ann["image_id"] in labels and ann["category_id"] in cat_name:
            labels[ann["image_id"]].add(cat_name[ann["category_id"]])
    words = set(index.caption_words)
    for image_id, caps in captions_by_image.items():
        if image_id in labels:
            labels[image_id] |= {t for toks in caps for t in toks if t in words}
    return {k: frozenset(v) for k, v in labels.items()}
