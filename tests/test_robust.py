"""Noise modes of training (demind.robust): the masked OT, BTU/NBL, filter/downweight against
hand-computed losses, every mode end to end on the tiny backbone, and resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from demind.losses import demind_losses
from demind.model import ComposeOutput
from demind.robust import (
    btu_allowed, btu_labels, btu_loss, masked_sinkhorn, nbl_loss, noise_aware_losses, sample_weights, target_fidelity)
from demind.schema import NoiseConfig


def test_masked_sinkhorn_matches_the_marginals_and_puts_no_mass_on_masked_paths():
    torch.manual_seed(0)
    b = 5
    noisy = torch.tensor([True, False, True, False, False])
    cost = torch.rand(b, 2 * b) * 2
    allowed = btu_allowed(noisy)
    # masked: (0,0), (2,2) for the noisy rows; (1,6), (3,8), (4,9) for the clean rows
    expected = torch.ones(b, 2 * b, dtype=torch.bool)
    for i, j in [(0, 0), (2, 2), (1, 6), (3, 8), (4, 9)]:
        expected[i, j] = False
    assert torch.equal(allowed, expected)
    plan = masked_sinkhorn(cost, allowed, reg=0.05)
    assert plan.dtype == torch.float64
    assert torch.all(plan[~allowed] == 0)
    torch.testing.assert_close(plan.sum(1), torch.full((b,), 1 / b, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(plan.sum(0), torch.full((2 * b,), 1 / (2 * b), dtype=torch.float64), atol=1e-6, rtol=0)
    # a cheap path gets more mass than a dear one in the same row
    cost2 = cost.clone()
    cost2[1, 3], cost2[1, 4] = 0.0, 2.0
    plan2 = masked_sinkhorn(cost2, allowed, reg=0.05)
    assert plan2[1, 3] > plan2[1, 4]


def test_btu_labels_and_a_gamma_zero_loss_are_cross_entropy_to_the_hard_labels():
    noisy = torch.tensor([False, True, False])
    labels = btu_labels(noisy)
    assert labels.argmax(1).tolist() == [0, 4, 2]  # clean: own target; noisy: own negative anchor (B + i)
    torch.manual_seed(1)
    q, k, n = (F.normalize(torch.randn(3, 4), dim=-1) for _ in range(3))
    loss, mass = btu_loss(q, k, n, noisy, 5.0, gamma=0.0, reg=0.05)
    logits = 5.0 * torch.cat([q @ k.T, q @ n.T], 1)
    expected = F.cross_entropy(logits, labels.argmax(1))  # KL(one-hot || p) = CE
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(mass) == 0.0
    # with gamma > 0 the soft labels give the noisy row no mass on its own target
    loss_soft, mass_soft = btu_loss(q, k, n, noisy, 5.0, gamma=0.7, reg=0.05)
    assert math.isfinite(float(loss_soft)) and float(mass_soft) == 0.0


def test_nbl_pushes_the_negative_from_its_own_target_towards_the_others():
    targets = torch.eye(3)
    query = targets.clone()
    away = -torch.eye(3)  # opposite of its own target
    towards = torch.eye(3)  # equal to its own target
    assert float(nbl_loss(away, targets, query, nu=0.0)) < float(nbl_loss(towards, targets, query, nu=0.0))
    # orthogonality hinge: cos(neg, query) = 1 lies above the interval [0 (non-matching), 1 (matching)]: no cost;
    # cos = -1 lies below it: cost 1 per row, times nu
    hinge = float(nbl_loss(away, targets, query, nu=1.0) - nbl_loss(away, targets, query, nu=0.0))
    assert hinge == pytest.approx(1.0)


def _tiny_batch():
    # B = 3, D = 2, scale 1: t_hat = image = teacher = t* for hand computation
    e = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), dim=-1)
    return ComposeOutput(e, e, e), e, e


def _row_losses(e: torch.Tensor) -> list[float]:
    """Per-row symmetric InfoNCE of (e, e) at scale 1, by hand: logits e e^T are symmetric,
    so both directions give row i's cross-entropy -s_ii + log sum_j exp(s_ij)."""
    sims = (e @ e.T).tolist()
    return [-sims[i][i] + math.log(sum(math.exp(s) for s in sims[i])) for i in range(3)]


