"""The ``vllm`` engine for real: vLLM's CPU build (``vllm-cpu``) runs the tiny random LLaVA-NeXT through the
generation job, the describers of ``demind-eval`` and ``demind-search``, and re-ranking; and the two engines
see the same tokens for the same request.

These tests run in the venv ``bash scripts/setup.sh --vllm`` makes (``.ci/run`` runs them there)::

    .venv-vllm/bin/python -m pytest -m "vllm and not slow" tests/test_vllm.py   # as CI; -m vllm adds Ray

Elsewhere (the project's .venv, a machine vLLM's CPU build does not run on) the module skips with one line
saying why. A vLLM engine takes about 50 s to start on a CPU, so the in-process tests share one
(:func:`shared_engines`); the documented command runs once as a process of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from demind.engines.vllm_cpu_support import cpu_build_unsupported_reason


def skip_reason() -> str | None:
    """Why the vLLM tests cannot run here (one line), or None."""
    if importlib.util.find_spec("vllm") is None:
        why = cpu_build_unsupported_reason()
        if why:
            return f"vLLM tests skipped: {why}"
        return ("vLLM tests skipped: vLLM is not installed in this environment; `bash scripts/setup.sh --vllm` makes "
                ".venv-vllm, then: .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm.py")
    return None


if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

pytestmark = pytest.mark.vllm

import torch  # noqa: E402

from demind.engines import EngineConfig, SamplingConfig  # noqa: E402
from demind.gen.config import GenConfig  # noqa: E402
from demind.engines.base import GenRequest  # noqa: E402
from demind.engines.tiny_llava import build_tiny_llava_next  # noqa: E402
from helpers import shard_writer_killed_at, write_img2dataset_shards, write_rerank_queries  # noqa: E402
from test_data_gen import CORRUPT_KEY, read_output, texts_by_key  # noqa: E402
from test_mllm_llava import N_QUERIES, rankings, read_results, small_cirr  # noqa: E402,F401  (module fixture)

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CPU = REPO_ROOT / "configs" / "data_gen" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The folder ``data_gen/make_tiny_model.py`` writes (the one both engines load)."""
    from demind.cli.make_tiny_model import main

    folder = tmp_path_factory.mktemp("tiny") / "tiny-llava-next"
    assert main(["--output", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def shared_engines():
    """``build_engine`` that builds one vLLM engine per distinct set of engine settings and hands it out
    again (the callers' own sampling settings put on it): the job, demind-eval and demind-search build
    theirs through it. The engines are shut down with the module."""
    import demind.engines as engines

    real = engines.build_engine
    built: dict[tuple, object] = {}

    def shared(engine_cfg, sampling_cfg, *, device="auto", seed=0):
        if engine_cfg.name != "vllm":
            return real(engine_cfg, sampling_cfg, device=device, seed=seed)
        key = (engine_cfg.model, engine_cfg.dtype, engine_cfg.max_model_len, engine_cfg.prefix_cache,
               engine_cfg.kv_cache_gib, engine_cfg.enforce_eager, engine_cfg.tensor_parallel_size)
        if key not in built:
            built[key] = real(engine_cfg, sampling_cfg, device=device, seed=seed)
        built[key].sampling = sampling_cfg
        return built[key]

    engines.build_engine = shared
    yield built
    engines.build_engine = real
    for engine in built.values():  # its engine-core process, now rather than at interpreter exit
        engine.llm.llm_engine.engine_core.shutdown()
    built.clear()


def vllm_engine(shared_engines, tiny, sampling: SamplingConfig | None = None):
    """The shared vLLM engine of the generation job's settings (tiny-cpu.yaml: float32, prefix cache)."""
    import demind.engines as engines

    return engines.build_engine(EngineConfig(name="vllm", model=str(tiny), dtype="float32"),
                                sampling or SamplingConfig())


@pytest.fixture
def input_shards(tmp_path) -> Path:
    """Two img2dataset-style shards of 4 samples each (jpg, txt, json), one image corrupt."""
    root = tmp_path / "in"
    write_img2dataset_shards(root)
    return root


def documented_command(inp: Path, out: Path, tiny: Path) -> list[str]:
    """docs/generation.md's command for vLLM's CPU build, word for word but for the paths."""
    return ["data_gen/run.py", "--input", str(inp), "--output", str(out), "--shard", "0-1", "--config",
            "configs/data_gen/tiny-cpu.yaml", "engine.name=vllm", f"engine.model={tiny}"]


# ----------------------------------------------------------------------------- the generation job


def test_the_documented_command_writes_intent_shards_with_prefix_hits_and_a_rerun_skips(tiny, input_shards, tmp_path):
    """The command as documented, in a process of its own (no setting changed but the engine and model)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, *documented_command(input_shards, out, tiny)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "finished 2 shard(s)" in done.stdout
    for shard in range(2):
        samples = read_output(out / f"0000{shard}.tar")
        keys = sorted(s["__key__"] for s in samples)
        assert keys == sorted(f"0000{shard}000{i}" for i in range(4) if f"0000{shard}000{i}" != CORRUPT_KEY)
        gens = [json.loads(s["json"])["generation"] for s in samples]
        assert all(g["engine"] == "vllm" and g["model"] == str(tiny) for g in gens)
        assert all(s["rew.txt"].strip() and s["int.txt"].strip() for s in samples)
        stats = json.loads((out / f"0000{shard}_stats.json").read_text())
        eng = stats["engine_tokens"]
        # stage 2 found stage 1's image + turn 1 in vLLM's prefix cache: those tokens were not computed again
        assert eng["stage2_hits"] > 0 and eng["cached"] > 0 and 0 < eng["stage2_hit_rate"] <= 1
    stats_before = {p.name: p.read_bytes() for p in out.glob("*_stats.json")}

    again = subprocess.run([sys.executable, *documented_command(input_shards, out, tiny)], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already done    :      2  (0-1)" in again.stdout and "nothing to do" in again.stdout
    assert {p.name: p.read_bytes() for p in out.glob("*_stats.json")} == stats_before


def test_a_kill_mid_shard_resumes_with_nothing_lost_or_twice(shared_engines, tiny, input_shards, tmp_path, capsys):
    from demind.cli.generate import main as generate_main

    out = tmp_path / "out"
    argv = ["--input", str(input_shards), "--output", str(out), "--config", str(TINY_CPU), "run.progress=false",
            "engine.name=vllm", f"engine.model={tiny}", "engine.chunk_size=1"]
    # the process "dies" after the second shard's first sample is written
    with shard_writer_killed_at("00001.tar", written=1) as killed_writers, pytest.raises(KeyboardInterrupt):
        generate_main(argv)
    assert (out / "00000.tar").is_file() and (out / "00001.tar.tmp").is_file() and not (out / "00001.tar").exists()
    done_shard = (out / "00000.tar").read_bytes()

    capsys.readouterr()
    assert generate_main(argv) == 0
    printed = capsys.readouterr().out
    assert "already done    :      1  (0)" in printed and "to redo         :      1  (1)" in printed
    assert (out / "00000.tar").read_bytes() == done_shard and not list(out.glob("*.tmp"))
    keys = [s["__key__"] for tar in sorted(out.glob("*.tar")) for s in read_output(tar)]
    assert len(keys) == len(set(keys)) == 7  # 8 inputs, one corrupt image

    # per-request seeds: the same job again gives the same text, key by key
    other = tmp_path / "again"
    assert generate_main([*argv[:3], str(other), *argv[4:]]) == 0
    assert texts_by_key(other) == texts_by_key(out)


@pytest.mark.slow  # ~2 min more (a Ray cluster and a second engine start): not in CI's run; -m "vllm and slow"
def test_the_job_on_a_local_ray_worker_writes_what_a_local_run_writes(tiny, input_shards, tmp_path):
    """--distributor ray: one Ray worker (an actor) holds the vLLM engine, whose own engine process it starts;
    the intent shards are those of the same job run in one process, text for text."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    outputs = {}
    for how, extra in (("local", []), ("ray", ["--distributor", "ray", "--workers", "1"])):
        outputs[how] = tmp_path / how
        done = subprocess.run([sys.executable, *documented_command(input_shards, outputs[how], tiny), *extra,
                               "run.progress=false"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ray: 1 worker(s)" in done.stdout
    assert texts_by_key(outputs["ray"]) == texts_by_key(outputs["local"]) and len(texts_by_key(outputs["ray"])) == 7


# ----------------------------------------------------------------------------- the same request on both engines


def test_both_engines_feed_the_model_the_same_token_ids_and_agree_greedily(shared_engines, tiny):
    """One rendered prompt with one image: the token ids vLLM schedules (its image placeholder expanded by
    its own multimodal processing) equal those the transformers processor gives; greedy decoding of the
    tiny model on both engines (float32) gives the same tokens."""
    import numpy as np
    from PIL import Image

    from demind.engines.transformers_engine import TransformersEngine
    from demind.engines.vllm_engine import build_vllm_requests
    from demind.engines import render
    from demind.gen.prompts import load_prompts, rewrite_conversation

    greedy = SamplingConfig(temperature=0.0, top_p=1.0)
    on_vllm = vllm_engine(shared_engines, tiny, greedy)
    on_transformers = TransformersEngine(EngineConfig(name="transformers", model=str(tiny), dtype="float32"),
                                         greedy, device="cpu")
    rng = np.random.default_rng(0)
    requests = []
    for i, size in enumerate([(40, 30), (20, 64), (64, 64)]):  # three aspect ratios: three any-res grids
        image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
        prompt = render(on_transformers.processor, rewrite_conversation(load_prompts("v1"), f"a red dog {i}"))
        requests.append(GenRequest(prompt, image, seed=i, max_new_tokens=16))

    prompts, params = build_vllm_requests(requests, greedy)
    vllm_outputs = on_vllm.llm.generate(prompts, [on_vllm._sampling_params_cls(**p) for p in params], use_tqdm=False)
    for request, output in zip(requests, vllm_outputs):
        fed = on_transformers.processor(images=[request.image], text=[request.prompt], return_tensors="pt")
        assert list(output.prompt_token_ids) == fed["input_ids"][0].tolist()
    image_id = on_transformers.processor.image_token_id
    assert all(list(o.prompt_token_ids).count(image_id) > 1 for o in vllm_outputs)  # expanded, not one placeholder

    with torch.inference_mode():
        texts_t = [r.text for r in on_transformers.generate(requests)]
    outputs_v = on_vllm.llm.generate(prompts, [on_vllm._sampling_params_cls(**p) for p in params], use_tqdm=False)
    # the same generated tokens: vLLM's token ids decode to the transformers engine's text
    tokenizer = on_transformers.tokenizer
    assert [tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outputs_v] == texts_t
    # vLLM's own text differs only by the space its incremental detokenizer puts before the first word of
    # this word-level tokenizer (the job's output cleaning strips it)
    texts_v = [r.text for r in on_vllm.generate(requests)]
    assert [t.strip() for t in texts_v] == texts_t and all(texts_t)
    # (the random tiny model's greedy answer hardly depends on its input; that the two engines' numbers agree
    # where the input does matter is test_rerank_scores_on_vllm_equal_the_transformers_engine's check)


def test_seeded_requests_whose_prompts_outgrow_one_scheduler_step_all_finish(shared_engines, tiny):
    """One call of text-only prompts (as the triplet job's writer sends) that together exceed a scheduler step
    (4,096 tokens), each request with its own seed (sampling, not greedy): every request is answered, and the
    same requests again give the same texts. vLLM's CPU build died here ("CPU Generator does not use offset")
    when it split a seeded prompt's prefill across steps, i.e. on any job with more than a few requests a call."""
    import numpy as np

    on_vllm = vllm_engine(shared_engines, tiny)
    words = sorted(w for w in on_vllm.processor.tokenizer.get_vocab() if w.isalpha())
    rng = np.random.default_rng(1)
    requests = [GenRequest("USER: " + " ".join(rng.choice(words, 120)) + " ASSISTANT:", None, seed=i,
                           max_new_tokens=6) for i in range(60)]
    results = on_vllm.generate(requests)
    assert sum(r.prefilled_tokens for r in results) > 4096  # more than one step's tokens (prefix-cache hits aside)
    assert len(results) == 60 and all(r.output_tokens > 0 for r in results)
    assert [r.text for r in on_vllm.generate(requests)] == [r.text for r in results]


# ----------------------------------------------------------------------------- describers and re-ranking


def eval_argv(root, ckpt, llava, out, *extra):
    return ["--benchmark", "cirr", "--data-root", str(root), "--checkpoint", str(ckpt), "--out", str(out),
            "--num-workers", "0", "--methods", "cirevl,osrcir", "run.progress=false", "run.device=cpu",
            "engine.name=vllm", f"engine.model={llava}", "engine.dtype=float32", "describe.max_tokens=12",
            "describe.caption_max_tokens=8", "describe.rewrite_max_tokens=8", "describe.image_max_side=32", *extra]


def test_demind_eval_describes_and_reranks_on_vllm_and_a_rerun_loads_no_model(shared_engines, small_cirr,
                                                                             tiny_checkpoint, tiny, tmp_path,
                                                                             monkeypatch):
    from demind.cli.evaluate import main as evaluate_main
    from demind.engines.vllm_engine import VLLMEngine

    out = tmp_path / "val"
    rerank = ("rerank.k=3", "rerank.yes=dog", "rerank.no=cat")
    assert evaluate_main(eval_argv(small_cirr, tiny_checkpoint, tiny, out, *rerank)) == 0
    first = read_results(out)
    assert set(first["methods"]) == {"cirevl", "osrcir", "cirevl+rerank", "osrcir+rerank"}
    n = N_QUERIES["val"]
    mllm = first["mllm"]
    assert mllm["engine"] == "vllm" and mllm["model_loaded"] is True
    assert mllm["describers"]["cirevl"]["generated_now"] == mllm["describers"]["osrcir"]["generated_now"] == n
    assert mllm["rerank"]["pairs_stored"] == mllm["rerank"]["scored_now"] > 0
    ranks = rankings(out)
    for base in ("cirevl", "osrcir"):
        assert set(ranks[base]) == set(ranks[f"{base}+rerank"]) and len(ranks[base]) == n
        for qid, names in ranks[base].items():
            new = ranks[f"{base}+rerank"][qid]
            assert sorted(new[:3]) == sorted(names[:3]) and new[3:] == names[3:]

    def no_model(*args, **kwargs):
        raise AssertionError("the MLLM was loaded although every answer is stored")

    monkeypatch.setattr(VLLMEngine, "__init__", no_model)
    assert evaluate_main(eval_argv(small_cirr, tiny_checkpoint, tiny, out, *rerank)) == 0
    again = read_results(out)
    assert again["mllm"]["model_loaded"] is False and rankings(out) == ranks


def test_rerank_scores_on_vllm_equal_the_transformers_engine(shared_engines, tiny, tmp_path):
    """log p(yes) - log p(no) of the first answer token, from vLLM's log-probabilities, equals the score the
    transformers engine reads from the model's logits (float32; vLLM's CPU kernels round differently)."""
    from demind.mllm import LazyEngine, MemoryStore, MLLMVerifier, RerankOptions, load_describer_prompts
    from demind.engines.transformers_engine import TransformersEngine

    _, queries, candidates = write_rerank_queries(tmp_path, [(20, 30), (40, 20), (16, 16), (30, 60), (25, 25)])
    engines = {"vllm": vllm_engine(shared_engines, tiny),
               "transformers": TransformersEngine(EngineConfig(name="transformers", model=str(tiny), dtype="float32"),
                                                  SamplingConfig(), device="cpu")}
    scores = {}
    for name, engine in engines.items():
        options = RerankOptions(k=5, batch_size=3, yes="dog", no="cat")
        verifier = MLLMVerifier(LazyEngine(lambda engine=engine: engine), load_describer_prompts(), options,
                                MemoryStore())
        scores[name] = verifier.score(queries, candidates)
    for on_vllm, on_transformers in zip(scores["vllm"], scores["transformers"]):
        assert torch.allclose(torch.tensor(on_vllm), torch.tensor(on_transformers), atol=1e-3)
    assert len(set(scores["vllm"][0])) > 1  # the candidates get different scores


def test_demind_search_with_an_mllm_method_on_vllm(shared_engines, tiny, tiny_checkpoint, tmp_path):
    from demind.cli.search import main as search_main
    from demind.search.index import build_index
    from test_search import write_image

    from demind.checkpoint import load_backbone_and_model

    for i in range(6):
        write_image(tmp_path / "gallery" / f"img{i}.png", i, size=24)
    backbone, _ = load_backbone_and_model(tiny_checkpoint)
    build_index(tmp_path / "gallery", tmp_path / "index", backbone, batch_size=3, progress=False)
    out = tmp_path / "found.json"
    args = ["--index", str(tmp_path / "index"), "--checkpoint", str(tiny_checkpoint), "run.progress=false",
            "--image", str(tmp_path / "gallery" / "img2.png"), "--text", "make it red", "--method", "osrcir+rerank",
            "--out", str(out), "run.device=cpu", "engine.name=vllm", f"engine.model={tiny}", "engine.dtype=float32",
            "describe.max_tokens=12", "describe.image_max_side=32", "rerank.k=3", "rerank.yes=dog", "rerank.no=cat"]
    assert search_main(args) == 0
    record = json.loads(out.read_text())["queries"][0]
    assert len(record["results"]) == 5 and "img2.png" not in [r["name"] for r in record["results"]]
    assert record["description"]


# ----------------------------------------------------------------------------- the triplet job


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL ``demind-make-tiny-model --family qwen2-vl`` writes (several images a prompt)."""
    from demind.cli.make_tiny_model import main

    folder = tmp_path_factory.mktemp("tiny") / "tiny-qwen2-vl"
    assert main(["--family", "qwen2-vl", "--output", str(folder)]) == 0
    return folder


def test_the_triplet_job_on_vllm_describes_both_images_in_one_prompt(shared_engines, tiny_qwen, tmp_path):
    """demind-generate-triplets engine.name=vllm: the tiny Qwen2-VL describes each pair from both images
    (vLLM's limit_mm_per_prompt), the writer writes three instructions; the triplets of a rerun are the
    same (per-request seeds), and pairs whose image is missing or corrupt are counted skips."""
    from demind.cli.generate_triplets import main
    from test_triplet_gen import query, read_triplets, write_pairs

    corpus = tmp_path / "corpus"
    corrupt = write_img2dataset_shards(corpus)
    folder = write_pairs(tmp_path / "pairs", corpus, {
        0: [query("000000000", ["000000001", "000010000"], ["000000002"])],
        1: [query("000010000", ["000010001", corrupt], [])]})
    argv = ["--pairs", str(folder), "--config", str(REPO_ROOT / "configs/data_gen/triplets-tiny-cpu.yaml"),
            "run.progress=false", "engine.name=vllm", f"engine.model={tiny_qwen}"]
    assert main(argv + ["--output", str(tmp_path / "a")]) == 0
    triplets = read_triplets(tmp_path / "a")
    assert sorted(triplets) == ["000000000_000000001", "000000000_000010000", "000010000_000010001"]
    assert all(len(t["instructions"]) == 3 and t["description"] for t in triplets.values())
    assert {t["generation"]["describer"]["engine"] for t in triplets.values()} == {"vllm"}
    stats = __import__("json").loads((tmp_path / "a" / "triplets-00001_stats.json").read_text())
    assert stats["skipped"] == {"unreadable image": 1} and stats["tokens"]["describe"]["prompt"] > 0
    assert main(argv + ["--output", str(tmp_path / "b"), "engine.chunk_size=1"]) == 0
    assert read_triplets(tmp_path / "b") == triplets
