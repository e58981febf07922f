"""MLLM reasoning at query time (demind/mllm, demind/retrieval/mllm_methods): scripted engines behind
the Engine interface on the toy CIRR, chain-of-thought parsing, the stores' resume, re-ranking."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from demind.mllm import (AnswerStore, DescribeOptions, LazyEngine, MLLMSetup, OSrCIRDescriber, RerankOptions,
                         Reranker, load_describer_prompts, parse_description, rerank_ranking)
from demind.eval.harness import evaluate, read_benchmark
from demind.engines import request_seed
from demind.retrieval import ensemble_embeddings
from toyworld.benchmarks import ToyBenchmarkConfig
from toyworld import synthetic
from helpers import TINY_CLIP
from toyworld.cirr import write_cirr


# ----------------------------------------------------------------------------- chain-of-thought parsing

LLAVA_MISTRAL = """1. **Reference:** The image shows a brown dog lying on a wooden floor next to a red ball.

2. **Intent:** The user wants the dog replaced by a cat and the ball kept.

3. **Reflection:** The request does not mention the floor, so it stays; the ball is red.

4. **Target description:** A cat lying on a wooden floor next to a red ball."""
LLAVA_VICUNA = """Reference: two people ride bicycles on a city street at night.
Intent: make it daytime and remove one person.
Reflection: only one cyclist should remain; the street stays.
Target description:
"A single cyclist riding a bicycle on a city street in daylight."
"""
MARKDOWN_HEADING = """### Reference
A bowl of oranges on a table.
### Target Image Description
A bowl of green apples on a table.
Note: the table is unchanged."""
JSON_ANSWER = 'Reasoning done. {"target_description": "three bottles of soda on a shelf"}'
CUT_BEFORE = """Reference: a white bus parked beside a road with trees.
Intent: the user wants the bus to be yellow and the trees to be"""
CUT_INSIDE = """Reference: a red car.
Intent: make it blue.
Reflection: fine.
Target description: A blue car parked on a narrow street with"""
ECHO = "Target description: <one sentence>"


@pytest.mark.parametrize("answer, truncated, expected, status", [
    (LLAVA_MISTRAL, False, "A cat lying on a wooden floor next to a red ball.", "ok"),
    (LLAVA_VICUNA, False, "A single cyclist riding a bicycle on a city street in daylight.", "ok"),
    (MARKDOWN_HEADING, False, "A bowl of green apples on a table.", "ok"),
    (JSON_ANSWER, False, "three bottles of soda on a shelf", "ok"),
    (CUT_BEFORE, True, None, "cut-before-label"),
    (CUT_INSIDE, True, "A blue car parked on a narrow street with", "truncated"),
    (ECHO, False, None, "placeholder"),
    ("I'm sorry, I cannot see the image.", False, None, "no-label"),
    ("Target description: dog", False, None, "empty"),  # one bare word is not a description
])
def test_osrcir_answers_parse_to_the_last_target_label(answer, truncated, expected, status):
    parsed = parse_description(answer, truncated=truncated)
    assert (parsed.description, parsed.status) == (expected, status)


def test_bare_answers_are_accepted_where_no_label_is_required():
    assert parse_description("A dog on a beach at sunset.\n\nIt looks happy.", require_label=False).description \
        == "A dog on a beach at sunset."
    assert parse_description("Edited description: **a cat on a beach**", require_label=False).description \
        == "a cat on a beach"
    # the text itself (inner spacing included) survives: a parsed modification text stays byte-equal
    assert parse_description("Target description: show  three bottles").description == "show  three bottles"


# ----------------------------------------------------------------------------- scripted engines

class ScriptedEngine(synthetic.ScriptedEngine):
    """The answer to a request is looked up by its seed (a function of the query id, the stage and the
    sample), else ``default``; the calls after ``die_after`` raise (a kill)."""

    def __init__(self, by_seed: dict[int, str], default: str = "a photo", die_after: int | None = None):
        super().__init__(lambda request: self.by_seed.get(request.seed, self.default))
        self.by_seed, self.default, self.die_after = by_seed, default, die_after

    def generate(self, requests):
        if self.die_after is not None and self.calls >= self.die_after:
            self.calls += 1
            raise KeyboardInterrupt("killed")
        return super().generate(requests)


def answers(queries, stage: str, text_of, samples: int = 1) -> dict[int, str]:
    """Seed -> scripted answer for every query and sample of ``stage`` (describe.seed = 0)."""
    return {request_seed(0, q.qid, stage, s): text_of(q, s) for q in queries for s in range(samples)}


def setup_with(engine, **describe) -> MLLMSetup:
    return MLLMSetup(lambda: engine, model="scripted-model", engine_name="scripted",
                     describe=DescribeOptions(**describe))


@pytest.fixture(scope="module")
def toy_cirr(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("toycirr") / "cirr"
    write_cirr(root, ToyBenchmarkConfig(cirr_sets=8), progress=False)
    return root


@pytest.fixture(scope="module")
def toy_queries(toy_cirr):
    return read_benchmark("cirr", toy_cirr).groups[0].queries


def run_eval(root, backbone, methods, mllm, out=None, model=None):
    return evaluate("cirr", root, backbone=backbone, model=model, methods=methods, mllm=mllm, progress=False,
                    out_dir=out)


def test_true_target_descriptions_give_the_oracle(toy_cirr, toy_queries, tiny_backbone, tmp_path):
    """osrcir (reasoning, then the label) and cirevl (caption, then rewrite) fed each query's true target
    description rank exactly as the oracle: the wiring from answers to rankings loses nothing."""
    by_seed = answers(toy_queries, "osrcir", lambda q, s: f"Reference: ...\nIntent: ...\n"
                                                          f"Target description: {q.target_description}")
    by_seed |= answers(toy_queries, "rewrite", lambda q, s: q.target_description)
    engine = ScriptedEngine(by_seed, default="a caption of the reference image")
    results = run_eval(toy_cirr, tiny_backbone, "oracle,osrcir,cirevl", setup_with(engine), out=tmp_path / "out")
    m = results["methods"]
    assert m["osrcir"] == m["oracle"] and m["cirevl"] == m["oracle"]
    assert m["oracle"]["R@10"] > 0
    ranks = {k: json.loads(Path(p).read_text()) for k, p in results["files"]["rankings"].items()}
    assert ranks["osrcir"] == ranks["oracle"] == ranks["cirevl"]
    d = results["mllm"]["describers"]
    assert d["osrcir"]["parsed"] == len(toy_queries) and d["osrcir"]["fallback"] == 0
    assert d["cirevl"]["parsed"] == len(toy_queries)
    # one caption per distinct reference, then one text-only rewrite per query
    refs = len({q.reference.name for q in toy_queries})
    assert engine.requests == len(toy_queries) + refs + len(toy_queries)
    assert results["mllm"]["model_loaded"] is True


def test_modification_text_alone_equals_text_only(toy_cirr, toy_queries, tiny_backbone):
    engine = ScriptedEngine(answers(toy_queries, "osrcir", lambda q, s: f"Target description: {q.text}"))
    m = run_eval(toy_cirr, tiny_backbone, "text-only,osrcir", setup_with(engine))["methods"]
    assert m["osrcir"] == m["text-only"]


def test_unparseable_answers_are_counted_logged_and_fall_back(toy_cirr, toy_queries, tiny_backbone, caplog):
    bad = {q.qid for q in toy_queries[::3]}
    engine = ScriptedEngine(answers(toy_queries, "osrcir", lambda q, s: "I'm not sure what the image shows."
                                    if q.qid in bad else f"Target description: {q.text}"))
    with caplog.at_level(logging.WARNING, logger="demind.mllm"):
        results = run_eval(toy_cirr, tiny_backbone, "text-only,osrcir", setup_with(engine))
    summary = results["mllm"]["describers"]["osrcir"]
    assert summary["fallback"] == len(bad) and summary["fallback_reasons"] == {"no-label": len(bad)}
    assert summary["parsed"] == len(toy_queries) - len(bad)
    messages = [r.getMessage() for r in caplog.records]
    assert sum(f"{len(bad)} of {len(toy_queries)} answers have no parsable target description" in m
               for m in messages) == 1
    assert sum("no target description for query" in m for m in messages) == 3  # a few examples, not thousands
    assert results["methods"]["osrcir"] == results["methods"]["text-only"]  # the fallback is the modification text


def test_stored_descriptions_resume_after_a_kill_and_a_rerun_loads_no_model(toy_queries, tmp_path):
    by_seed = answers(toy_queries, "osrcir", lambda q, s: f"Target description: {q.target_description}")
    prompts = load_describer_prompts()
    options = DescribeOptions(chunk=3)
    store = lambda settings={"k": 1}: AnswerStore(tmp_path / "store", "osrcir", settings=settings)  # noqa: E731
    dying = ScriptedEngine(by_seed, die_after=2)
    with pytest.raises(KeyboardInterrupt):
        OSrCIRDescriber(LazyEngine(lambda: dying), prompts, options, store()).describe(toy_queries)
    assert len(list((tmp_path / "store" / "osrcir").glob("part-*.json"))) == 2 and len(store()) == 6
    resumed = ScriptedEngine(by_seed)
    first = OSrCIRDescriber(LazyEngine(lambda: resumed), prompts, options, store()).describe(toy_queries)
    assert resumed.requests == len(toy_queries) - 6  # only what no part held

    def no_model():
        raise AssertionError("the model was loaded although every answer is stored")

    rerun = OSrCIRDescriber(LazyEngine(no_model), prompts, options, store())
    assert rerun.describe(toy_queries) == first == [[q.target_description] for q in toy_queries]
    record = rerun.store.records[rerun.keys(toy_queries[:1])[toy_queries[0].qid, 0]]
    assert record["raw"].startswith("Target description:") and record["status"] == "ok"
    assert record["qid"] == toy_queries[0].qid  # a label kept for reading
    # other settings: other keys, so nothing stored answers them (and nothing is refused)
    other = ScriptedEngine(by_seed)
    OSrCIRDescriber(LazyEngine(lambda: other), prompts, options, store({"k": 2})).describe(toy_queries)
    assert other.requests == len({(q.reference.name, q.text) for q in toy_queries})


def test_ensemble_weights_the_consensus():
    a = torch.nn.functional.normalize(torch.tensor([1.0, 0.1, 0.0]), dim=0)
    outlier = torch.tensor([0.0, 0.0, 1.0])
    q = ensemble_embeddings(torch.stack([a, a, outlier]), tau=0.05)
    assert torch.allclose(q.norm(), torch.tensor(1.0)) and (q @ a) > 0.99  # the odd one out weighs ~e^-20
    assert torch.equal(ensemble_embeddings(a[None], tau=0.05), a)
    # uniform when all agree equally
    e = torch.eye(3)
    assert torch.allclose(ensemble_embeddings(e, tau=0.05), torch.ones(3) / 3 ** 0.5)


def test_ensemble_of_sampled_descriptions(toy_cirr, toy_queries, tiny_backbone):
    """samples=3: two samples say the target, one says nothing useful; the ensemble stays near the oracle."""
    engine = ScriptedEngine(answers(toy_queries, "osrcir", lambda q, s: "Target description: "
                                    + (q.target_description if s < 2 else "a photo of something"), samples=3))
    results = run_eval(toy_cirr, tiny_backbone, "oracle,osrcir", setup_with(engine, samples=3, temperature=0.7))
    assert engine.requests == 3 * len(toy_queries)
    m = results["methods"]
    assert m["osrcir"]["R@5"] >= m["oracle"]["R@5"] - 100 / len(toy_queries) - 1e-9


@pytest.fixture(scope="module")
def tiny_model(tiny_backbone):
    from demind.model import DeMinds
    from demind.schema import ModelConfig

    torch.manual_seed(0)
    return DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16, gate_init=0.5),
                   tiny_backbone).eval()


def test_hybrid_mixes_demind_and_the_description(toy_cirr, toy_queries, tiny_backbone, tiny_model):
    engine = ScriptedEngine(answers(toy_queries, "osrcir", lambda q, s: f"Target description: {q.target_description}"))
    runs = {w: run_eval(toy_cirr, tiny_backbone, "demind,oracle,demind+mllm,demind+mllm+deo",
                        setup_with(engine, hybrid_weight=w), model=tiny_model)["methods"] for w in (0.0, 1.0)}
    assert runs[0.0]["demind+mllm"] == runs[0.0]["demind"]
    assert runs[1.0]["demind+mllm"] == runs[1.0]["oracle"]
    assert set(runs[0.0]) == {"demind", "oracle", "demind+mllm", "demind+mllm+deo"}


def test_mllm_methods_without_an_engine_are_one_clear_error(toy_cirr, tiny_backbone):
    from demind.config import ConfigError

    with pytest.raises(ConfigError, match="engine.model"):
        run_eval(toy_cirr, tiny_backbone, "osrcir", None)


# ----------------------------------------------------------------------------- re-ranking

def test_rerank_ranking_reorders_only_the_top_k():
    ranking = list("abcdefgh")
    assert rerank_ranking(ranking, [0.0, 0.0, 5.0]) == list("cabdefgh")  # ties keep the base order
    assert rerank_ranking(ranking, [1.0, 2.0, 3.0, 4.0]) == list("dcbaefgh")
    assert rerank_ranking(ranking, []) == ranking


class KnowsTheTarget:
    def __init__(self):
        self.pairs = 0

    def score(self, queries, candidates):
        self.pairs += sum(len(c) for c in candidates)
        return [[1.0 if c.name in q.targets else 0.0 for c in cands] for q, cands in zip(queries, candidates)]


class FakeRun:
    """What evaluate() needs of a bound MLLM setup to re-rank."""

    def __init__(self, verifier, k, methods=None):
        self.verifier, self.k, self.methods = verifier, k, methods

    def bind(self, benchmark, split, root):
        return self

    def reranker(self):
        return Reranker(self.verifier, self.k)

    def rerank_targets(self, names):
        return self.methods or names

    def summary(self):
        return {"rerank": {"k": self.k}}


def test_a_verifier_that_knows_the_target_puts_it_first(toy_cirr, toy_queries, tiny_backbone, tmp_path):
    k = 10
    verifier = KnowsTheTarget()
    results = run_eval(toy_cirr, tiny_backbone, "text-only,image-only", FakeRun(verifier, k), out=tmp_path)
    assert verifier.pairs == 2 * len(toy_queries) * k
    ranks = {m: json.loads(Path(p).read_text()) for m, p in results["files"]["rankings"].items()}
    m = results["methods"]
    for base in ("text-only", "image-only"):
        new, old = ranks[f"{base}+rerank"], ranks[base]
        for q in toy_queries:
            assert sorted(new[q.qid][:k]) == sorted(old[q.qid][:k]) and new[q.qid][k:] == old[q.qid][k:]
            target = q.targets[0]
            if target in old[q.qid][:k]:
                assert new[q.qid][0] == target
            else:
                assert new[q.qid] == old[q.qid]
        assert m[f"{base}+rerank"]["R@1"] == pytest.approx(m[base]["R@10"])  # every hit in the top 10 moves to 1
        assert m[f"{base}+rerank"]["R@10"] == m[base]["R@10"]
        assert m[f"{base}+rerank"]["R@50"] == m[base]["R@50"]
    table = Path(results["files"]["table"]).read_text()
    assert "Text-only + MLLM re-rank" in table


def test_rerank_options_and_store_key():
    from demind.config import ConfigError, validate

    with pytest.raises(ConfigError):
        validate(RerankOptions(k=51))
    with pytest.raises(ConfigError, match="temperature"):
        validate(DescribeOptions(samples=2))


def test_modification_text_drops_a_template_head():
    from demind.mllm import modification_text
    from demind.eval.fashioniq import fashioniq_texts
    from demind.retrieval import ImageRef, Query

    prompt, text = fashioniq_texts(["is red", "has long sleeves"], "released", "released")
    assert text.startswith("a photo of * ,")
    q = Query("dress:1", ImageRef("a", Path("a.png")), prompt, text)
    assert modification_text(q) == "has long sleeves and is red"
    plain = Query("1", ImageRef("a", Path("a.png")), "a photo of * , add a dog", "add a dog")
    assert modification_text(plain) == "add a dog"


def test_a_missing_prompt_version_is_one_error_line(toy_cirr, tmp_path, capsys):
    from demind.cli.evaluate import main

    argv = ["--benchmark", "cirr", "--data-root", str(toy_cirr), "--backbone", f"{TINY_CLIP}:none", "--out",
            str(tmp_path / "out"), "--num-workers", "0", "--methods", "osrcir", "run.progress=false",
            "engine.name=transformers", "engine.model=nowhere", "describe.prompts=v9"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "describer prompt version 'v9' not found" in err[0]


def test_rerank_settings_that_cannot_work_are_refused_before_any_model_or_method_runs(toy_cirr, tiny_backbone,
                                                                                      tmp_path):
    from demind.cli.model_options import build_mllm_setup
    from demind.config import ConfigError
    from demind.settings import ModelRunConfig
    from demind.engines import EngineConfig

    # re-ranking on vLLM is built (its log-probabilities): the setup is accepted, nothing loads yet
    assert build_mllm_setup(EngineConfig(name="vllm", model="m"), DescribeOptions(), RerankOptions(k=5),
                            ModelRunConfig()).engine.loaded is False
    engine = ScriptedEngine({})
    setup = MLLMSetup(lambda: engine, model="scripted-model", engine_name="scripted",
                      rerank=RerankOptions(k=5, methods="osrcir,image-only"))
    with pytest.raises(ConfigError, match=r"rerank.methods names \['image-only'\]"):
        run_eval(toy_cirr, tiny_backbone, "text-only,osrcir", setup, out=tmp_path)
    assert engine.calls == 0  # refused before the describer ran
