"""The toy CLIP's modality gap: one more text dimension held at c, which images never use.

What it must do (toyworld.clip.add_modality_gap): leave every image-image similarity and every
text->image ranking as they were (so Text-only, Image-only and the pair probes do not move), scale
each caption's cosines to images by k = |xP| / sqrt(|xP|^2 + c^2), and narrow the text cone.
Checked on random toy CLIPs (a ViT and the convnet tower) saved and loaded through the real path.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from demind.backbone import FrozenCLIP
from demind.config import ConfigError
from helpers import TINY_TOY_CLIP
from toyworld.clip import add_modality_gap, build_toy_model
from toyworld.clip_config import ToyBackboneConfig
from toyworld.clip_cache import save_weights, with_modality_gap
from toyworld.pipeline import toy_backbone_config

TINY_CNN = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "timm_model_name": "demind_toy_convnet", "timm_model_pretrained": False,
                   "timm_pool": "max", "timm_proj": "linear"},
    "text_cfg": {"context_length": 56, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 1},
}
TEXTS = ["a red circle on grass", "a small blue star", "make the square green", "two triangles at night",
         "the target shows a large orange diamond", "a photo of a ball and a fence"]
GAP = 3.0


def backbones(tmp_path, config: dict, gap: float) -> tuple[FrozenCLIP, FrozenCLIP, float]:
    """(the toy CLIP as trained, the same with the gap, the gap) through the quickstart's loader."""
    model_json = tmp_path / "toy.json"
    model_json.write_text(json.dumps(config))
    cfg = ToyBackboneConfig(model_config=str(model_json), modality_gap=gap)
    torch.manual_seed(0)
    model, _, _ = build_toy_model(cfg)
    weights = tmp_path / "toy-weights.safetensors"
    save_weights(model, weights)
    gapped_weights, gapped_config = with_modality_gap(cfg, weights)
    base = FrozenCLIP(toy_backbone_config(model_json, weights))
    return base, FrozenCLIP(toy_backbone_config(gapped_config, gapped_weights)), gap


@pytest.mark.parametrize("config", [TINY_TOY_CLIP, TINY_CNN], ids=["vit", "convnet"])
def test_gap_keeps_every_single_modality_ranking_and_shrinks_caption_cosines(tmp_path, config):
    base, gapped, gap = backbones(tmp_path, config, GAP)
    assert gapped.embed_dim == base.embed_dim + 1
    images = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        img0, img1 = base.encode_image(images).float(), gapped.encode_image(images).float()
        txt0, txt1 = base.encode_text(TEXTS).pooled, gapped.encode_text(TEXTS).pooled
    # images never use the new dimension; texts hold it at the gap
    torch.testing.assert_close(img1[:, :-1], img0)
    assert img1[:, -1].abs().max() == 0
    torch.testing.assert_close(txt1, torch.cat([txt0, torch.full((len(TEXTS), 1), gap)], dim=1))

    image_sims0 = F.normalize(img0, dim=-1) @ F.normalize(img0, dim=-1).T
    image_sims1 = F.normalize(img1, dim=-1) @ F.normalize(img1, dim=-1).T
    torch.testing.assert_close(image_sims1, image_sims0)
    cross0 = F.normalize(txt0, dim=-1) @ F.normalize(img0, dim=-1).T        # (texts, images)
    cross1 = F.normalize(txt1, dim=-1) @ F.normalize(img1, dim=-1).T
    norm = txt0.norm(dim=-1, keepdim=True)
    k = norm / (norm ** 2 + gap ** 2).sqrt()                                 # (texts, 1), each < 1
    torch.testing.assert_close(cross1, k * cross0)
    assert (k < 1).all() and torch.equal(cross1.argsort(dim=1), cross0.argsort(dim=1))
    # the text cone narrows: every pair of different texts is closer than before
    text_sims0 = F.normalize(txt0, dim=-1) @ F.normalize(txt0, dim=-1).T
    text_sims1 = F.normalize(txt1, dim=-1) @ F.normalize(txt1, dim=-1).T
    off = ~torch.eye(len(TEXTS), dtype=torch.bool)
    assert (text_sims1[off] > text_sims0[off]).all()


def test_gap_zero_is_the_toy_clip_as_trained_and_the_gapped_files_are_reused(tmp_path):
    model_json = tmp_path / "toy.json"
    model_json.write_text(json.dumps(TINY_TOY_CLIP))
    weights = tmp_path / "w.safetensors"
    save_weights(build_toy_model(ToyBackboneConfig(model_config=str(model_json)))[0], weights)
    assert with_modality_gap(ToyBackboneConfig(model_config=str(model_json), modality_gap=0), weights) == (
        weights, model_json.resolve())
    cfg = ToyBackboneConfig(model_config=str(model_json), modality_gap=2.5)
    first = with_modality_gap(cfg, weights)
    assert first[0].name == "w-gap2.5.safetensors" and first[1].name == "w-gap2.5-model.json"
    stamp = first[0].stat().st_mtime_ns
    assert with_modality_gap(cfg, weights) == first and first[0].stat().st_mtime_ns == stamp


def test_gap_refuses_an_image_tower_it_cannot_extend():
    state = {"text_projection": torch.zeros(4, 3), "visual.attnpool.c_proj.weight": torch.zeros(3, 4)}
    with pytest.raises(ConfigError, match="backbone.modality_gap=0"):
        add_modality_gap(state, 1.0)


def test_gap_is_not_part_of_the_trained_weights_key():
    from toyworld.clip_cache import cache_key

    assert cache_key(ToyBackboneConfig(modality_gap=0)) == cache_key(ToyBackboneConfig(modality_gap=50))
