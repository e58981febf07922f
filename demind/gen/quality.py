"""Cleaning of model outputs and the quality checks that trigger a retry or a flag."""

from __future__ import annotations

import re
from collections import Counter

# Labels models put before the answer ("Rewritten caption: ...", "**Instruction:** ...").
_LEADING_LABEL = re.compile(
    r"^\s*(?:\*\*|__)?\s*(?:(?:the\s+)?(?:rewritten|new|revised|detailed)\s+(?:caption|description)|caption|description"
    r"|(?:pseudo[- ])?manipulation(?:\s+description)?|edit(?:ing)?\s+instruction|instruction|answer|output|response)"
    r"\s*(?:\*\*|__)?\s*[:\-–]\s*(?:\*\*|__)?\s*",
    re.IGNORECASE,
)
# "Sure! Here is the rewritten caption:" and similar preambles, up to the colon.
_PREAMBLE = re.compile(r"^\s*(?:sure|certainly|of course|okay|ok)\b[^:\n]{0,80}:\s*", re.IGNORECASE)
_IMAGE_OPENER = re.compile(
    r"^\s*(?:(?:the|this)\s+(?:image|picture|photo|photograph)\s+(?:shows|depicts|features|captures|displays|presents)"
    r"|in\s+(?:the|this)\s+(?:image|picture|photo)\s*,)\s*",
    re.IGNORECASE,
)
_QUOTES = "\"'“”‘’`"
_REFUSAL = re.compile(
    r"^\s*(?:i'm sorry|i am sorry|sorry,|i apologi[sz]e|i cannot|i can't|i can ?not|i'm unable|i am unable|"
    r"i'm not able|i am not able|as an ai)|as an ai (?:language )?model",
    re.IGNORECASE,
)
_WORD = re.compile(r"\w+", re.UNICODE)


def clean_output(text: str) -> str:
    """Strip labels, preambles, quotes and "The image shows"; one line, single spaces."""
    text = " ".join(text.split())
    for _ in range(3):  # labels can be stacked: 'Sure! Here it is: Caption: "..."'
        before = text
        text = _PREAMBLE.sub("", text, count=1)
        text = _LEADING_LABEL.sub("", text, count=1)
        text = text.strip().strip(_QUOTES).strip()
        if text == before:
            break
    opener = _IMAGE_OPENER.match(text)
    if opener and opener.end() < len(text):
        text = text[opener.end():]
        text = text[0].upper() + text[1:]
    return text.strip()


def max_ngram_count(text: str, n: int) -> int:
    """Highest number of occurrences of any word n-gram (case-insensitive); 0 if too short."""
    words = [w.lower() for w in _WORD.findall(text)]
    if len(words) < n:
        return 0
    counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return max(counts.values())


def quality_flags(text: str, finish_reason: str, repeat_ngram: int = 3, max_ngram_repeats: int = 2) -> list[str]:
    """Problems with a cleaned output: 'empty', 'refusal', 'repetition', 'truncated' (hit the token limit)."""
    flags = []
    if not _WORD.search(text):
        flags.append("empty")
    elif _REFUSAL.search(text):
        flags.append("refusal")
    if max_ngram_count(text, repeat_ngram) > max_ngram_repeats:
        flags.append("repetition")
    if finish_reason == "length":
        flags.append("truncated")
    return flags
