"""Reading the target description out of an MLLM's answer (chain of thought or a bare sentence).

Open MLLMs answer the four-step OSrCIR prompt in many shapes: labelled paragraphs, numbered
steps, markdown bold (``**Target description:**``), the label on its own line with the text on
the next, quotes around the sentence, a JSON object, or an answer cut off by ``max_new_tokens``
before (or inside) the last step. :func:`parse_description` takes the text after the *last*
target label; with ``require_label=False`` (CIReVL's rewrite, a caption) a bare answer is its
first paragraph. A cut answer whose description already has words is kept (``truncated``);
one cut before the label is unparseable, and the caller falls back to the modification text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# Labels that introduce the final description, most specific first (matched case-insensitively).
TARGET_LABELS = (
    r"target\s+image\s+description", r"target\s+description", r"description\s+of\s+the\s+target\s+image",
    r"edited\s+(?:image\s+)?description", r"final\s+(?:target\s+)?description", r"final\s+answer",
)
# A label line: optional list marker ("4.", "-", "Step 4:"), optional markdown, the label, a colon.
_LABEL = re.compile(
    r"^[ \t>#*_-]*(?:step\s*\d+\s*[:.)-]?\s*|\d+\s*[.)]\s*)?[*_ \t]*(?:" + "|".join(TARGET_LABELS) + r")[*_ \t]*(?:[:：][*_ \t]*|$)",
    re.IGNORECASE | re.MULTILINE)
_JSON = re.compile(r"\{[^{}]*\}")
_JSON_KEYS = ("target_description", "target", "description")
_QUOTES = "\"'“”‘’`"
MIN_WORDS = 2  # "A dog." is a description; one bare word is not
# Template echoes a model may copy instead of answering ("<one sentence>", "[description]").
_PLACEHOLDER = re.compile(r"^[<\[(].*[>\])]$")


@dataclass(frozen=True)
class Parsed:
    """``description``: the target description (one line), or None when the answer has none;
    ``status``: "ok", "truncated" (the answer was cut but the description has words), or the
    reason it failed ("no-label", "empty", "cut-before-label", "placeholder")."""

    description: str | None
    status: str

    @property
    def ok(self) -> bool:
        return self.description is not None


def clean_description(text: str) -> str:
    """One line: markdown emphasis, surrounding quotes and a trailing label echo removed,
    inner whitespace of the text itself kept (so a parsed modification text stays byte-equal)."""
    text = text.strip()
    text = re.sub(r"^[*_]+|[*_]+$", "", text).strip()
    if len(text) >= 2 and text[0] in _QUOTES and text[-1] in _QUOTES:
        text = text[1:-1].strip()
    elif text[:1] in _QUOTES and text.count(text[0]) == 1:  # an opening quote the answer never closed (cut)
        text = text[1:].strip()
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _after_label(answer: str) -> str | None:
    """The text after the last target label: the rest of its line, else its next paragraph."""
    matches = list(_LABEL.finditer(answer))
    if not matches:
        return None
    rest = answer[matches[-1].end():]
    paragraphs = [p for p in re.split(r"\n\s*\n", rest.strip()) if p.strip()]
    if not paragraphs:
        return ""
    kept = []
    for line in paragraphs[0].splitlines():
        # "Target description: X\nNote: ..." ends at the next labelled line
        if kept and re.match(r"^[ \t*_-]*\w[\w ]{0,30}[*_]*\s*:", line):
            break
        kept.append(line)
    return "\n".join(kept)


def _from_json(answer: str) -> str | None:
    for match in _JSON.finditer(answer):
        try:
            obj = json.loads(match.group())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            for key in _JSON_KEYS:
                if isinstance(obj.get(key), str) and obj[key].strip():
                    return obj[key]
    return None


def parse_description(answer: str, *, truncated: bool = False, require_label: bool = True) -> Parsed:
    """The target description in ``answer`` (see the module docstring).

    ``truncated``: the engine stopped at ``max_new_tokens`` (finish_reason "length").
    ``require_label``: OSrCIR's answer must name the target; a caption or rewrite may be bare.
    """
    raw = _after_label(answer)
    if raw is None:
        raw = _from_json(answer)
    if raw is None:
        if require_label:
            return Parsed(None, "cut-before-label" if truncated else "no-label")
        paragraphs = [p for p in re.split(r"\n\s*\n", answer.strip()) if p.strip()]
        raw = paragraphs[0] if paragraphs else ""
    text = clean_description(raw)
    if not text:
        return Parsed(None, "cut-before-label" if truncated else "empty")
    if _PLACEHOLDER.match(text):
        return Parsed(None, "placeholder")
    if len(text.split()) < MIN_WORDS:
        return Parsed(None, "cut-before-label" if truncated else "empty")
    return Parsed(text, "truncated" if truncated else "ok")
