"""Every script under ``benchmarks/`` and ``toyworld/lab/`` runs its ``main(argv)`` at a tiny size, on
the CPU and offline, and leaves the numbers it exists for (a JSON file with the expected keys and
finite values), so no measurement command rots between the sessions that run it for real.

A script without a row here fails :func:`test_every_script_has_a_smoke_row`; the support modules
(``SUPPORT``) are the only files of ``benchmarks/`` that are not scripts. The toy-world rows share
one tiny quickstart workdir (``toy_world``), made by the ``toyworld.lab.recipes`` row's own run.
The numbers are timings of tiny models on a shared machine: rows check that they are there, finite
and ordered where the design says so (a kept prefix prefills fewer tokens), never their size.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import REPO_ROOT, TINY_CLIP, TINY_TOY_CLIP

pytestmark = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")

# Files of benchmarks/ that are imported by the scripts and the tests, not run.
SUPPORT = {
    "__init__": "the package",
    "gpu_models": "random-weight models at the real shapes for bench_gpu",
    "noise_common": "what noise_detection and noise_retrieval share",
    "exclusion_report": "the exclusion instrument's tables, paired tests and curves (exclusion_instrument)",
    "full_size_models": "random-weight model folders at the paper's shapes (bench_full_size, scripts/)",
    "bench_full_size": "the paper's sizes on a CPU: tens of minutes and 16+ GiB, never in CI (BENCHMARKS.md)",
}
# Scripts whose owner has yet to give them the one entry shape: their rows are expected to fail
# (strict: a row that starts passing fails until its mark goes).
NOT_YET: dict[str, str] = {}


def scripts() -> list[str]:
    """Module names of every script: benchmarks/*.py but the support modules, and toyworld/lab/*.py."""
    bench = [f"benchmarks.{p.stem}" for p in sorted((REPO_ROOT / "benchmarks").glob("*.py")) if p.stem not in SUPPORT]
    lab = [f"toyworld.lab.{p.stem}" for p in sorted((REPO_ROOT / "toyworld" / "lab").glob("*.py"))
           if p.stem != "__init__"]
    return bench + lab


def module_path(name: str) -> Path:
    return REPO_ROOT.joinpath(*name.split(".")).with_suffix(".py")


def run(name: str, argv: list[str]) -> None:
    """``python -m NAME ARGV`` in this process: its ``main`` must return 0."""
    assert importlib.import_module(name).main([str(a) for a in argv]) == 0


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def numbers(obj: Any) -> list[float]:
    """Every int or float inside a JSON value (booleans are not numbers here)."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in numbers(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in numbers(v)]
    return []


def positive(obj: Any) -> None:
    """``obj`` holds numbers and each is finite and > 0 (a rate, a time)."""
    values = numbers(obj)
    assert values and all(math.isfinite(v) and v > 0 for v in values), obj


def percent(obj: Any) -> None:
    """``obj`` holds numbers and each is a percentage (a recall, an accuracy)."""
    values = numbers(obj)
    assert values and all(0.0 <= v <= 100.0 for v in values), obj


# --------------------------------------------------------------------------- the shared toy world
# The tiny toy CLIP (the name matters: exclmm_toy finds a trained one by its toy-clip-*.json report)
# and a quickstart small enough for a smoke run; cirr_calibrate and clip_seeds pass the same recipe,
# so they reuse the toy CLIP the quickstart trained instead of training their own.
TINY_BACKBONE = {"steps": 2, "batch_size": 8, "warmup_steps": 1, "num_train_images": 16, "num_eval_scenes": 10,
                 "num_pair_probe_scenes": 4, "pretrain_steps": 2, "pretrain_first_steps": 1}
TINY_BENCHMARKS = {"cirr_sets": 4, "imgnet_queries_per_class": 1, "imgnet_targets_per_domain": 1,
                   "imgnet_distractors_per_class": 1, "coco_images": 4, "exclusion_queries": 2}
TINY_TRAIN = ["optim.max_steps=2", "optim.warmup_steps=1", "optim.global_batch_size=8", "data.shuffle_buffer=8",
              "data.shards_per_group=1", "model.num_blocks=1", "model.num_heads=4", "model.mapping_hidden=32",
              "run.save_every=100"]


def toy_clip_settings(model_config: Path, prefix: str = "") -> list[str]:
    return [f"{prefix}model_config={model_config}"] + [f"{prefix}{k}={v}" for k, v in TINY_BACKBONE.items()]


@pytest.fixture(scope="module")
def toy_world(tmp_path_factory) -> Path:
    """A tiny quickstart workdir (toy CLIP, toy benchmarks, one De-MINDS seed evaluated on the toy
    CIRR), made by ``python -m toyworld.lab.recipes --recipes default --seeds 0``."""
    root = tmp_path_factory.mktemp("toy_world")
    model_config = root / "toy-clip-tiny.json"
    model_config.write_text(json.dumps(TINY_TOY_CLIP))
    settings = [*toy_clip_settings(model_config, "backbone."), *(f"toy_benchmarks.{k}={v}" for k, v in TINY_BENCHMARKS.items()),
                "shards.num_samples=24", "shards.samples_per_shard=12", "eval_batch_size=32",
                "train_overrides=[" + ",".join(TINY_TRAIN) + "]"]
    run("toyworld.lab.recipes", ["--workdir", root / "w", "--recipes", "default", "--seeds", "0", "--set", *settings])
    return root / "w"


def toy_clip_weights(toy_world: Path) -> Path:
    """The tiny toy CLIP as trained (without the modality gap's extra dimension)."""
    (weights,) = [p for p in (toy_world / "backbone").glob("toy-clip-tiny-*.safetensors") if "-gap" not in p.name]
    return weights


# --------------------------------------------------------------------------- rows
ROWS: dict[str, Callable[[Path, pytest.FixtureRequest], None]] = {}
SLOW: set[str] = set()


def row(name: str, slow: bool = False):
    def register(fn):
        ROWS[name] = fn
        if slow:
            SLOW.add(name)
        return fn
    return register


@row("benchmarks.bench_channels_last")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_channels_last", ["--batch", 2, "--repeats", 1, "--threads", 1, "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert [r["layout"] for r in out["rows"]] == ["contiguous_format", "channels_last", "contiguous_format"]
    positive([r["ms_forward_backward"] for r in out["rows"]])


@row("benchmarks.bench_data_gen")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_data_gen", ["--samples", 4, "--batch-size", 2, "--repeats", 1, "--chunk-size", 2,
                                      "--image-size", "64x48", "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    positive([out[k] for k in ("engine_images_per_s_batched", "engine_images_per_s_single", "job_images_per_s_prefetch0",
                               "job_images_per_s_prefetch1", "prefix_cache_speedup")])
    tokens = out["prefilled_tokens_per_image"]
    assert 0 < tokens["batched"] < tokens["batched_no_prefix_cache"]  # the kept stage-1 prefix is not prefilled again
    assert set(out["overhead_breakdown_ms_per_sample"]) == {"read", "decode_resize", "prompt_render_2_stages", "write"}


@row("benchmarks.bench_triplet_gen")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_triplet_gen", ["--pairs", 2, "--modes", "each", "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")["runs"]["transformers/each"]
    assert out["pairs"] == 2 and out["calls_per_pair"]["describe"] >= 1 and out["calls_per_pair"]["instruct"] >= 3
    positive([out["pairs_per_s"], out["prompt_tokens_per_pair"]["describe"], out["output_tokens_per_pair"]["instruct"]])


@row("benchmarks.bench_describers")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_describers", ["--queries", 2, "--batch", 2, "--k", 2, "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert out["device"] == "cpu" and out["queries"] == 2
    positive([out[name]["descriptions_per_s"] for name in ("osrcir", "cirevl")])
    reuse, full = out["rerank_prefix_reuse"], out["rerank_full_prefill"]
    positive([reuse["candidates_per_s"], full["candidates_per_s"]])
    assert 0 < reuse["prompt_tokens_per_candidate"] <= full["prompt_tokens_per_candidate"]


@row("benchmarks.bench_answer_store")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_answer_store", ["--weights-mb", 2, "--queries", 3, "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert (out["weights_mb"], out["queries"]) == (2, 3)
    positive([out["first_run_s"], out["rerun_with_memo_s"], out["rerun_without_memo_s"], out["memo_speedup"]])


@row("benchmarks.bench_distributed_gen", slow=True)
def _(tmp: Path, request) -> None:
    pytest.importorskip("ray", reason="bench_distributed_gen needs the '.[distributed]' extra")
    run("benchmarks.bench_distributed_gen", ["--shards", 2, "--samples", 2, "--empty-shards", 2, "--workdir", tmp / "w",
                                             "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert [r["name"] for r in out["rows"]][1:] == ["1 worker", "2 workers", "1 worker", "2 workers"]
    assert all(r["shards"] == 2 for r in out["rows"][1:])
    positive([out["ratio_2_over_1"]] + [r["shards_per_s"] for r in out["rows"]])


@row("benchmarks.bench_eval")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_eval", ["--backbone", f"{TINY_CLIP}:none", "--device", "cpu", "--batches", "1,2",
                                  "--repeats", 1, "--images", 4, "--image-size", 32, "--batch-size", 2,
                                  "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert set(out["query_latency"]) == {"1", "2"}
    for r in out["query_latency"].values():
        positive([r["demind_s"], r["mapping_s"], r["ratio"], r["image_encode_s"], r["end_to_end_ratio"]])
    positive(out["gallery_images_per_s"])


@row("benchmarks.bench_exclcoco")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_exclcoco", ["--images", 40, "--workdir", tmp / "w", "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert (out["images"], out["captions"], out["categories"]) == (40, 200, 80)  # 5 captions an image, COCO's 80
    assert out["instances"] > 40 and out["queries"] > 0 and out["output_bytes"] > 0
    assert math.isfinite(out["build_seconds"]) and out["build_seconds"] >= 0


@row("benchmarks.bench_gpu")
def _(tmp: Path, request) -> None:
    # one cheap section; tests/test_bench_gpu.py runs the others
    run("benchmarks.bench_gpu", ["--tiny", "--only", "tower", "--precisions", "fp32", "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert out["tiny"] is True and out["device"] == "cpu"
    positive(out["sections"]["tower"]["images_per_s"]["fp32"])


@row("benchmarks.bench_negation")
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    (gap_model,) = (toy_world / "backbone").glob("toy-clip-tiny-*-gap50-model.json")
    (gap_weights,) = (toy_world / "backbone").glob("toy-clip-tiny-*-gap50.safetensors")
    run("benchmarks.bench_negation", ["--latency", "--methods-latency", "--repeats", 1, "--dims", 16, "--batches", "1,4",
                                      "--methods-batches", 2, "--model-config", TINY_CLIP,
                                      "--backbone-only", f"{gap_model}:{gap_weights}",
                                      "--benchmarks", toy_world / "benchmarks", "--out", tmp / "bb",
                                      "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert [(r["dim"], r["batch"]) for r in out["latency"]] == [(16, 1), (16, 4)]
    positive([[r["exact_s_per_query"], r["adam20_s_per_query"]] for r in out["latency"]])
    assert set(out["methods_latency_s_per_query"]["2"]) >= {"text-only", "text-only+deo", "demind", "demind+deo"}
    positive(out["methods_latency_s_per_query"])
    for bench in ("exclusion", "cirr"):
        assert set(out["backbone_only"][bench]) == {"text-only", "text-only+deo", "image+text", "image+text+deo"}
        percent(out["backbone_only"][bench])


@row("benchmarks.bench_query")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_query", ["--tiny", "--modes", "eager", "--repeats", 2, "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    eager = out["modes"]["eager"]
    positive([list(eager["p50_ms"].values()), list(out["anatomy"]["ms"].values())])
    assert eager["demind_over_mapping_only"] == round(eager["p50_ms"]["demind"] / eager["p50_ms"]["mapping_only"], 3)
    assert out["anatomy"]["intention_prompt_tokens"] == 4  # 2 queries + start and end of text
    assert "max_abs_diff_from_eager" not in eager  # eager is the reference


@row("benchmarks.bench_search")
def _(tmp: Path, request) -> None:
    from PIL import Image

    (tmp / "images").mkdir()
    for i in range(6):
        Image.new("RGB", (32, 32), (40 * i, 100, 200 - 30 * i)).save(tmp / "images" / f"{i}.png")
    # 1024 x 32: a gallery whose matrix rounds to a non-zero size in MB (the script divides by it)
    run("benchmarks.bench_search", ["--images", tmp / "images", "--gallery", 1024, "--dim", 32, "--queries", 2,
                                    "--hnsw-dims", "", "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert {"build", "embed", "rank"} <= set(out) and set(out["rank"]) == {"1024x32"}
    assert numbers(out["build"]) and all(math.isfinite(v) for v in numbers(out["build"]))
    assert numbers(out["rank"]) and all(math.isfinite(v) for v in numbers(out["rank"]))
    run("benchmarks.bench_search", ["--ivf-only", "--gallery", 1024, "--dim", 32, "--queries", 4,
                                    "--json", tmp / "i.json"])
    ivf = read_json(tmp / "i.json")["ivf"]["1024x32"]["faiss-ivf"]
    assert ivf["nlist"] == 26 and all(0 <= v["recall_at_10_midpoint"] <= 1 for k, v in ivf.items() if "nprobe" in k)
    run("benchmarks.bench_search", ["--ivfpq-only", "--gallery", 1024, "--dim", 32, "--queries", 4, "--cold", 2,
                                    "--json", tmp / "p.json"])
    cold = read_json(tmp / "p.json")["ivfpq"]["1024x32"]["cold"]
    assert set(cold) == {"faiss-ivfpq", "faiss-ivfpq with read-ahead", "exact", "exact advised as randomly read"}
    positive([v["p50_ms"] for v in cold.values()])
    pq = read_json(tmp / "p.json")["ivfpq"]["1024x32"]["faiss-ivfpq"]
    settings = [v for k, v in pq.items() if "nprobe" in k]  # 4 codes of 4 bits a row: 2 bytes
    assert pq["m"] == 4 and pq["codes_bytes"] == 1024 * 2 and all(0 <= v["recall_at_10_midpoint"] <= 1 for v in settings)
    assert len(settings) == 31 and pq["saved"]["loaded_not_built"] is True  # a start loads what was saved
    run("benchmarks.bench_search", ["--hnsw-only", "--gallery", 1024, "--dim", 32, "--queries", 4,
                                    "--ef-search", "16,64", "--json", tmp / "h.json"])
    hnsw = read_json(tmp / "h.json")["hnsw"]["1024x32"]["faiss-hnsw"]
    assert set(hnsw) == {"M32-efC80-ef16", "M32-efC80-ef64"}
    assert all(0 <= v[key] <= 1 for v in hnsw.values() for key in ("recall_at_10", "recall_at_10_midpoint"))


@row("benchmarks.bench_serve_load")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_serve_load", ["--clients", 2, "--seconds", 1, "--images", 8, "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert out["errors"] == 0 and out["first_errors"] == [] and out["rankings_consistent"] is True
    assert set(out["requests"]) == {"info", "gallery", "thumb", "search", "upload"}
    assert all(n > 0 for n in out["requests"].values())
    positive([[v["p50"], v["p95"]] for v in out["latency_ms"].values()])


@row("benchmarks.bench_text_trim")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_text_trim", ["--model", TINY_CLIP, "--batch", 4, "--repeats", 1, "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert len(out["rows"]) == 3  # CIRR-style prompts, the intention prompt, the training mix
    positive([[r["full_ms"], r["trimmed_1_bucket_ms"], r["trimmed_buckets_ms"]] for r in out["rows"]])


@row("benchmarks.bench_toy")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_toy", ["--steps", 1, "--render", 8, "--pool", 16, "--batch", 8, "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert set(out["steps"]) == {"foreach", "fused"} and out["render_scenes"] == 8
    positive(out["steps"])
    positive(out["render_s"])


@row("benchmarks.bench_train")
def _(tmp: Path, request) -> None:
    run("benchmarks.bench_train", ["--backbone", TINY_CLIP, "--batch", 2, "--steps", 2, "--shard-counts", 1,
                                   "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    t = out["throughput"]
    positive([t["uncached_samples_per_s"], t["cached_samples_per_s"], t["ratio_cached_over_uncached"]])
    assert [(r["shards"], r["mode"]) for r in out["memory"]] == [(1, "uncached"), (1, "cached")]
    positive([r["peak_rss_mib"] for r in out["memory"]])


@row("benchmarks.exclmm_toy")
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    steps = [f"{phase}.{key}={value}" for phase in ("sae", "space", "query") for key, value in (("steps", 2), ("batch_size", 8))]
    run("benchmarks.exclmm_toy", ["--backbone-dir", toy_world / "backbone", "--workdir", tmp / "w", "--seeds", 0,
                                  "--variants", "ExclMM", "--batch-size", 32,
                                  "--bench", "exclcoco_train_images=24", "exclcoco_test_images=12",
                                  "--set", *steps, "run.log_every=1", "run.save_every=2"])
    out = read_json(tmp / "w" / "results.json")["results"]
    assert set(out) == {"random ranking", "CLIP text-only", "CLIP text-only + DEO", "ExclMM"}
    for method, runs in out.items():
        assert len(runs) == 1, method
        percent({k: v for k, v in runs[0].items() if k != "_sign"})
    better, worse, p = out["ExclMM"][0]["_sign"]  # the paired sign test against CLIP text-only
    assert better >= 0 and worse >= 0 and 0 < p <= 1
    assert "| ExclMM |" in (tmp / "w" / "table.md").read_text()


@row("benchmarks.exclusion_instrument")
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    steps = [f"{phase}.{key}={value}" for phase in ("sae", "space", "query") for key, value in (("steps", 2), ("batch_size", 8))]
    run("benchmarks.exclusion_instrument", ["--quickstart", toy_world, "--workdir", tmp / "w", "--seeds", 0,
                                            "--folds", 0, "--instrument", "train_scenes_per_triple=1",
                                            "test_scenes_per_triple=1", "image_size=24", "--set", *steps])
    out = read_json(tmp / "w" / "results.json")
    assert set(out["gate"]) == {"red circle", "green square", "blue triangle", "yellow star", "purple cross",
                                "orange diamond", "pink hexagon"} and all(0 <= v <= 1 for v in out["gate"].values())
    assert set(out["means"]) == {"held-out", "in-domain"} and out["folds"] == [0] and out["seeds"] == [0]
    for split in out["means"].values():
        assert {"CLIP text-only", "CLIP + DEO", "ExclMM (paper's form)"} <= set(split)
        for metrics in split.values():
            assert all(len(per_seed) == 1 for per_seed in metrics.values())  # one value per seed
            assert 0 <= metrics["exclusion AUC"][0] <= 1 and 0 <= metrics["inclusion AUC"][0] <= 1
            percent({k: v[0] for k, v in metrics.items() if "AUC" not in k})
    test = out["paired"]["in-domain"]["ExclMM (paper's form) vs CLIP + DEO"]["exclusion AUC"]["0"]
    assert test["unit"] == "combination" and 1 <= test["n_units"] <= 21 and 0 < test["p_sign"] <= 1
    assert "| CLIP + DEO |" in (tmp / "w" / "table.md").read_text()


@row("benchmarks.noise_detection", slow=True)
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    run("benchmarks.noise_detection", ["--quickstart", toy_world, "--out", tmp / "o", "--tiny", "--kinds", "hard"])
    results = read_json(tmp / "o" / "noise_detection.json")["runs"]["hard"]["results"]
    for detector in ("gfq", "small-loss"):
        m = results[detector]["either"]
        assert 0 <= m["auroc"] <= 1 and 0 < m["noisy"] < m["samples"]


@row("benchmarks.conesep_triplets", slow=True)
def _(tmp: Path, request) -> None:
    run("benchmarks.conesep_triplets", ["--workdir", tmp / "w", "--train-sets", 12, "--test-sets", 3, "--epochs", 3,
                                        "--seeds", 0, "--rates", 0, 0.5, "--modes", "none", "conesep",
                                        "--clean-modes", "none", "conesep", "--kinds", "easy", "hard",
                                        "--set", "optim.batch_size=8"])
    out = read_json(tmp / "w" / "conesep_triplets.json")
    rows = {(r["kind"], r["rate"], r["mode"]) for r in out["rows"]}
    assert rows == {(k, r, m) for k, r in (("easy", 0.0), ("easy", 0.5), ("hard", 0.5)) for m in ("none", "conesep")}
    for r in out["rows"]:
        percent([r[m][0] for m in ("R@1", "R@5", "R@10", "Rsubset@1", "Avg")])
    (test,) = [r for r in out["rows"] if r["mode"] == "conesep" and r["kind"] == "hard"]
    assert test["vs_none"]["0"]["better"] >= 0 and 0 < test["vs_none"]["0"]["p_sign"] <= 1  # per seed, over sets
    assert test["vs_none"]["0"]["unit"] == "set" and "vs_none_summed" not in test
    assert "| easy 50 % | conesep |" in (tmp / "w" / "conesep_triplets.md").read_text()


@row("benchmarks.generated_triplets", slow=True)
def _(tmp: Path, request) -> None:
    run("benchmarks.generated_triplets", ["--workdir", tmp / "w", "--train-sets", 12, "--test-sets", 3, "--sizes", 20, 40,
                                          "--shard-size", 20, "--seeds", 0, "--epochs", 2, "--skip-demind",
                                          "--set", "optim.batch_size=8"])
    out = read_json(tmp / "w" / "generated_triplets.json")
    arms = {(r["arm"], r["size"]) for r in out["rows"]}
    assert {("generated", 20), ("generated", 40), ("generated-nohard", 40)} <= arms
    for r in out["rows"]:
        percent([r[m][0] for m in ("R@1", "R@5", "R@10", "Rsubset@1", "Avg")])
    assert out["record"]["mining"]["40"]["pairs"] > 0 and out["record"]["writing"]["40"]["triplets"] > 0
    assert "| generated | 40 |" in (tmp / "w" / "generated_triplets.md").read_text()


@row("benchmarks.noise_retrieval", slow=True)
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    run("benchmarks.noise_retrieval", ["--quickstart", toy_world, "--out", tmp / "o", "--tiny", "--kinds", "hard"])
    saved = read_json(tmp / "o" / "results.json")
    assert "clean/none/seed0" in saved["cells"] and "hard-0.50/conesep/seed0" in saved["cells"]
    for cell in saved["cells"].values():
        percent([cell["metrics"]["cirr:R@10"], cell["metrics"]["exclusion:mAP@10"]])


@row("benchmarks.reliability_kill", slow=True)
def _(tmp: Path, request) -> None:
    run("benchmarks.reliability_kill", ["--data-gen-kills", 1, "--train-kills", 1, "--samples", 2, "--train-steps", 10,
                                        "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    gen = out["data_gen"]
    assert gen["keys_in"] == gen["keys_out"] == 8 and gen["duplicates"] == 0 and gen["missing"] == 0
    assert gen["texts_equal_uninterrupted"] is True
    assert out["training"]["final_weights_bit_identical"] is True


@row("toyworld.lab.cirr_calibrate")
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    model_config = toy_world.parent / "toy-clip-tiny.json"
    # the quickstart's workdir: its toy CLIP (same recipe) is reused, not trained again
    run("toyworld.lab.cirr_calibrate", ["--workdir", toy_world, "--sets", 4, "--batch-size", 32,
                                        "--backbone", *toy_clip_settings(model_config)])
    record = json.loads((toy_world / "calibration.jsonl").read_text().splitlines()[-1])
    assert set(record["R@10"]) == {"image-only", "text-only", "image+text"} and record["sets"] == 4
    percent(record["metrics"])
    assert isinstance(record["meets_profile"], bool) and record["modality_gap"] == 50.0


@row("toyworld.lab.clip_seeds")
def _(tmp: Path, request) -> None:
    from toyworld.probes import PAIR_PROBE_ATTRIBUTES

    toy_world = request.getfixturevalue("toy_world")
    model_config = toy_world.parent / "toy-clip-tiny.json"
    # --out: the quickstart's workdir, so seed 0 is the toy CLIP it trained (read from its report)
    run("toyworld.lab.clip_seeds", ["--seeds", 0, "--out", toy_world, "--quiet", *toy_clip_settings(model_config)])
    out = read_json(toy_world / "toy_clip_seeds.json")
    report = read_json(toy_clip_weights(toy_world).with_suffix(".json"))
    assert {a: out["pair_probes"]["0"][a] for a in PAIR_PROBE_ATTRIBUTES} == report["pair_probes"]
    percent(report["pair_probes"])


@row("toyworld.lab.mllm_family")
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    (checkpoint,) = toy_world.glob("train/*/demind-seed0*/demind.safetensors")
    run("toyworld.lab.mllm_family", ["--workdir", toy_world, "--sets", 4, "--batch-size", 32, "--checkpoint", checkpoint,
                                     "--backbone", *toy_clip_settings(toy_world.parent / "toy-clip-tiny.json"),
                                     "--json", tmp / "o.json"])
    rows = read_json(tmp / "o.json")
    assert [r["noise"]["p_ignore"] for r in rows] == [0.0, 0.2, 0.4]  # the three noise levels
    for r in rows:
        assert set(r["R"]) == {"text-only", "image+text", "oracle", "osrcir", "cirevl", "demind", "demind+mllm"}
        percent(r["R"])
        assert r["queries"] > 0


