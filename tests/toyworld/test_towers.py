"""Our own image towers (toyworld/towers.py), built by open_clip's timm adapter."""

from __future__ import annotations

import json
from pathlib import Path

import open_clip
import pytest
import torch

from demind.backbone import FrozenCLIP, quiet_random_init_notice
from demind.schema import BackboneConfig
from toyworld.towers import ToyConvNet

REPO = Path(__file__).resolve().parents[2]
TEXT = {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}


def _config(tmp_path: Path, pool: str = "max") -> Path:
    path = tmp_path / f"toy-cnn-{pool}.json"
    path.write_text(json.dumps({"embed_dim": 16, "text_cfg": TEXT, "vision_cfg": {
        "image_size": 64, "timm_model_name": "demind_toy_convnet", "timm_model_pretrained": False,
        "timm_pool": pool, "timm_proj": "linear"}}))
    return path


def _create(path: Path) -> torch.nn.Module:
    open_clip.add_model_config(path)
    with quiet_random_init_notice():
        return open_clip.create_model(path.stem, pretrained=None).eval()


def test_the_convnet_pools_by_the_configured_global_pool(tmp_path):
    """timm_pool "max" gives each channel's maximum over the last feature map, "avg" its mean."""
    torch.manual_seed(0)
    images = torch.randn(3, 3, 64, 64)
    for pool, reduce in (("max", lambda f: f.amax(dim=(2, 3))), ("avg", lambda f: f.mean(dim=(2, 3)))):
        trunk = _create(_config(tmp_path, pool)).visual.trunk
        assert isinstance(trunk, ToyConvNet)
        with torch.no_grad():
            features = trunk.features(images)
            assert features.shape == (3, 64, 8, 8)  # 4 x width 16 at 64 / 8
            torch.testing.assert_close(trunk(images), reduce(features))


def test_the_shipped_config_builds_and_its_weights_reload_through_frozen_clip(tmp_path):
    """The toy CLIP's config builds with open_clip, and a saved state dict loads through the
    project's loader with the same image embeddings (the registration rides on the import)."""
    config = REPO / "toyworld/model_configs/toy-clip-cnn-text2.json"
    model = _create(config)
    assert model.encode_image(torch.zeros(2, 3, 64, 64)).shape == (2, 128)
    # BatchNorm running statistics are part of the weights: move them off their init
    model.train()
    with torch.no_grad():
        model.encode_image(torch.randn(8, 3, 64, 64))
    model.eval()
    weights = tmp_path / "toy.pt"
    torch.save(model.state_dict(), weights)
    frozen = FrozenCLIP(BackboneConfig(name=str(config), pretrained=str(weights)))
    images = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        expected = model.encode_image(images)  # FrozenCLIP returns them unnormalised
    torch.testing.assert_close(frozen.encode_image(images), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(frozen.model.visual.trunk, ToyConvNet) and not frozen.model.visual.trunk.training


def test_asking_for_pretrained_weights_is_a_clear_error():
    import timm

    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("demind_toy_convnet", pretrained=True)
