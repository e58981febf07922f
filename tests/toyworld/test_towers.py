"""Our own image towers (toyworld/towers.py), built by open_clip's timm adapter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import open_clip
import pytest
import timm
import torch

from demind.backbone import BackboneConfig, FrozenCLIP, quiet_random_init_notice
from toyworld.towers import ToyConvNet

REPO = Path(__file__).resolve().parents[1]
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
    config = REPO / "configs/model/toy-clip-cnn.json"
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


def test_the_shape_proxy_runs_and_reports_an_exact_match_share(monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import toy_shape_proxy

    result = toy_shape_proxy.run(str(REPO / "configs/model/toy-clip-cnn.json"), {"timm_pool": "avg"}, steps=2,
                                 every=1, train_scenes=6, eval_scenes=5, world="v2", seed=0, progress=False)
    assert [point["step"] for point in result["curve"]] == [1, 2]
    assert all(0 <= point["exact"] <= 100 for point in result["curve"])
    assert result["vision_overrides"] == {"timm_pool": "avg"}


def _dot(x0: int, y0: int) -> torch.Tensor:
    """(1, 3, 64, 64): a bright 6-px square at (x0, y0) on black."""
    image = torch.zeros(1, 3, 64, 64)
    image[:, :, y0:y0 + 6, x0:x0 + 6] = 1.0
    return image


def test_coordinate_channels_let_the_max_pooled_convnet_see_where_a_thing_is():
    """The plain tower is blind to a shift by 16 px (a multiple of its 8x downsampling, away from
    the borders): both images give the same features. The coordinate-channel variant (the
    open_clip config names it ``demind_toy_convnet_coord``) tells them apart."""
    torch.manual_seed(0)
    left, right = _dot(16, 24), _dot(32, 24)
    plain = ToyConvNet(width=8).eval()
    coord = timm.create_model("demind_toy_convnet_coord", width=8).eval()
    assert isinstance(coord, ToyConvNet) and coord.coord_channels
    with torch.no_grad():
        assert torch.allclose(plain(left), plain(right), atol=1e-5)
        # relative to the features' size (a random init's activations are small, about 0.01); measured 0.18
        apart = ((coord(left) - coord(right)).norm() / coord(left).norm()).item()
        assert apart > 0.02, apart
        # the first convolution reads the 3 colour channels and the 2 coordinate channels
        grid = coord.features[0].conv.weight.shape[1]
    assert grid == 5
