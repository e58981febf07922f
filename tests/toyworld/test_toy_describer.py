"""The toy MLLM (toyworld/describer.py) behind the describers: it reads the toy CIRR's scenes, its
failure rates are what it draws, and its answers run through the real describer path."""

from __future__ import annotations

import random

import pytest

from demind.mllm import MLLMSetup
from demind.engines import GenRequest, request_seed
from demind.eval.harness import evaluate, read_benchmark
from toyworld.benchmarks import ToyBenchmarkConfig
from toyworld.cirr import cirr_set, write_cirr
from toyworld.describer import ToyDescriberNoise, ToySceneEngine
from toyworld.texts import full_description
from demind.seeding import derive_seed

CFG = ToyBenchmarkConfig(cirr_sets=10)


@pytest.fixture(scope="module")
def toy_cirr(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy") / "cirr"
    write_cirr(root, CFG, progress=False)
    return root, read_benchmark("cirr", root).groups[0].queries


def run(root, queries, backbone, methods, noise, samples=1):
    engine = ToySceneEngine(queries, CFG.cirr_version, CFG.cirr_implicit_share, noise, samples=samples)
    setup = MLLMSetup(lambda: engine, model=engine.model_id, engine_name=engine.name)
    return evaluate("cirr", root, backbone=backbone, methods=methods, mllm=setup, progress=False), engine


def test_a_perfect_toy_describer_describes_the_target_scene(toy_cirr, tiny_backbone):
    root, queries = toy_cirr
    results, engine = run(root, queries, tiny_backbone, "osrcir,cirevl", ToyDescriberNoise())
    assert engine.outcomes == {"target": len(queries), "ignore": 0, "drop": 0, "garble": 0}
    assert results["mllm"]["describers"]["osrcir"]["fallback"] == 0
    # the description is the target scene's (rebuilt here from the set), in the toy MLLM's own phrasing
    q = queries[0]
    set_id, member = (int(x) for x in q.targets[0].split("-")[1:3])
    target = cirr_set(CFG.cirr_version, set_id, CFG.cirr_implicit_share)[0].members[member]
    ours = full_description(target, random.Random(derive_seed("toy-describer", "phrasing", q.qid, 0)))
    [answer] = engine.generate([GenRequest(prompt="", image=None, seed=request_seed(0, q.qid, "osrcir", 0),
                                           max_new_tokens=8)])
    assert answer.text.endswith("Target description: " + ours)
    with pytest.raises(KeyError, match="no answer"):
        engine.generate([GenRequest(prompt="", image=None, seed=request_seed(1, q.qid, "osrcir", 0), max_new_tokens=8)])


def test_garbled_answers_fall_back_to_text_only_and_rates_are_drawn(toy_cirr, tiny_backbone):
    root, queries = toy_cirr
    results, engine = run(root, queries, tiny_backbone, "text-only,osrcir", ToyDescriberNoise(p_garble=1.0))
    assert results["methods"]["osrcir"] == results["methods"]["text-only"]
    assert results["mllm"]["describers"]["osrcir"]["fallback"] == len(queries)
    mixed = ToySceneEngine(queries, CFG.cirr_version, CFG.cirr_implicit_share,
                           ToyDescriberNoise(p_ignore=0.3, p_drop=0.3, p_garble=0.2), samples=20)
    n = 20 * len(queries)
    assert sum(mixed.outcomes.values()) == n
    for kind, p in (("ignore", 0.3), ("garble", 0.2)):
        assert abs(mixed.outcomes[kind] / n - p) < 3.5 * (p * (1 - p) / n) ** 0.5  # 400 draws: within 3.5 sigma


def test_rates_are_checked():
    with pytest.raises(ValueError):
        ToyDescriberNoise(p_ignore=0.7, p_drop=0.5)
