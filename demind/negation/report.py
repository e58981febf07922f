"""How well the rule decomposer works: accuracy on the labelled phrasings, and what it flags in
real CIRR captions. ``python -m demind.cli.negation_report`` prints both.

Labelled set: ``demind/negation/data/phrasings.jsonl``, one JSON object a line with
``query``, ``positive`` (expected positive text), ``negatives`` (expected negative phrases,
[] for a query without negation) and ``cue`` (the cue family, "control" for cue-free and
tricky non-negations). A decomposition is correct when its positive text and its set of
negatives both equal the labels after :func:`normalise_phrase` (lower case, punctuation and
leading determiners dropped, spaces collapsed).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demind.errors import InputError
from demind.io import read_jsonl
from demind.negation.decompose import CUE_PATTERN, CUES, Decomposer, Decomposition, strip_determiner

PHRASINGS = Path(__file__).resolve().parent / "data" / "phrasings.jsonl"
LABEL_KEYS = ("query", "positive", "negatives", "cue")


def normalise_phrase(text: str) -> str:
    """"The red square," -> "red square" (for comparing decompositions with labels)."""
    words = re.sub(r"[^\w*'\s-]", " ", text.lower()).split()
    return strip_determiner(" ".join(words))


def load_phrasings(path: str | Path = PHRASINGS) -> list[dict[str, Any]]:
    """The labelled phrasings; a malformed line is an error naming the file, line and key."""
    path = Path(path)
    items = []
    for n, item in read_jsonl(path, what="labelled phrasings"):
        if not isinstance(item, dict):
            raise InputError(f"{path}:{n}: expected an object with keys {list(LABEL_KEYS)}, got {type(item).__name__}")
        missing = [k for k in LABEL_KEYS if k not in item]
        if missing:
            raise InputError(f"{path}:{n}: missing key(s) {missing}; each line needs {list(LABEL_KEYS)}")
        for key in ("query", "positive", "cue"):
            if not isinstance(item[key], str):
                raise InputError(f"{path}:{n}: key {key!r} must be a string, got {json.dumps(item[key])}")
        if not isinstance(item["negatives"], list) or not all(isinstance(x, str) for x in item["negatives"]):
            raise InputError(f"{path}:{n}: key 'negatives' must be a list of strings, got {json.dumps(item['negatives'])}")
        items.append(item)
    return items


def is_correct(d: Decomposition, item: dict[str, Any]) -> bool:
    """Positive text and the set of negatives equal the labels (after normalisation)."""
    return (normalise_phrase(d.positive) == normalise_phrase(item["positive"])
            and sorted(map(normalise_phrase, d.negatives)) == sorted(map(normalise_phrase, item["negatives"])))


@dataclass
class Accuracy:
    correct: int
    total: int
    by_cue: dict[str, tuple[int, int]]  # cue family -> (correct, total)
    failures: list[dict[str, Any]]  # the item with "got_positive" / "got_negatives"

    @property
    def fraction(self) -> float:
        return self.correct / self.total if self.total else 0.0


def rule_accuracy(decomposer: Decomposer, items: list[dict[str, Any]]) -> Accuracy:
    """Score ``decomposer`` on labelled ``items`` (see the module docstring)."""
    results = decomposer.decompose([it["query"] for it in items])
    by_cue: dict[str, list[int]] = {}
    failures = []
    for item, d in zip(items, results):
        ok = is_correct(d, item)
        tally = by_cue.setdefault(item["cue"], [0, 0])
        tally[0] += ok
        tally[1] += 1
        if not ok:
            failures.append({**item, "got_positive": d.positive, "got_negatives": list(d.negatives)})
    correct = sum(c for c, _ in by_cue.values())
    return Accuracy(correct, len(items), {k: (c, t) for k, (c, t) in sorted(by_cue.items())}, failures)


def cue_family(d: Decomposition, span: tuple[int, int]) -> str:
    """The cue family of a removed span: "The Target Image does not show X" -> "not",
    "there are no X" -> "no", "Remove the dog" -> "remove" (the longest cue of :data:`CUES` in it)."""
    m = CUE_PATTERN.match(d.query, span[0])
    said = " ".join(m.group().lower().split()) if m else ""
    if "n't" in said:
        return "not"
    found = [c for c in CUES if re.search(rf"\b{re.escape(c)}\b", said)]
    return max(found, key=len) if found else "?"


def cirr_flags(caption_files: list[str | Path], decomposer: Decomposer, examples: int = 3, seed: int = 0
               ) -> dict[str, Any]:
    """What the decomposer flags in CIRR caption files (``cap.rc2.<split>.json``).

    Returns {"captions": N, "flagged": n, "by_cue": {cue: count}, "examples": {cue: [decomposition dicts]}}.
    A caption counts once under each distinct cue it uses.
    """
    captions = []
    for path in caption_files:
        path = Path(path)
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"{path}: cannot read CIRR captions ({e})") from None
        if not isinstance(entries, list):
            raise InputError(f"{path}: expected a CIRR caption file (a list of objects with 'caption'), "
                             f"got {type(entries).__name__}")
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or not isinstance(e.get("caption"), str):
                got = json.dumps(e.get("caption")) if isinstance(e, dict) else type(e).__name__
                raise InputError(f"{path}: entry {i} (pairid {e.get('pairid', '?') if isinstance(e, dict) else '?'}): "
                                 f"key 'caption' must be a string, got {got}")
            captions.append(e["caption"])
    flagged = [d for d in decomposer.decompose(captions) if d.has_negation]
    by_cue: Counter[str] = Counter()
    found: dict[str, list[Decomposition]] = {}
    for d in flagged:
        for cue in dict.fromkeys(cue_family(d, s) for s in d.cues):
            by_cue[cue] += 1
            found.setdefault(cue, []).append(d)
    rng = random.Random(seed)
    picked = {cue: [{"caption": d.query, "positive": d.positive, "negatives": list(d.negatives)}
                    for d in rng.sample(ds, min(examples, len(ds)))] for cue, ds in found.items()}
    return {"captions": len(captions), "flagged": len(flagged), "by_cue": dict(by_cue.most_common()),
            "examples": picked}


def format_report(acc: Accuracy, flags: dict[str, Any] | None) -> str:
    """Plain-text report of :func:`rule_accuracy` and :func:`cirr_flags`."""
    lines = [f"rule decomposer on {acc.total} labelled phrasings: {acc.correct}/{acc.total} correct "
             f"({100 * acc.fraction:.1f} %)",
             "  by cue: " + ", ".join(f"{cue} {c}/{t}" for cue, (c, t) in acc.by_cue.items())]
    for f in acc.failures:
        lines.append(f"  MISS {f['query']!r}: expected +{f['positive']!r} -{f['negatives']} "
                     f"got +{f['got_positive']!r} -{f['got_negatives']}")
    if flags is not None:
        lines.append(f"CIRR captions flagged: {flags['flagged']} of {flags['captions']} "
                     f"({100 * flags['flagged'] / max(flags['captions'], 1):.1f} %)")
        lines.append("  by cue: " + ", ".join(f"{cue} {n}" for cue, n in flags["by_cue"].items()))
        for cue, exs in flags["examples"].items():
            for e in exs:
                lines.append(f"  [{cue}] {e['caption']!r} -> +{e['positive']!r} -{e['negatives']}")
    return "\n".join(lines)
