"""Shipped toy CLIP weights: packed in a few MB, expanded bit for bit, or trained when they do not fit."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import TINY_TOY_CLIP
from toyworld import clip_cache, shipped
from toyworld.clip_config import ToyBackboneConfig
from toyworld.clip_cache import cached_paths, ensure_toy_backbone
from toyworld.shipped import SHIPPED_DIR, ShippedWeightsError, expand_shipped, initial_state, pack


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny toy CLIP trained the quickstart's way (both stages), packed as the package ships it."""
    root = tmp_path_factory.mktemp("shipped")
    (root / "toy-clip-ship.json").write_text(json.dumps(TINY_TOY_CLIP))
    cfg = ToyBackboneConfig(model_config=str(root / "toy-clip-ship.json"), steps=2, batch_size=8, warmup_steps=1,
                            num_train_images=16, num_eval_scenes=10, num_pair_probe_scenes=4,
                            pretrain_steps=2, pretrain_first_steps=1, shipped=False)
    weights, report = ensure_toy_backbone(cfg, root / "trained", progress=False)
    packed = pack(load_file(str(weights)), initial_state(cfg), {"train_seconds": report["train_seconds"]},
                  root / "ship" / weights.name)
    return cfg, root, weights, packed


def equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_packed_weights_expand_to_the_trained_ones_bit_for_bit(trained):
    cfg, _, weights, packed = trained
    state, log = expand_shipped(packed, cfg)
    assert equal_states(state, load_file(str(weights))) and set(log) == {"train_seconds"}
    # only the token-embedding rows training touched are stored: the rest are the initial draw
    compact = load_file(str(packed))
    assert 0 < len(compact["token_embedding.rows"]) < 2000 and "token_embedding.weight" not in compact


def test_the_cache_takes_shipped_weights_instead_of_training(trained, tmp_path, monkeypatch, caplog):
    cfg, root, weights, packed = trained
    monkeypatch.setattr(shipped, "SHIPPED_DIR", packed.parent)
    monkeypatch.setattr(clip_cache, "train_toy_clip", lambda *a, **k: pytest.fail("trained despite shipped weights"))
    caplog.set_level(logging.INFO, logger="toyworld")
    recipe = dataclasses.replace(cfg, shipped=True)
    got, report = ensure_toy_backbone(recipe, tmp_path / "cache", progress=False)
    assert got == cached_paths(recipe, tmp_path / "cache")[0] and equal_states(load_file(str(got)), load_file(str(weights)))
    assert "pair_probes" in report and any("shipped weights" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("damage", ["digest", "truncated"])
def test_shipped_weights_that_do_not_expand_are_trained_instead(trained, tmp_path, monkeypatch, caplog, damage):
    cfg, root, weights, packed = trained
    bad = tmp_path / "ship" / packed.name
    bad.parent.mkdir()
    if damage == "digest":  # what another torch drawing other initial values looks like
        save_file(load_file(str(packed)), str(bad), metadata={"format": shipped.FORMAT, "weights_sha256": "0" * 64,
                                                              "log": "{}"})
    else:
        bad.write_bytes(packed.read_bytes()[:-64])
    with pytest.raises(ShippedWeightsError):
        expand_shipped(bad, cfg)
    monkeypatch.setattr(shipped, "SHIPPED_DIR", bad.parent)
    caplog.set_level(logging.INFO, logger="toyworld")
    recipe = dataclasses.replace(cfg, shipped=True)
    got, _ = ensure_toy_backbone(recipe, tmp_path / "cache", progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("toyworld")]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "training it instead" in warnings[0]
    assert equal_states(load_file(str(got)), load_file(str(weights)))  # trained: the same weights


def test_the_shipped_default_weights_are_the_default_recipes_bit_for_bit():
    """The file in toyworld/weights expands, under this torch, to the weights it records (the check
    the quickstart makes before it uses them; a mismatch would make every quickstart train)."""
    cfg = ToyBackboneConfig()
    files = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert [f.name for f in files] == [cached_paths(cfg, SHIPPED_DIR)[0].name]
    assert files[0].stat().st_size < 3e6
    state, log = expand_shipped(files[0], cfg)
    assert state["token_embedding.weight"].shape == (49408, 128) and log["train_seconds"] > 0