@row("toyworld.lab.pair_probes")
def _(tmp: Path, request) -> None:
    from toyworld.probes import PAIR_PROBE_ATTRIBUTES

    toy_world = request.getfixturevalue("toy_world")
    run("toyworld.lab.pair_probes", ["--weights", toy_clip_weights(toy_world),
                                     "--model-config", toy_world.parent / "toy-clip-tiny.json", "--scenes", 4,
                                     "--ceiling-scenes", 10, "--breakdown", "--json", tmp / "o.json"])
    out = read_json(tmp / "o.json")
    assert set(out["pair_probes"]) == set(PAIR_PROBE_ATTRIBUTES) and out["scenes"] == 4
    percent(out["pair_probes"])
    assert set(out["breakdown"]) == set(PAIR_PROBE_ATTRIBUTES)
    assert out["heldout_probe_ceiling_R@10"]


@row("toyworld.lab.query_geometry")
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")
    (checkpoint,) = toy_world.glob("train/*/demind-seed0*/demind.safetensors")
    run("toyworld.lab.query_geometry", ["--cirr", toy_world / "benchmarks" / "cirr", "--features",
                                        toy_world / "eval" / "feature_cache", "--checkpoints", checkpoint,
                                        "--queries", 8, "--json", tmp / "o.json"])
    rows = read_json(tmp / "o.json")
    assert [r["query"] for r in rows] == ["demind", "mapping-only"]
    for r in rows:
        assert -1 <= r["gap_axis_cos"] <= 1 and -1 <= r["tanh_gate"] <= 1
        assert 0 <= r["std_cos_to_descriptions"] < 2 and 0 <= r["std_cos_to_target_images"] < 2