@pytest.mark.parametrize("mode", ["filter", "downweight"])
def test_filter_and_downweight_losses_equal_the_hand_computed_ones(mode):
    out, teacher, image = _tiny_batch()
    rows = _row_losses(image)
    f_int = torch.tensor([0.9, 0.2, 0.6])
    f_rew = torch.tensor([0.3, 0.8, 0.1])
    kinds = ["original", "rewritten", "intent"]  # -> align fidelity 1.0, 0.8, 0.6
    f_align = target_fidelity(kinds, f_int, f_rew)
    assert f_align.tolist() == pytest.approx([1.0, 0.8, 0.6])
    terms = noise_aware_losses(out, teacher, image, torch.tensor(1.0), NoiseConfig(mode=mode), f_align, f_int)
    if mode == "filter":  # omega 0.5: align keeps all three rows, distil drops row 1 (F_int 0.2)
        align = sum(rows) / 3
        distil = (rows[0] + rows[2]) / 2
    else:
        align = (1.0 * rows[0] + 0.8 * rows[1] + 0.6 * rows[2]) / 2.4
        distil = (0.9 * rows[0] + 0.2 * rows[1] + 0.6 * rows[2]) / 1.7
    assert float(terms["align"]) == pytest.approx(align, rel=1e-5)
    assert float(terms["distil"]) == pytest.approx(distil, rel=1e-5)
    assert float(terms["loss"]) == pytest.approx(align + distil, rel=1e-5)
    assert float(terms["noisy_distil"]) == pytest.approx(1 / 3) and float(terms["noisy_align"]) == 0.0
    # mode none and all-ones weights give the plain loss
    plain = demind_losses(out, teacher, image, torch.tensor(1.0))
    ones = noise_aware_losses(out, teacher, image, torch.tensor(1.0), NoiseConfig(mode=mode),
                              torch.ones(3), torch.ones(3))
    assert float(ones["loss"]) == pytest.approx(float(plain["loss"]), rel=1e-6)


def test_all_filtered_batch_gives_zero_not_nan():
    out, teacher, image = _tiny_batch()
    terms = noise_aware_losses(out, teacher, image, torch.tensor(1.0), NoiseConfig(mode="filter"),
                               torch.zeros(3), torch.zeros(3))
    assert float(terms["loss"]) == 0.0
    assert sample_weights("none", torch.zeros(3), 0.5) is None


def test_conesep_objective_is_robust_plus_weighted_terms_after_warmup():
    torch.manual_seed(0)
    t_hat, t_star, image, teacher, negative = (F.normalize(torch.randn(4, 8), dim=-1) for _ in range(5))
    out = ComposeOutput(t_hat, t_hat, t_star)
    f = torch.tensor([0.9, 0.1, 0.8, 0.3])
    cfg = NoiseConfig(mode="conesep", kappa=0.5, zeta=0.5)
    after = noise_aware_losses(out, teacher, image, torch.tensor(10.0), cfg, f, f, negative=negative)
    before = noise_aware_losses(out, teacher, image, torch.tensor(10.0), cfg, f, f, negative=negative,
                                after_warmup=False)
    robust = noise_aware_losses(out, teacher, image, torch.tensor(10.0), NoiseConfig(mode="filter"), f, f)
    assert float(after["align"]) == pytest.approx(float(robust["align"]))
    assert float(after["loss"]) == pytest.approx(float(robust["loss"] + 0.5 * after["ul"] + 0.5 * after["intra"]),
                                                 rel=1e-5)
    assert float(before["ul"]) == 0.0
    assert float(before["loss"]) == pytest.approx(float(robust["loss"] + 0.5 * before["intra"]), rel=1e-5)
    assert float(after["ot_masked_mass"]) == 0.0 and float(after["ul"]) > 0
    with pytest.raises(ValueError, match="negative_tokens"):
        noise_aware_losses(out, teacher, image, torch.tensor(10.0), cfg, f, f)


# ------------------------------------------------------------------ end to end


pytestmark_train = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")


