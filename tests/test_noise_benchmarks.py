"""The two noisy-description measurements (benchmarks/noise_detection.py, noise_retrieval.py) end to
end at a tiny size, on a tiny quickstart-like workdir built here (slow: they train and evaluate)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from benchmarks import noise_detection, noise_retrieval
from helpers import TINY_TOY_CLIP

pytestmark = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_quickstart(tmp_path_factory):
    """A workdir as the quickstart leaves it: results.json (config), toy CLIP, toy CIRR + exclusion."""
    from toyworld.clip_config import ToyBackboneConfig
    from toyworld.clip_cache import ensure_toy_backbone
    from toyworld.benchmarks import ToyBenchmarkConfig, write_benchmarks
    from toyworld.pipeline import QuickstartConfig, ToyRunConfig

    root = tmp_path_factory.mktemp("qs")
    model_json = root / "toy-clip-tiny.json"
    model_json.write_text(json.dumps(TINY_TOY_CLIP))
    cfg = QuickstartConfig(workdir=str(root), run=ToyRunConfig(progress=False), eval_batch_size=32,
                           toy_benchmarks=ToyBenchmarkConfig(cirr_sets=4, exclusion_queries=2),
                           backbone=ToyBackboneConfig(model_config=str(model_json), steps=2, batch_size=8,
                                                      warmup_steps=1, num_train_images=16, num_eval_scenes=10,
                                                      pretrain_steps=2, pretrain_first_steps=1))
    ensure_toy_backbone(cfg.backbone, root / "backbone", progress=False)
    write_benchmarks(root / "benchmarks", cfg.toy_benchmarks, ("cirr", "exclusion"), progress=False)
    (root / "results.json").write_text(json.dumps({"config": asdict(cfg)}))
    return root


@slow
def test_noise_retrieval_tiny_runs_every_mode_and_resumes(tiny_quickstart, tmp_path, capsys):
    out = tmp_path / "retrieval"
    args = ["--quickstart", str(tiny_quickstart), "--out", str(out), "--tiny", "--kinds", "hard"]
    assert noise_retrieval.main(args) == 0
    table = capsys.readouterr().out
    saved = json.loads((out / "results.json").read_text())
    # rate 0 (clean) and 50 % hard noise, four modes, seed 0
    assert sorted(saved["cells"]) == sorted(f"{g}/{m}/seed0" for g in ("clean", "hard-0.50")
                                            for m in ("none", "filter", "downweight", "conesep"))
    for cell in saved["cells"].values():
        assert 0 <= cell["metrics"]["cirr:R@10"] <= 100 and 0 <= cell["metrics"]["exclusion:mAP@10"] <= 100
    row = saved["rows"]["hard/conesep/0.50"]
    (test,) = row["paired_vs_none"].values()  # one test per seed (one seed here), over toy CIRR sets
    assert test["unit"] == "set" and 0 < test["p_sign"] <= 1.0
    assert "conesep" in table and "hard noise, cirr:R@10" in table
    assert (out / "noise_retrieval.png").read_bytes()[:4] == b"\x89PNG"
    # the noisy shards hold the noise; the clean ones none
    stats = json.loads((out / "shards" / "hard-0.50" / "00000_stats.json").read_text())
    assert stats["noise"]["noisy"] > 0
    assert json.loads((out / "shards" / "clean" / "00000_stats.json").read_text())["noise"]["noisy"] == 0
    # a rerun skips every finished cell (no training, no evaluation)
    import toyworld.pipeline as pipeline

    def fail(*a, **k):
        raise AssertionError("a finished cell was redone")

    original = pipeline.train_variant
    pipeline.train_variant = fail
    try:
        assert noise_retrieval.main(args) == 0
    finally:
        pipeline.train_variant = original


@slow
def test_noise_detection_tiny_reports_both_detectors(tiny_quickstart, tmp_path, capsys):
    out = tmp_path / "detection"
    assert noise_detection.main(["--quickstart", str(tiny_quickstart), "--out", str(out), "--tiny"]) == 0
    saved = json.loads((out / "noise_detection.json").read_text())
    for kind in ("hard", "easy"):
        results = saved["runs"][kind]["results"]
        for detector in ("gfq", "small-loss"):
            for text in ("int", "rew", "either"):
                m = results[detector][text]
                assert 0 <= m["auroc"] <= 1 and 0 <= m["precision"] <= 1 and 0 <= m["recall"] <= 1
                assert m["samples"] == 64 and 0 < m["noisy"] < 64
    assert "small-loss" in capsys.readouterr().out
    assert noise_detection.main(["--quickstart", str(tiny_quickstart), "--out", str(out), "--rate", "0"]) == 2


def test_gmm_posterior_and_metrics_on_a_hand_made_case():
    losses = torch.tensor([0.1, 0.12, 0.11, 0.09, 0.9, 0.95, 0.88, 0.1])
    clean = noise_detection.gmm_clean_posterior(losses)
    assert (clean[:4] > 0.5).all() and (clean[4:7] < 0.5).all() and clean[7] > 0.5
    truth = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    m = noise_detection.detection_metrics(truth, 1 - clean, clean < 0.5)
    assert m["precision"] == 1.0 and m["recall"] == 0.75 and m["auroc"] == pytest.approx(0.875)


def test_a_rewritten_quickstart_benchmark_is_copied_again(tmp_path):
    """The measurements copy the quickstart's toy benchmarks once, and again after the quickstart
    rewrote one (another done-marker): never a copy of an older benchmark beside a newer backbone."""
    from benchmarks.noise_common import copy_benchmarks

    source = tmp_path / "qs" / "benchmarks" / "cirr"
    source.mkdir(parents=True)
    (source / "toy_benchmark.json").write_text(json.dumps({"benchmark": "cirr", "config": {"cirr_sets": 2}}))
    (source / "captions.json").write_text("two sets")
    root = copy_benchmarks(tmp_path / "qs", tmp_path / "out", which=("cirr",))
    assert (root / "cirr" / "captions.json").read_text() == "two sets"
    copy_benchmarks(tmp_path / "qs", tmp_path / "out", which=("cirr",))  # the same marker: kept
    (source / "toy_benchmark.json").write_text(json.dumps({"benchmark": "cirr", "config": {"cirr_sets": 3}}))
    (source / "captions.json").write_text("three sets")
    copy_benchmarks(tmp_path / "qs", tmp_path / "out", which=("cirr",))
    assert (root / "cirr" / "captions.json").read_text() == "three sets"
    assert (root / "cirr" / "toy_benchmark.json").read_text() == (source / "toy_benchmark.json").read_text()
