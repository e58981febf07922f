"""The LLM decomposer (DEO section 3.1 as the paper does it): an instruct LLM splits each query
into a positive text and negative phrases.

It runs through the data_gen engines (:mod:`demind.engines`: transformers on CPU/GPU,
vLLM on a GPU), text-only requests rendered by the model's own chat template. The prompt is
versioned (``demind/negation/prompts/<version>/decompose.txt``, ``{query}`` filled in;
never edit a released version: copy it to a new folder). The paper samples at temperature
0.1; the engine's :class:`~demind.engines.SamplingConfig` decides here.

The answer must hold one JSON object ``{"positive": str, "negatives": [str, ...]}`` (an
optional ``"positives": [str, ...]`` adds restatements). An answer that cannot be parsed falls
back to the rule decomposer (``source="rules-fallback"``, counted in ``stats``), or raises
:class:`DecompositionParseError` with ``strict=True``.

Answers are cached in a JSON file keyed by (prompt version + sha, model id, query), written
atomically after each batch, so a rerun or a second method asks the model only for new
queries; a changed prompt or model never reuses another's answers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from demind.errors import InputError, MissingInputError
from demind.engines import Engine, GenRequest, render, request_seed, user_turn
from demind.io import write_json_atomic
from demind.negation.decompose import Decomposer, Decomposition, RuleDecomposer, strip_determiner, unchanged

log = logging.getLogger(__name__)

PROMPT_ROOT = Path(__file__).resolve().parent / "prompts"
QUERY_FIELD = "{query}"
CACHE_FORMAT = "demind-negation-cache/1"


class DecompositionParseError(ValueError):
    """The model's answer holds no valid ``{"positive": ..., "negatives": [...]}`` object."""


def load_prompt(version: str = "v1") -> tuple[str, str]:
    """(prompt text, "version@sha12") of ``prompts/<version>/decompose.txt`` (or a folder path)."""
    folder = Path(version) if Path(version).is_dir() else PROMPT_ROOT / version
    path = folder / "decompose.txt"
    if not path.is_file():
        available = sorted(p.name for p in PROMPT_ROOT.iterdir() if p.is_dir())
        raise MissingInputError(f"decomposition prompt {path} not found; available versions: {available} "
                                "(or a folder holding decompose.txt)")
    text = path.read_text(encoding="utf-8").strip()
    if text.count(QUERY_FIELD) != 1:
        raise InputError(f"{path} must contain {QUERY_FIELD} exactly once")
    return text, f"{folder.name}@{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def parse_answer(query: str, answer: str) -> Decomposition:
    """The model's text -> :class:`Decomposition` (source "llm"); raises DecompositionParseError."""
    for match in re.finditer(r"\{[^{}]*\}", answer):
        try:
            obj = json.loads(match.group())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("positive"), str) and isinstance(obj.get("negatives"), list):
            negatives = tuple(dict.fromkeys(strip_determiner(n.strip()) for n in obj["negatives"]
                                            if isinstance(n, str) and n.strip()))
            if not negatives:
                return unchanged(query, source="llm")
            extra = tuple(p.strip() for p in obj.get("positives", []) if isinstance(p, str) and p.strip())
            return Decomposition(query=query, positive=obj["positive"].strip(), negatives=negatives, source="llm",
                                 positives=extra)
    raise DecompositionParseError(f"no JSON object with 'positive' (string) and 'negatives' (list) in the "
                                  f"model's answer for {query!r}: {answer[:200]!r}")


class LLMDecomposer:
    """:class:`~demind.negation.decompose.Decomposer` through a data_gen engine, with a cache and a fallback."""

    name = "llm"

    def __init__(self, engine: Engine, prompt_version: str = "v1", cache_path: str | Path | None = None,
                 max_new_tokens: int = 96, seed: int = 0, strict: bool = False,
                 fallback: Decomposer | None = None) -> None:
        self.engine = engine
        self.prompt, self.prompt_id = load_prompt(prompt_version)
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.strict = strict
        self.fallback = fallback or RuleDecomposer()
        self.stats: Counter[str] = Counter()  # "llm", "rules-fallback", "cached", "generated"
        self._cache = self._read_cache()

    def _key(self, query: str) -> str:
        return json.dumps([self.prompt_id, self.engine.model_id, query], ensure_ascii=False)

    def _read_cache(self) -> dict[str, dict[str, Any]]:
        if self.cache_path is None or not self.cache_path.is_file():
            return {}
        try:
            data = json.loads(self.cache_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise InputError(f"{self.cache_path}: decomposition cache is not JSON ({e}); delete it to rebuild") from None
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            raise InputError(f"{self.cache_path}: not a {CACHE_FORMAT} file; delete it or pass another cache_path")
        return data["entries"]

    def _write_cache(self) -> None:
        if self.cache_path is not None:
            write_json_atomic(self.cache_path, {"format": CACHE_FORMAT, "entries": self._cache}, indent=1)

    def decompose(self, queries: list[str]) -> list[Decomposition]:
        """One decomposition per query; the model is asked only about queries not in the cache."""
        missing = list(dict.fromkeys(q for q in queries if self._key(q) not in self._cache))
        self.stats["cached"] += len(queries) - sum(1 for q in queries if q in missing)
        if missing:
            requests = [GenRequest(prompt=render(self.engine.renderer,
                                                 [user_turn(self.prompt.replace(QUERY_FIELD, q), with_image=False)]),
                                   image=None, seed=request_seed(self.seed, q, "negation", 0),
                                   max_new_tokens=self.max_new_tokens) for q in missing]
            for query, result in zip(missing, self.engine.generate(requests)):
                self._cache[self._key(query)] = {"answer": result.text, "finish_reason": result.finish_reason}
            self.stats["generated"] += len(missing)
            self._write_cache()
        before = self.stats["rules-fallback"]
        out = [self._from_answer(q, self._cache[self._key(q)]["answer"]) for q in queries]
        if self.stats["rules-fallback"] > before:
            log.warning("LLM decomposer: %d of %d answers could not be parsed; the rule decomposer answered them",
                        self.stats["rules-fallback"] - before, len(queries))
        return out

    def _from_answer(self, query: str, answer: str) -> Decomposition:
        try:
            d = parse_answer(query, answer)
        except DecompositionParseError:
            if self.strict:
                raise
            self.stats["rules-fallback"] += 1
            return replace(self.fallback.decompose([query])[0], source="rules-fallback")
        self.stats["llm"] += 1
        return d
