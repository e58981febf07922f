"""GFQ fidelity (demind.fidelity) against hand-computed values, and its place in the feature cache."""

from __future__ import annotations

import json
import math

import pytest
import torch

from demind.fidelity import (NoiseBoundary, boundary_from_pairings, fidelity_from_similarity, fidelity_summary,
                             gfq_fidelity, pair_similarity, plot_fidelity)


def test_boundary_and_fidelity_match_a_hand_computed_case():
    # 2-D: texts along x and y; K = 2 pairings of 2 stand-in images each
    texts = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    fake = torch.tensor([[[1.0, 1.0], [0.0, 3.0]],     # pairing 0
                         [[1.0, 0.0], [-1.0, 1.0]]])   # pairing 1
    perms = torch.tensor([[0, 1], [1, 0]])
    # cosines: (1,1).x = 1/sqrt2; (0,3).y = 1; (1,0).y = 0; (-1,1).x = -1/sqrt2
    sims = [1 / math.sqrt(2), 1.0, 0.0, -1 / math.sqrt(2)]
    mean = sum(sims) / 4  # 0.25
    std = math.sqrt(sum((s - mean) ** 2 for s in sims) / 4)
    b = boundary_from_pairings(fake, texts, perms)
    assert b.boundary == pytest.approx(0.25) and b.boundary == pytest.approx(mean)
    assert b.tau == pytest.approx(std)
    # sample similarities 0.25 (at the boundary), 0.25 + tau and 0.25 - 2 tau
    s = torch.tensor([0.25, 0.25 + std, 0.25 - 2 * std])
    f = fidelity_from_similarity(s, b)
    expected = [0.5, 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(2))]
    assert f.tolist() == pytest.approx(expected, abs=1e-6)
    # and s itself is the cosine of the row-aligned pair
    image = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    assert pair_similarity(image, texts).tolist() == pytest.approx([0.6, 0.0])


def test_a_degenerate_pool_keeps_tau_positive():
    b = boundary_from_pairings(torch.ones(1, 3, 2), torch.ones(3, 2), torch.tensor([[0, 1, 2]]))
    assert b.boundary == pytest.approx(1.0) and b.tau > 0
    assert fidelity_from_similarity(torch.tensor([1.0]), b).item() == pytest.approx(0.5, abs=1e-3)


def test_matching_pairs_score_above_mismatched_ones():
    """On a pool where texts match their images, true pairs get F above omega and shuffled pairs
    score lower, with the boundary estimated from Gaussian stand-ins fitted to the images."""
    g = torch.Generator().manual_seed(0)
    common = torch.randn(16, generator=g)  # the shared "cone" direction of a modality
    content = torch.randn(64, 16, generator=g)
    images = common + content
    texts = 0.5 * common + content + 0.3 * torch.randn(64, 16, generator=g)
    f_true, boundary = gfq_fidelity(images, texts, 4, torch.Generator().manual_seed(1))
    f_wrong = fidelity_from_similarity(pair_similarity(images, texts.roll(1, 0)), boundary)
    assert isinstance(boundary, NoiseBoundary)
    assert (f_true > 0.5).float().mean() > 0.9
    assert f_wrong.mean() < f_true.mean() - 0.3


def test_summary_counts_and_plot(tmp_path):
    values = {"int": torch.tensor([0.05, 0.45, 0.5, 0.95, 1.0]), "rew": torch.tensor([0.9, 0.8])}
    summary = fidelity_summary(values, 0.5, bins=2)
    assert summary["int"]["histogram"] == [2, 3] and summary["int"]["below_omega"] == 2
    assert summary["int"]["share_below_omega"] == 0.4 and summary["rew"]["below_omega"] == 0
    path = plot_fidelity(values, tmp_path / "f.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
def test_cache_stores_fidelity_computed_from_its_own_embeddings(repo_root, tmp_path, capsys):
    from safetensors.torch import load_file

    from demind.cli import features as features_cli
    from demind.features import cache_files, shard_fidelity
    from toyworld.synthetic import write_synthetic_shards

    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=10)
    out = tmp_path / "cache"
    assert features_cli.main(["--config", str(repo_root / "configs/train/smoke.yaml"), "--out", str(out),
                              f"data.shards={shards}",
                              f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}"]) == 0
    printed = capsys.readouterr().out
    assert "GFQ fidelity T_int:" in printed and "GFQ fidelity T_rew:" in printed
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["fidelity"]["int"]["samples"] == 10 and sum(summary["fidelity"]["rew"]["histogram"]) == 10
    assert (out / "fidelity.png").is_file()
    tensors_path, index_path = cache_files(out, str(shards / "00000.tar"))
    tensors = load_file(str(tensors_path))
    index = json.loads(index_path.read_text())
    assert tensors["rew_emb"].shape == tensors["teacher_emb"].shape == (10, tensors["image_emb"].shape[1])
    # recomputing from the cached embeddings alone (no encoder) gives the stored values
    again, gfq = shard_fidelity(str(shards / "00000.tar"), {k: tensors[k] for k in ("image_emb", "teacher_emb",
                                                                                      "rew_emb")})
    torch.testing.assert_close(again["fidelity_int"], tensors["fidelity_int"])
    torch.testing.assert_close(again["fidelity_rew"], tensors["fidelity_rew"])
    assert gfq == index["gfq"] and set(gfq) == {"int", "rew"} and gfq["int"]["k"] == 4
    # the T_rew embedding is the frozen text tower's
    from demind.backbone import build_backbone
    from demind.training import load_train_config

    cfg = load_train_config(repo_root / "configs/train/smoke.yaml",
                            [f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}"])
    torch.manual_seed(cfg.run.seed)
    backbone = build_backbone(cfg.backbone)
    torch.testing.assert_close(backbone.encode_text(index["rewritten"]).pooled.float(), tensors["rew_emb"],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
def test_a_rewritten_shard_or_an_old_format_is_rebuilt(repo_root, tmp_path):
    from demind.cli import features as features_cli
    from demind.features import cache_files
    from toyworld.intent_data import ToyShardConfig, write_toy_shards

    shards = tmp_path / "shards"
    write_toy_shards(shards, ToyShardConfig(num_samples=6, samples_per_shard=6), show_progress=False, workers=1)
    out = tmp_path / "cache"
    args = ["--config", str(repo_root / "configs/train/smoke.yaml"), "--out", str(out), "--plot", "none",
            f"data.shards={shards}", f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}"]
    assert features_cli.main(args) == 0
    index_path = cache_files(out, str(shards / "00000.tar"))[1]
    clean_rew = json.loads(index_path.read_text())["rewritten"]
    write_toy_shards(shards, ToyShardConfig(num_samples=6, samples_per_shard=6, noise_kind="easy", noise_rate=1.0),
                     show_progress=False, workers=1)
    assert features_cli.main(args) == 0
    noisy_rew = json.loads(index_path.read_text())["rewritten"]
    assert noisy_rew != clean_rew  # the noisy shard's texts, not the clean shard's stale cache
    index = json.loads(index_path.read_text())
    index["format"] = "demind-feature-cache/1"
    index_path.write_text(json.dumps(index))
    assert features_cli.main(args) == 0
    assert json.loads(index_path.read_text())["format"] == "demind-feature-cache/2"
