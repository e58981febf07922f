"""The LLM decomposer end to end with the tiny random LLaVA-NeXT on CPU (its text is random
words, so this checks the path, the parse-failure fallback to the rules, and the cache)."""

from __future__ import annotations

import json

import pytest

from demind.engines import EngineConfig, SamplingConfig
from demind.engines.base import GenResult
from demind.negation.decompose import RuleDecomposer
from demind.negation.llm import DecompositionParseError, LLMDecomposer, load_prompt, parse_answer

QUERIES = ["a kitchen without people", "a red car on a bridge", "a kitchen without people"]


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from demind.engines.transformers_engine import TransformersEngine
    from demind.engines.tiny_llava import build_tiny_llava_next

    path = build_tiny_llava_next(tmp_path_factory.mktemp("tiny_llava"))
    return TransformersEngine(EngineConfig(name="transformers", model=str(path), batch_size=4,
                                           cpu_threads=1), SamplingConfig(temperature=0.1, top_p=1.0), device="cpu")


def test_tiny_model_end_to_end_falls_back_to_rules_and_caches(tiny_engine, tmp_path, monkeypatch):
    cache = tmp_path / "cache.json"
    llm = LLMDecomposer(tiny_engine, cache_path=cache, max_new_tokens=8)
    got = llm.decompose(QUERIES)
    rules = RuleDecomposer().decompose(QUERIES)
    # random words hold no JSON: every answer falls back to the rules
    assert [(d.positive, d.negatives) for d in got] == [(d.positive, d.negatives) for d in rules]
    assert {d.source for d in got} == {"rules-fallback"}
    assert llm.stats["generated"] == 2 and llm.stats["rules-fallback"] == 3  # the repeated query is asked once
    entries = json.loads(cache.read_text())["entries"]
    prompt_id = load_prompt("v1")[1]
    assert set(entries) == {json.dumps([prompt_id, tiny_engine.model_id, q]) for q in QUERIES[:2]}

    # a second decomposer on the same cache never calls the model
    monkeypatch.setattr(tiny_engine, "generate", lambda requests: pytest.fail("cache miss"))
    again = LLMDecomposer(tiny_engine, cache_path=cache)
    assert again.decompose(QUERIES) == got and again.stats["cached"] == 3
    with pytest.raises(DecompositionParseError, match="no JSON object"):
        LLMDecomposer(tiny_engine, cache_path=cache, strict=True).decompose(QUERIES[:1])


class ScriptedEngine:
    """An engine that answers from a dict (to test parsing of well-formed answers)."""

    name = "scripted"
    model_id = "scripted-model"
    renderer = None

    def __init__(self, answers):
        self.answers = answers
        self.calls = 0

    def generate(self, requests):
        self.calls += len(requests)
        return [GenResult(self.answers[next(q for q in self.answers if f"\"{q}\"" in r.prompt)], "stop", 1, 1)
                for r in requests]


def test_well_formed_answers_are_used_and_the_cache_key_holds_the_model(tmp_path, monkeypatch):
    import demind.negation.llm as llm_module

    monkeypatch.setattr(llm_module, "render", lambda renderer, conv: conv[0]["content"][-1]["text"])
    engine = ScriptedEngine({"a kitchen without people": 'Sure: {"positive": "a kitchen", "negatives": ["the people"], '
                                                         '"positives": ["an empty kitchen"]}',
                             "a red car": '{"positive": "a red car", "negatives": []}'})
    d, plain = LLMDecomposer(engine, cache_path=tmp_path / "c.json").decompose(["a kitchen without people", "a red car"])
    assert (d.positive, d.negatives, d.source) == ("a kitchen", ("people",), "llm")
    assert d.positive_texts == ("a kitchen", "an empty kitchen")
    assert plain.positive == "a red car" and not plain.has_negation
    engine.model_id = "another-model"  # another model's answers are not reused
    LLMDecomposer(engine, cache_path=tmp_path / "c.json").decompose(["a red car"])
    assert engine.calls == 3


def test_parse_and_prompt_errors(tmp_path):
    with pytest.raises(DecompositionParseError):
        parse_answer("q", '{"positive": 3, "negatives": []}')
    assert parse_answer("q", 'x {"oops"} {"positive": "q", "negatives": []}').positive == "q"
    with pytest.raises(FileNotFoundError, match="available versions"):
        load_prompt("v999")
    bad = tmp_path / "c.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a demind-negation-cache/1 file"):
        LLMDecomposer(ScriptedEngine({}), cache_path=bad)
