"""The MLLM methods end to end through ``demind-eval`` with the tiny random LLaVA-NeXT on the transformers
engine: a CIRR layout cut from the vendored real annotation files, a kill in the middle resumed, a rerun
that loads no model, re-ranking, and CIRR test1 submissions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from demind.cli.evaluate import main as evaluate_main
from helpers import FIXTURES, write_rerank_queries

N_QUERIES = {"val": 6, "test1": 4}


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """engine.cpu_threads=1 sets torch's threads for the process; give other modules theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small_cirr(tmp_path_factory) -> Path:
    """CIRR's official layout holding the first queries of the real val and test1 files and only the
    images they name (8x8 random PNGs)."""
    root = tmp_path_factory.mktemp("cirr")
    rng = np.random.default_rng(0)
    for split, n in N_QUERIES.items():
        captions = json.loads((FIXTURES / "cirr" / "captions" / f"cap.rc2.{split}.json").read_text())[:n]
        paths = json.loads((FIXTURES / "cirr" / "image_splits" / f"split.rc2.{split}.json").read_text())
        names = {c["reference"] for c in captions} | {m for c in captions for m in c["img_set"]["members"]}
        names |= {c["target_hard"] for c in captions if "target_hard" in c}
        (root / "captions").mkdir(exist_ok=True)
        (root / "image_splits").mkdir(exist_ok=True)
        (root / "captions" / f"cap.rc2.{split}.json").write_text(json.dumps(captions))
        (root / "image_splits" / f"split.rc2.{split}.json").write_text(json.dumps({n: paths[n] for n in names}))
        for name in names:
            path = root / paths[name]
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)
    return root


def argv(root, ckpt, llava, out, *extra):
    return ["--benchmark", "cirr", "--data-root", str(root), "--checkpoint", str(ckpt), "--out", str(out),
            "--num-workers", "0", "--methods", "text-only,cirevl,osrcir", "run.progress=false", "run.device=cpu",
            "engine.name=transformers", f"engine.model={llava}", "engine.dtype=float32", "engine.cpu_threads=1",
            "engine.batch_size=4", "describe.max_tokens=12", "describe.caption_max_tokens=8",
            "describe.rewrite_max_tokens=8", "describe.chunk=2", "describe.image_max_side=32", *extra]


def read_results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def rankings(out: Path) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in (out / "rankings").glob("*.json")}


def test_kill_resume_rerun_without_model_and_rerank(small_cirr, tiny_checkpoint, tiny_llava, tmp_path, monkeypatch):
    from demind.engines.transformers_engine import TransformersEngine

    out = tmp_path / "val"
    real_generate = TransformersEngine.generate
    calls = {"n": 0}

    def dying_generate(self, requests):
        calls["n"] += 1
        if calls["n"] == 4:  # cirevl's first chunk (caption + rewrite) and its second caption call are done
            raise RuntimeError("killed")
        return real_generate(self, requests)

    monkeypatch.setattr(TransformersEngine, "generate", dying_generate)
    with pytest.raises(RuntimeError, match="killed"):
        evaluate_main(argv(small_cirr, tiny_checkpoint, tiny_llava, out))
    kept = sorted((out / "descriptions" / "cirevl").rglob("part-*.json"))
    assert len(kept) == 1 and len(json.loads(kept[0].read_text())["records"]) == 2

    monkeypatch.setattr(TransformersEngine, "generate", real_generate)
    rerank = ("rerank.k=3", "rerank.yes=dog", "rerank.no=cat", "rerank.methods=osrcir,text-only")
    assert evaluate_main(argv(small_cirr, tiny_checkpoint, tiny_llava, out, *rerank)) == 0
    first = read_results(out)
    n = N_QUERIES["val"]
    assert set(first["methods"]) == {"text-only", "cirevl", "osrcir", "osrcir+rerank", "text-only+rerank"}
    mllm = first["mllm"]
    assert mllm["model_loaded"] is True
    assert mllm["describers"]["cirevl"]["records"] == n and mllm["describers"]["cirevl"]["generated_now"] == n - 2
    assert mllm["describers"]["osrcir"]["generated_now"] == n
    # random words carry no "Target description:" label: every OSrCIR answer falls back, counted
    osr = mllm["describers"]["osrcir"]
    assert osr["fallback"] == n and osr["parsed"] == 0
    ranks = rankings(out)
    assert ranks["osrcir"] == ranks["text-only"]
    assert mllm["rerank"]["pairs_stored"] == mllm["rerank"]["scored_now"] > 0
    for base in ("osrcir", "text-only"):
        for qid, names in ranks[base].items():
            new = ranks[f"{base}+rerank"][qid]
            assert sorted(new[:3]) == sorted(names[:3]) and new[3:] == names[3:]
    records = [r for p in (out / "descriptions" / "cirevl").rglob("part-*.json")
               for r in json.loads(p.read_text())["records"].values()]
    assert all(r["raw"] and r["caption_raw"] for r in records)  # raw outputs kept, publishable as they are

    def no_model(*args, **kwargs):
        raise AssertionError("the MLLM was loaded although every answer is stored")

    monkeypatch.setattr(TransformersEngine, "__init__", no_model)
    assert evaluate_main(argv(small_cirr, tiny_checkpoint, tiny_llava, out, *rerank)) == 0
    again = read_results(out)
    assert again["methods"] == first["methods"] and rankings(out) == ranks
    assert again["mllm"]["model_loaded"] is False
    assert again["mllm"]["describers"]["osrcir"]["generated_now"] == 0