@row("toyworld.lab.recipes")
def _(tmp: Path, request) -> None:
    toy_world = request.getfixturevalue("toy_world")  # the fixture is this script's run
    result = read_json(toy_world / "recipes.json")["default"]
    assert result["seeds"] == [0] and result["overrides"] == []
    assert {"demind", "mapping-only", "image+text", "image-only", "text-only"} <= set(result["R@10"])
    percent(result["R@10"])
    paired = result["paired_R@10"]["0"]
    assert set(paired) == {"mapping-only", "image+text"} and all(0 < p["p"] <= 1 for p in paired.values())


# --------------------------------------------------------------------------- tests
def marks(name: str) -> list:
    out = [pytest.mark.slow] if name in SLOW else []
    if name in NOT_YET:
        out.append(pytest.mark.xfail(reason=NOT_YET[name], strict=True))
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=marks(n), id=n) for n in sorted(ROWS)])
def test_script_runs_at_a_tiny_size(name, tmp_path, request):
    ROWS[name](tmp_path, request)


def test_every_script_has_a_smoke_row():
    assert sorted(ROWS) == scripts(), "give each new script a row here (or list a support module in SUPPORT)"


def entry_shape_problems(name: str) -> list[str]:
    """What keeps a script from the one entry shape: ``def main(argv: list[str] | None = None) -> int``,
    ``if __name__ == "__main__": raise SystemExit(main())`` at the end, no sys.path edits, no import from tests/."""
    tree = ast.parse(module_path(name).read_text())
    problems = []
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    if not mains:
        problems.append("no top-level main")
    else:
        args = mains[0].args
        if [a.arg for a in args.args] != ["argv"] or len(args.defaults) != 1 or ast.unparse(mains[0].returns or ast.Constant(None)) != "int":
            problems.append(f"main({', '.join(a.arg for a in args.args)}) is not main(argv=None) -> int")
    guard = tree.body[-1]
    if ast.unparse(guard) != "if __name__ == '__main__':\n    raise SystemExit(main())":
        problems.append("the file does not end with: if __name__ == '__main__': raise SystemExit(main())")
    test_modules = {p.stem for p in (REPO_ROOT / "tests").rglob("*.py")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
            problems.append(f"line {node.lineno}: edits sys.path")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            top = {a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) else {(node.module or "").split(".")[0]}
            if top & (test_modules | {"tests"}):
                problems.append(f"line {node.lineno}: imports from tests/ ({', '.join(sorted(top))})")
    return problems


@pytest.mark.parametrize("name", [pytest.param(n, marks=[m for m in marks(n) if m.name == "xfail"], id=n)
                                  for n in scripts()])
def test_each_script_has_the_one_entry_shape(name):
    assert entry_shape_problems(name) == []


@pytest.mark.parametrize("support", sorted(SUPPORT))
def test_support_modules_edit_no_import_path(support):
    text = (REPO_ROOT / "benchmarks" / f"{support}.py").read_text()
    assert "sys.path" not in text


def test_the_entry_shape_check_catches_a_script_of_the_old_shape(tmp_path, monkeypatch):
    old = tmp_path / "benchmarks" / "old.py"
    old.parent.mkdir()
    old.write_text("import sys\nsys.path.insert(0, '..')\nfrom helpers import TINY_CLIP\n\n"
                   "def main() -> None:\n    pass\n\nif __name__ == '__main__':\n    main()\n")
    monkeypatch.setattr(f"{__name__}.REPO_ROOT", tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "helpers.py").write_text("")
    assert sorted(entry_shape_problems("benchmarks.old")) == [
        "line 2: edits sys.path", "line 3: imports from tests/ (helpers)", "main() is not main(argv=None) -> int",
        "the file does not end with: if __name__ == '__main__': raise SystemExit(main())"]