def noise_args(repo_root: Path, shards: Path, run: Path, mode: str, *extra: str) -> list[str]:
    args = ["--config", str(repo_root / "configs/train/smoke.yaml"), f"data.shards={shards}",
            f"run.output_dir={run}", f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}",
            f"noise.mode={mode}", "run.log_every=1", "optim.global_batch_size=8", *extra]
    if mode == "conesep":
        args += ["model.negative_tokens=2", "noise.warmup_steps=1"]
    return args


@pytestmark_train
@pytest.mark.parametrize("mode", ["none", "filter", "downweight", "conesep"])
def test_every_mode_trains_end_to_end(repo_root, tmp_path, mode):
    from demind.cli import train
    from toyworld.synthetic import write_synthetic_shards

    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=24)
    run = tmp_path / "run"
    assert train.main(noise_args(repo_root, shards, run, mode, "optim.max_steps=3", "data.features=null")) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    if mode == "none":
        assert "noisy_align" not in metrics[0]
        return
    assert all(0 <= m["noisy_align"] <= 1 and 0 <= m["noisy_distil"] <= 1 for m in metrics)
    assert all(m["ot_masked_mass"] == 0.0 for m in metrics)
    if mode == "conesep":
        assert metrics[0]["ul"] == 0.0 and metrics[1]["ul"] > 0  # warm-up of one step
        assert all(m["intra"] > 0 for m in metrics)
        weights = load_file(str(run / "demind.safetensors"))
        assert weights["negative_prompt"].shape[0] == 2
    else:
        assert all(m["ul"] == 0.0 and m["intra"] == 0.0 for m in metrics)


@pytestmark_train
def test_conesep_needs_the_negative_prompt(repo_root, tmp_path, capsys):
    from demind.cli import train

    args = ["--config", str(repo_root / "configs/train/smoke.yaml"), f"run.output_dir={tmp_path / 'run'}",
            f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", "noise.mode=conesep"]
    assert train.main(args) == 2
    assert "model.negative_tokens" in capsys.readouterr().err
    assert train.main(args + ["noise.mode=cone"]) == 2
    assert "noise.mode" in capsys.readouterr().err
    assert train.main(args + ["noise.mode=filter", "model.negative_tokens=2"]) == 2
    assert "only used by noise.mode=conesep" in capsys.readouterr().err


@pytestmark_train
def test_conesep_on_the_feature_cache_resumes_to_the_same_weights(repo_root, tmp_path):
    """Cached features (T_rew embeddings from the cache, no text pass for GFQ) and a resume across
    the warm-up boundary: 3 steps then 3 more equal 6 uninterrupted steps."""
    from demind.cli import features as features_cli
    from demind.cli import train
    from toyworld.synthetic import write_synthetic_shards

    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=24)
    common = ["optim.schedule=constant", "optim.warmup_steps=0", "run.save_every=3", "noise.warmup_steps=2",
              "data.features=auto"]
    assert features_cli.main(["--config", str(repo_root / "configs/train/smoke.yaml"), "--plot", "none",
                              f"data.shards={shards}",
                              f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}"]) == 0
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert train.main(noise_args(repo_root, shards, whole, "conesep", "optim.max_steps=6", *common)) == 0
    assert train.main(noise_args(repo_root, shards, split, "conesep", "optim.max_steps=3", *common)) == 0
    assert train.main(noise_args(repo_root, shards, split, "conesep", "optim.max_steps=6", *common)) == 0
    a, b = load_file(str(whole / "demind.safetensors")), load_file(str(split / "demind.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    ma = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in mb] == list(range(1, 7))
    assert [m["ul"] for m in mb] == pytest.approx([m["ul"] for m in ma], rel=1e-5)


def test_conesep_without_pot_is_named_at_load_time(monkeypatch):
    import importlib.util

    from demind.config import ConfigError, load_config
    from demind.training import TrainConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ot" else real(name, *a))
    with pytest.raises(ConfigError, match=r"noise.mode.*pip install pot"):
        load_config(TrainConfig, None, ["noise.mode=conesep", "model.negative_tokens=2"])
    load_config(TrainConfig, None, ["noise.mode=filter"])  # the other modes need no POT
