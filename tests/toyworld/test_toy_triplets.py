"""Toy training triplets (toyworld.triplets): a rerun replaces what an older run left that no longer fits."""

from __future__ import annotations

import json

import pytest

from toyworld import clip_cache
from toyworld.triplets import COPIED_CONFIG_NAME, COPIED_WEIGHTS_NAME, write_toy_triplets


@pytest.fixture()
def toy_clip(tmp_path, monkeypatch):
    """The toy CLIP's files as small stand-ins (the copy logic is under test, not the model):
    returns the (weights, model config) pair ``with_modality_gap`` hands to the writer."""
    source = tmp_path / "source"
    source.mkdir()
    weights, config = source / "gap.safetensors", source / "gap-model.json"
    weights.write_bytes(b"the current toy CLIP's weights")
    config.write_text(json.dumps({"embed_dim": 8}))
    monkeypatch.setattr(clip_cache, "ensure_toy_backbone", lambda cfg, folder, progress: (source / "w", {}))
    monkeypatch.setattr(clip_cache, "with_modality_gap", lambda cfg, w: (weights, config))
    return weights, config


def test_a_copy_of_an_older_toy_clip_is_replaced(tmp_path, toy_clip):
    weights, config = toy_clip
    out = tmp_path / "triplets"
    write_toy_triplets(out, train_sets=2, test_sets=2, first_set=10, progress=False)
    copy = out / "backbone" / COPIED_WEIGHTS_NAME
    assert copy.read_bytes() == weights.read_bytes()
    # what a run before the toy CLIP changed left: another backbone's bytes under the fixed name,
    # and a marker whose settings did not name the backbone
    copy.write_bytes(b"an older toy CLIP's weights")
    marker = out / "toy_triplets.json"
    record = json.loads(marker.read_text())
    record["settings"] = {"train_sets": 2, "test_sets": 2, "first_set": 10, "format": 1}
    marker.write_text(json.dumps(record))
    record = write_toy_triplets(out, train_sets=2, test_sets=2, first_set=10, progress=False)
    assert copy.read_bytes() == weights.read_bytes()
    assert (out / "backbone" / COPIED_CONFIG_NAME).read_bytes() == config.read_bytes()
    assert record["settings"]["format"] == 2 and "backbone" in record["settings"]
    assert json.loads(marker.read_text()) == record


def test_another_test_set_count_rewrites_the_toy_cirr(tmp_path, toy_clip):
    out = tmp_path / "triplets"

    def test_set_ids() -> set[int]:
        pairs = json.loads((out / "cirr" / "captions" / "cap.rc2.val.json").read_text())
        return {p["img_set"]["id"] for p in pairs}

    write_toy_triplets(out, train_sets=2, test_sets=2, first_set=10, progress=False)
    assert test_set_ids() == {0, 1}
    record = write_toy_triplets(out, train_sets=2, test_sets=3, first_set=10, progress=False)
    assert test_set_ids() == {0, 1, 2} and record["settings"]["test_sets"] == 3
    assert json.loads((out / "cirr" / "toy_benchmark.json").read_text())["config"]["cirr_sets"] == 3