def test_test1_writes_submissions_for_both_describers(small_cirr, tiny_checkpoint, tiny_llava, tmp_path):
    out = tmp_path / "test1"
    assert evaluate_main(argv(small_cirr, tiny_checkpoint, tiny_llava, out, "--split", "test1")) == 0
    results = read_results(out)
    pairids = {str(c["pairid"]) for c in json.loads((small_cirr / "captions" / "cap.rc2.test1.json").read_text())}
    for method in ("cirevl", "osrcir"):
        for metric in ("recall", "recall_subset"):
            sub = json.loads((out / "submission" / f"cirr_test1_{method}_{metric}.json").read_text())
            assert sub["version"] == "rc2" and sub["metric"] == metric
            assert set(sub) - {"version", "metric"} == pairids
    assert results["mllm"]["describers"]["cirevl"]["records"] == N_QUERIES["test1"]


def test_reranking_reuses_the_reference_prefix_with_equal_scores(tiny_llava, tmp_path):
    """The reference part prefilled once per query and shared by its candidates (right-padded suffixes of
    different image-token counts) scores as the full prompts do, with fewer prompt tokens run."""
    from demind.mllm import LazyEngine, MemoryStore, MLLMVerifier, RerankOptions, load_describer_prompts
    from demind.engines import EngineConfig, SamplingConfig
    from demind.engines import build_engine

    engine = build_engine(EngineConfig(name="transformers", model=str(tiny_llava), dtype="float32"),
                          SamplingConfig(temperature=0.0), device="cpu")
    _, queries, candidates = write_rerank_queries(tmp_path, [(20, 30), (40, 20), (16, 16), (30, 60), (25, 25),
                                                             (64, 16)])
    runs = {}
    for reuse in (True, False):
        verifier = MLLMVerifier(LazyEngine(lambda: engine), load_describer_prompts(),
                                RerankOptions(k=5, batch_size=3, yes="dog", no="cat", prefix_reuse=reuse), MemoryStore())
        runs[reuse] = (verifier.score(queries, candidates), verifier.prefilled_tokens)
    (with_reuse, tokens_reuse), (full, tokens_full) = runs[True], runs[False]
    assert [len(s) for s in with_reuse] == [5, 3]
    assert torch.allclose(torch.tensor(with_reuse[0]), torch.tensor(full[0]), atol=1e-4)
    assert torch.allclose(torch.tensor(with_reuse[1]), torch.tensor(full[1]), atol=1e-4)
    assert len(set(with_reuse[0])) > 1  # the candidates do get different scores
    assert tokens_reuse < tokens_full
