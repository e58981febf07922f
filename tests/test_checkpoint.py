"""Checkpoint round trip and the wrong-backbone error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig, ModelConfig
from demind.checkpoint import CheckpointError, checkpoint_backbone_config, load_checkpoint, read_checkpoint_metadata, save_checkpoint
from demind.model import DeMinds


def test_round_trip_restores_weights_and_config(tmp_path, tiny_backbone):
    torch.manual_seed(1)
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=2, mapping_hidden=32, fusion="add"), tiny_backbone)
    with torch.no_grad():
        model.gate.fill_(0.7)
    path = save_checkpoint(tmp_path / "ckpt.safetensors", model)
    loaded = load_checkpoint(path, tiny_backbone)
    assert loaded.cfg == model.cfg
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    v = tiny_backbone.encode_image(torch.randn(2, 3, 32, 32))
    model.eval()
    assert torch.allclose(model(v, ["red", "blue"]).t_hat, loaded(v, ["red", "blue"]).t_hat, atol=1e-6)
    assert checkpoint_backbone_config(path) == tiny_backbone.cfg
    assert not list(tmp_path.glob("*.tmp"))


def test_wrong_backbone_names_both(tmp_path, tiny_backbone, repo_root):
    path = save_checkpoint(tmp_path / "ckpt.safetensors", DeMinds(ModelConfig(mapping_hidden=32), tiny_backbone))
    weights = tmp_path / "other.pt"
    torch.save(tiny_backbone.model.state_dict(), weights)
    other = FrozenCLIP(BackboneConfig(name=str(repo_root / "configs/model/tiny-clip.json"), pretrained=str(weights)))
    with pytest.raises(CheckpointError, match=r"trained on backbone .*tiny-clip.*'pretrained': 'random:.*loaded backbone is .*other\.pt"):
        load_checkpoint(path, other)


def test_two_random_backbones_are_different_backbones(tmp_path, tiny_backbone, repo_root):
    path = save_checkpoint(tmp_path / "ckpt.safetensors", DeMinds(ModelConfig(mapping_hidden=32), tiny_backbone))
    other = FrozenCLIP(BackboneConfig(name=str(repo_root / "configs/model/tiny-clip.json"), pretrained=None, seed=1))
    assert other.identity["pretrained"].startswith("random:") and other.identity != tiny_backbone.identity
    with pytest.raises(CheckpointError, match="load the backbone it was trained on"):
        load_checkpoint(path, other)


def test_not_a_checkpoint(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="x.safetensors"):
        read_checkpoint_metadata(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint_metadata(tmp_path / "missing.safetensors")


def test_a_checkpoint_written_before_the_refactors_loads_and_gives_the_same_queries(monkeypatch):
    """tests/fixtures/checkpoints/smoke-v0.1.safetensors was exported by the smoke recipe at the last
    commit before the toy world, the training engine and the config front end moved (16653a6), and
    the query embeddings beside it were computed there: today's loader must give the same ones."""
    import json

    from demind.checkpoint import load_backbone_and_model

    fixtures = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
    monkeypatch.chdir(fixtures.parents[2])  # its backbone is recorded as the repository's configs/model/tiny-clip.json
    expected = json.loads((fixtures / "smoke-v0.1.queries.json").read_text())
    backbone, model = load_backbone_and_model(fixtures / "smoke-v0.1.safetensors")
    side = expected["image_side"]
    images = torch.linspace(0, 1, 2 * 3 * side * side).reshape(2, 3, side, side)
    with torch.no_grad():
        v = backbone.encode_image(images)
        demind = model.query(v, expected["texts"])
        mapping_only = model.query(v, expected["texts"], mapping_only=True)
    assert torch.allclose(demind, torch.tensor(expected["demind"]), atol=1e-6)
    assert torch.allclose(mapping_only, torch.tensor(expected["mapping_only"]), atol=1e-6)
