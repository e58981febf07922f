"""Query decomposition (DEO section 3.1): a query -> what is wanted and what must be absent.

One interface, :class:`Decomposer` (``decompose(list[str]) -> list[Decomposition]``), two
implementations:

* :class:`RuleDecomposer` — English negation and exclusion cues, no model. A query without
  a cue comes back UNCHANGED with no negatives (so DEO leaves it untouched).
* :class:`demind.negation.llm.LLMDecomposer` — an instruct LLM through the data_gen engines,
  falling back to the rules when its answer cannot be parsed.

Conventions of the rule decomposer (the labelled set ``demind/negation/data/phrasings.jsonl``
is written to them, and its accuracy is measured by :mod:`demind.negation.report`):

* A *cue* is a phrase from :data:`CUES` ("without", "with no", "no", "not", "except",
  "but not", "other than", "excluding", "minus", "remove", "get rid of", "instead of", "take
  out", "lose the", ...), matched on word boundaries and case-insensitively, including an
  optional lead-in that belongs to it ("that is not", "there are no", "do not show").
* The negated phrase is the noun phrase after the cue: it ends at punctuation (``, ; . : ! ?``
  and brackets), "but", a relative pronoun ("that", "which", "while"), "with", a preposition
  ("a mug without a handle on a table": the table stays wanted; a phrase that starts with
  a preposition is kept whole: "not in the box"), the next cue, or "and"/"or" followed by
  a verb, a preposition or "as" ("... and make it bigger", "... and as a photo"), or by an
  article of another kind than the phrase's own ("remove the dog and a photo version", "no
  windows and a red carpet"; but "without the belt and the scarf" negates both). A comma list of short items ("no cats, dogs or birds") stays
  in one phrase.
  The phrase is split on "and" / "or" / "nor" / commas into several negatives.
* Negatives are returned without a leading determiner ("the red square" -> "red square").
* The positive text is the query with every cue and negated phrase removed, dangling
  conjunctions and punctuation cleaned; it may be empty ("remove the dog").
* Not negations (left unchanged): "nothing but", "not only", "not just", "no doubt",
  "without a doubt", "no matter", "no wonder", "no longer than", numbers ("no. 5", "No 7"),
  and words that merely contain a cue ("notebook", "knot", "nothing", "cannot", "removal").
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

DETERMINERS = ("the", "a", "an", "any", "some", "all", "every", "its", "his", "her", "their")

# Cue core phrases, longest first where one is a prefix of another.
CUES: tuple[str, ...] = (
    "but not", "and not", "or not", "other than", "rather than", "instead of", "except for", "except",
    "excluding", "exclude", "without", "with no", "minus", "get rid of", "take out", "take away", "take off",
    "remove", "removing", "delete", "lose the", "drop the", "ditch the", "leave out", "free of", "no longer",
    "none of", "no", "not", "never",
)
# Lead-ins swallowed together with "no"/"not"/"never" (they would dangle in the positive otherwise).
_LEAD_IN = (
    r"(?:(?:that|which|who|where)\s+)?"
    r"(?:(?:there|it)\s+)?"
    r"(?:(?:is|are|was|were|has|have|had|does|do|did|should|must|can|will|shall)\s+)?"
)
# "do not show X", "doesn't have X": the verb after the negation belongs to the cue.
_NEGATED_VERBS = r"(?:\s+(?:show|shows|showing|include|includes|including|have|has|having|contain|contains|" \
                 r"containing|feature|features|featuring|want|need|use|wear|wearing|be|any))?"
_CONTRACTED = r"(?:don't|doesn't|didn't|isn't|aren't|wasn't|weren't|hasn't|haven't|shouldn't|mustn't|can't|won't)"

# Phrases that contain a cue but are not negations.
_NOT_NEGATION = re.compile(
    r"\b(?:nothing\s+but|not\s+only|not\s+just|no\s+doubt|without\s+(?:a\s+)?doubt|no\s+matter|no\s+wonder|"
    r"no\s+longer\s+than|no\s+more\s+than|not\s+least|no\.?\s*\d+|all\s+but|not\s+(?:too|very|quite)|"
    # "remove one dog", "remove all but one": a change of count, not an exclusion
    r"remov\w*\s+(?:all\s+but|all\s+except|one|two|three|some|a\s+few|half|several)\b)",
    re.IGNORECASE,
)
_BOUNDARY_WORDS = ("but", "that", "which", "while", "who", "whereas", "with", "so", "because", "though", "although",
                   "where", "when")
# A negated noun phrase ends before a prepositional phrase ("a mug without a handle on a table":
# the table is wanted); a phrase that *starts* with one is kept whole ("not in the box").
_PREPOSITIONS = ("on", "in", "at", "near", "under", "behind", "above", "below", "beside", "inside", "outside", "from",
                 "to", "into", "onto", "over", "around", "by", "for", "during", "against", "across", "along", "between")
# After "and"/"or", these start a new clause rather than another negated item.
_CLAUSE_STARTERS = (
    "make", "add", "put", "change", "turn", "keep", "show", "shows", "use", "give", "replace", "move", "have", "has",
    "is", "are", "be", "was", "were", "place", "set", "let", "leave", "swap", "zoom", "focus", "display", "include",
    "with", "on", "in", "at", "near", "under", "behind", "above", "below", "inside", "outside", "from", "to", "into",
    "onto", "over", "for", "during", "it", "they", "there", "one", "more", "less", "only", "also", "instead",
    "same", "different", "a", "an", "the", "two", "three", "four", "many", "several", "some", "as",
)
_PUNCT_BOUNDARY = re.compile(r"[;.:!?()\[\]]|,")


@dataclass(frozen=True)
class Decomposition:
    """One query's decomposition.

    query: the input text; positive: what is wanted (the query itself when there is no cue;
    may be empty when the query only excludes, e.g. "remove the dog"); negatives: the phrases
    that must be absent (empty: no negation); cues: the (start, end) character spans of the
    query that were removed (cue and negated phrase together); source: "rules", "llm",
    or "rules-fallback" (the LLM's answer could not be parsed).
    """

    query: str
    positive: str
    negatives: tuple[str, ...] = ()
    cues: tuple[tuple[int, int], ...] = ()
    source: str = "rules"
    positives: tuple[str, ...] = field(default=())  # extra positive restatements (LLM); rules: ()

    @property
    def has_negation(self) -> bool:
        return bool(self.negatives)

    @property
    def positive_texts(self) -> tuple[str, ...]:
        """Every positive sub-query text: ``positive`` first, then any extra restatements."""
        return (self.positive, *[p for p in self.positives if p != self.positive])


def unchanged(query: str, source: str = "rules") -> Decomposition:
    """The decomposition of a query without negation: itself, no negatives."""
    return Decomposition(query=query, positive=query, source=source)


class Decomposer(Protocol):
    """Turns queries into decompositions, one per query, in order."""

    name: str

    def decompose(self, queries: list[str]) -> list[Decomposition]: ...


def strip_determiner(phrase: str) -> str:
    """"the red square" -> "red square"; "any people" -> "people" (one leading determiner)."""
    words = phrase.split()
    if len(words) > 1 and words[0].lower() in DETERMINERS:
        words = words[1:]
    return " ".join(words)


def _cue_regex() -> re.Pattern[str]:
    plain = [c for c in CUES if c not in ("no", "not", "never", "no longer", "none of")]
    core = "|".join(re.escape(c).replace(r"\ ", r"\s+") for c in plain)
    negators = rf"{_LEAD_IN}(?:no\s+longer|none\s+of|no|not|never){_NEGATED_VERBS}"
    contracted = rf"(?:(?:that|which|who|it|there)\s+)?{_CONTRACTED}{_NEGATED_VERBS}"
    return re.compile(rf"\b(?:{contracted}|{negators}|{core})\b", re.IGNORECASE)


CUE_PATTERN = _cue_regex()  # a cue with its lead-in ("that is not", "do not show")


class RuleDecomposer:
    """English negation/exclusion cues -> :class:`Decomposition` (see the module docstring)."""

    name = "rules"

    def decompose(self, queries: list[str]) -> list[Decomposition]:
        return [self.decompose_one(q) for q in queries]

    def decompose_one(self, query: str) -> Decomposition:
        if not isinstance(query, str):
            raise TypeError(f"a query must be a string, got {type(query).__name__}")
        blocked = [m.span() for m in _NOT_NEGATION.finditer(query)]
        spans: list[tuple[int, int]] = []
        negatives: list[str] = []
        pos = 0
        while True:
            match = _find_cue(query, pos, blocked)
            if match is None:
                break
            start, cue_end = match
            end = _scope_end(query, cue_end, query[start:cue_end], blocked)
            items = _split_items(query[cue_end:end])
            if not items:  # a cue with nothing after it ("not.", "... and not"): not a negation
                pos = cue_end
                continue
            negatives.extend(items)
            spans.append((start, end))
            pos = end
        if not negatives:
            return unchanged(query)
        positive = _remove_spans(query, spans)
        return Decomposition(query=query, positive=positive, negatives=tuple(dict.fromkeys(negatives)),
                             cues=tuple(spans), source="rules")


def _find_cue(query: str, pos: int, blocked: list[tuple[int, int]]) -> tuple[int, int] | None:
    for m in CUE_PATTERN.finditer(query, pos):
        if any(b0 <= m.start() < b1 for b0, b1 in blocked):
            continue
        return m.start(), m.end()
    return None


def _scope_end(query: str, start: int, cue: str, blocked: list[tuple[int, int]]) -> int:
    """End (exclusive) of the negated phrase that starts at ``start`` after ``cue``: the first
    clause boundary, where a comma that continues a short list ("no cats, dogs or birds") is
    read past."""
    first = query[start:].split()[:1]
    article = _article_class(first[0]) if first else "none"
    i = start
    while True:
        cut = _boundary_in_words(query, i, article)
        next_cue = _find_cue(query, i, blocked)
        if next_cue is not None and next_cue[0] > i:
            cut = min(cut, next_cue[0])
        punct = _PUNCT_BOUNDARY.search(query, i)
        if punct is not None and punct.start() < cut:
            if punct.group() == "," and _continues_list(query, punct.end()):
                i = punct.end()
                continue
            cut = punct.start()
        return _trim_conjunction(query, start, cut)


def _article_class(word: str) -> str:
    """"the" -> "definite", "a"/"an" -> "indefinite", anything else -> "none"."""
    word = word.lower()
    return "definite" if word == "the" else "indefinite" if word in ("a", "an") else "none"


def _boundary_in_words(text: str, i: int, article: str) -> int:
    """Start of the first word after ``i`` that ends a negated noun phrase (or len(text)).

    ``article``: the article class the negated phrase starts with; "and"/"or" followed by an
    article of another class starts a new clause ("remove the dog and a photo version",
    "no windows and a red carpet"), the same class continues the list ("the belt and the scarf").
    """
    words = list(re.finditer(r"[\w'*-]+", text[i:]))
    for k, w in enumerate(words):
        word = w.group().lower()
        if k > 0 and (word in _BOUNDARY_WORDS or word in _PREPOSITIONS):
            return i + w.start()
        if word in ("and", "or", "nor"):
            if k + 1 == len(words):
                return i + w.start()
            following = words[k + 1].group().lower()
            switches = following in ("the", "a", "an") and _article_class(following) != article
            if k > 0 and ((following in _CLAUSE_STARTERS and following not in DETERMINERS) or switches):
                return i + w.start()
    return len(text)


def _continues_list(text: str, after_comma: int) -> bool:
    """"no cats, dogs or birds": a short item then "or"/"and"/"," continues the negated list."""
    rest = text[after_comma:]
    m = re.match(r"\s*(?:(?:the|a|an|any)\s+)?[\w-]+(?:\s+[\w-]+){0,2}?\s*(?:,|\s(?:or|and|nor)\s)", rest,
                 re.IGNORECASE)
    if m is None:
        return False
    first = rest.split()[0].lower() if rest.split() else ""
    return first not in _CLAUSE_STARTERS or first in DETERMINERS


def _trim_conjunction(text: str, start: int, cut: int) -> int:
    """Do not swallow a trailing "and"/"or" that joins the next (non-negated) clause."""
    segment = text[start:cut]
    m = re.search(r"\s+(?:and|or|nor)\s*$", segment, re.IGNORECASE)
    return start + m.start() if m else cut


def _split_items(segment: str) -> list[str]:
    """"the belt and the scarf" -> ["belt", "scarf"]; determiners dropped; empty items skipped."""
    parts = re.split(r"\s*,\s*(?:(?:and|or|nor)\s+)?|\s+(?:and|or|nor)\s+", segment.strip(), flags=re.IGNORECASE)
    items = []
    for part in parts:
        part = part.strip(" \t\"'")
        part = strip_determiner(part)
        if part and part.lower() not in DETERMINERS:
            items.append(part)
    return items


def _remove_spans(query: str, spans: list[tuple[int, int]]) -> str:
    """The query without ``spans``, with the joints cleaned ("X, and Y" -> "X, Y"; trailing ", " dropped)."""
    pieces = []
    last = 0
    for s, e in spans:
        pieces.append(query[last:s])
        last = e
    pieces.append(query[last:])
    text = " ".join(p.strip() for p in pieces if p.strip())
    # joints: a conjunction or comma left next to another, or at either end
    text = re.sub(r"(?<!\*)\s+,", ",", text)  # "* ," stays: CLIP's BPE reads "*," as another token
    text = re.sub(r"(?:,\s*)+(?=,)", "", text)
    text = re.sub(r",\s*(?:and|or|but|nor)\s*(?=,|$)", "", text, flags=re.IGNORECASE)
    text = re.sub(r"\b(?:and|or|but|nor)\s*(?=[,.;]|$)", "", text, flags=re.IGNORECASE)
    text = re.sub(r"^\s*(?:and|or|but|nor)\b", "", text, flags=re.IGNORECASE)
    text = re.sub(r",\s*(?:and|or|but|nor)\s+", ", ", text, flags=re.IGNORECASE)
    text = re.sub(r"\s{2,}", " ", text).strip()
    # a trailing joint goes ("a photo of * ," -> "a photo of *"); the placeholder stays
    text = re.sub(r"^[\s,;:.]+|[\s,;:.]+$", "", text)
    return text.strip()
