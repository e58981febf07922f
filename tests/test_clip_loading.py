"""Loading a real CLIP: each pretrained tag's own activation (QuickGELU for OpenAI's weights), the
activation in the backbone identity of checkpoints and feature caches, and text towers the
pseudo-word path cannot serve refused at load.

The tag tests run open_clip's own resolution of ``pretrained=TAG`` (pretrained config, download,
state-dict loading) with the download redirected to a file of random weights the test writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import open_clip
import open_clip.pretrained
import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from demind.backbone import BackboneWeightsError, FrozenCLIP, backbone_activation
from demind.schema import BackboneConfig, ModelConfig
from demind.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from demind.features import FeatureCacheError, check_identity
from demind.identity import identity_slug, same_backbone, tag_activation
from demind.model import DeMinds
from demind.text_tower import UnsupportedTextTowerError

from helpers import REPO_ROOT, TINY_CLIP

QUICK_TAG = "demind_test_quickgelu"  # a tag trained with QuickGELU on a GELU model config
GELU_TAG = "demind_test_gelu"


def tower_activations(module: nn.Module) -> set[str]:
    """Names of the activation modules (GELU / QuickGELU) inside ``module``."""
    return {type(m).__name__ for m in module.modules() if type(m).__name__ in ("GELU", "QuickGELU")}


def redirect_downloads(monkeypatch, weights: Path) -> list[str]:
    """open_clip's URL and Hugging Face downloads return ``weights``; returns the requests seen."""
    seen: list[str] = []

    def fake_download(source, *args, **kwargs):
        seen.append(str(source))
        return str(weights)

    monkeypatch.setattr(open_clip.pretrained, "download_pretrained_from_url", fake_download)
    monkeypatch.setattr(open_clip.pretrained, "download_pretrained_from_hf", fake_download)
    openai_module = getattr(open_clip, "openai", None)  # older releases load `openai` tags there
    if openai_module is not None and hasattr(openai_module, "download_pretrained_from_url"):
        monkeypatch.setattr(openai_module, "download_pretrained_from_url", fake_download)
    return seen


def random_weights(name: str, path: Path, quick_gelu: bool = False) -> Path:
    """A random state dict of ``name``'s exact shapes, saved as open_clip's downloads are (torch.save)."""
    model = open_clip.create_model(name, pretrained=None, force_quick_gelu=quick_gelu)
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture()
def tiny_tags(tmp_path, monkeypatch):
    """TINY_CLIP's config with two pretrained tags of its own in open_clip's registry: one whose
    weights were trained with QuickGELU (marked as open_clip marks ``openai``), one with GELU."""
    name = str(TINY_CLIP)
    open_clip.add_model_config(TINY_CLIP)
    entry = {"url": "https://example.invalid/tiny.pt", "hf_hub": "", "mean": (0.5,) * 3, "std": (0.5,) * 3}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, TINY_CLIP.stem,
                        {QUICK_TAG: {**entry, "quick_gelu": True}, GELU_TAG: {**entry, "quick_gelu": False}})
    weights = random_weights(TINY_CLIP.stem, tmp_path / "tiny.pt")
    return name, redirect_downloads(monkeypatch, weights), weights


def test_a_quickgelu_tag_loads_with_quickgelu_in_both_towers(tiny_tags, recwarn):
    name, seen, weights = tiny_tags
    backbone = FrozenCLIP(BackboneConfig(name=name, pretrained=QUICK_TAG))
    assert seen, "open_clip's download function was not called: the tag was not resolved by open_clip"
    assert tower_activations(backbone.model.visual) == {"QuickGELU"}
    assert tower_activations(backbone.model.transformer) == {"QuickGELU"}
    assert backbone.identity["activation"] == "quick_gelu"
    assert not [w for w in recwarn if "QuickGELU mismatch" in str(w.message)]
    # the weights in the file are the ones loaded (open_clip's tag path, strict)
    expected = torch.load(weights, weights_only=True)
    assert torch.equal(backbone.model.token_embedding.weight, expected["token_embedding.weight"])


def test_every_entry_point_gets_the_tags_activation(tiny_tags):
    """Features and training (build_backbone), evaluation and search (load_backbone_and_model with a
    NAME:TAG spec) and the generation-time fidelity stage all build the backbone the same way."""
    from demind.backbone import build_backbone
    from demind.checkpoint import load_backbone_and_model
    from demind.gen.config import QualityConfig
    from demind.gen.fidelity_stage import FidelityScorer

    name = tiny_tags[0]
    built = [
        build_backbone(BackboneConfig(name=name, pretrained=QUICK_TAG)),
        load_backbone_and_model(None, f"{name}:{QUICK_TAG}")[0],
        FidelityScorer.from_config(QualityConfig(fidelity_clip=name, fidelity_pretrained=QUICK_TAG)).backbone,
    ]
    for backbone in built:
        assert tower_activations(backbone.model.visual) == tower_activations(backbone.model.transformer) == {"QuickGELU"}


def test_a_gelu_tag_and_random_init_keep_gelu(tiny_tags):
    name = tiny_tags[0]
    for pretrained in (GELU_TAG, None):
        backbone = FrozenCLIP(BackboneConfig(name=name, pretrained=pretrained))
        assert tower_activations(backbone.model.visual) == {"GELU"}
        assert tower_activations(backbone.model.transformer) == {"GELU"}
        assert backbone.identity["activation"] == "gelu"


@pytest.mark.slow
def test_vit_b_32_openai_loads_with_quickgelu_through_open_clips_tag(tmp_path, monkeypatch):
    """The real tag: ``ViT-B-32`` + ``openai`` (GELU model config, QuickGELU weights)."""
    seen = redirect_downloads(monkeypatch, random_weights("ViT-B-32", tmp_path / "open_clip_model.bin"))
    backbone = FrozenCLIP(BackboneConfig(name="ViT-B-32", pretrained="openai"))
    assert seen
    assert tower_activations(backbone.model.visual) == {"QuickGELU"}
    assert tower_activations(backbone.model.transformer) == {"QuickGELU"}
    assert backbone.identity == {"name": "ViT-B-32", "pretrained": "openai", "activation": "quick_gelu"}


class _Built(Exception):
    """Raised by the stand-in for open_clip's builder once it has seen its arguments."""


def test_vit_l_14_openai_asks_open_clip_for_quickgelu(monkeypatch):
    """The paper's backbone, ``ViT-L-14`` + ``openai``, as FrozenCLIP asks open_clip to build it: with
    force_quick_gelu (open_clip's own ViT-L-14 config is GELU). The builder is stopped before any
    weights are made, so this runs in CI; the slow test above builds a whole tagged model."""
    calls: list[dict] = []

    def record(model_name, **kwargs):
        calls.append({"model_name": model_name, **kwargs})
        raise _Built

    monkeypatch.setattr(open_clip, "create_model_and_transforms", record)
    monkeypatch.setattr("demind.backbone.weights_out_of_reach", lambda cfg, name: None)  # offline CI: ask anyway
    assert open_clip.get_model_config("ViT-L-14").get("quick_gelu", False) is False
    for name in ("ViT-L-14", "ViT-B-32"):
        with pytest.raises(_Built):
            FrozenCLIP(BackboneConfig(name=name, pretrained="openai"))
    with pytest.raises(_Built):
        FrozenCLIP(BackboneConfig(name="ViT-L-14", pretrained="laion2b_s32b_b82k"))
    assert [(c["model_name"], c["pretrained"], c["force_quick_gelu"]) for c in calls] == [
        ("ViT-L-14", "openai", True), ("ViT-B-32", "openai", True), ("ViT-L-14", "laion2b_s32b_b82k", False)]


def test_every_quickgelu_tag_open_clip_marks_follows_its_tag():
    # marked by open_clip >= 2.29; before that, the tags listed under the model's -quickgelu name
    marked = [(m, t) for m, t in open_clip.list_pretrained()
              if open_clip.get_pretrained_cfg(m, t).get("quick_gelu") and not m.endswith("-quickgelu")]
    marked = marked or [(m.removesuffix("-quickgelu"), t) for m, t in open_clip.list_pretrained()
                        if m.endswith("-quickgelu") and open_clip.is_pretrained_cfg(m.removesuffix("-quickgelu"), t)]
    assert marked
    for model_name, tag in marked + [("ViT-L-14", "openai"), ("ViT-B-32", "openai")]:
        assert backbone_activation(model_name, open_clip.get_model_config(model_name), tag) == "quick_gelu", (model_name, tag)
    assert tag_activation("ViT-B-32", "laion2b_s34b_b79k") == "gelu"
    assert tag_activation("ViT-B-32", None) is None


def test_the_paper_recipe_backbone_is_quickgelu():
    import yaml

    recipe = yaml.safe_load((REPO_ROOT / "configs" / "train" / "paper.yaml").read_text())["backbone"]
    name, tag = recipe.get("name", "ViT-L-14"), recipe.get("pretrained", "openai")
    assert backbone_activation(name, open_clip.get_model_config(name), tag) == "quick_gelu"


# ----------------------------------------------------------- identity: checkpoints and caches
def test_a_checkpoint_of_the_other_activation_is_refused_naming_both(tiny_backbone, tmp_path):
    path = save_checkpoint(tmp_path / "model.safetensors", DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4), tiny_backbone))
    load_checkpoint(path, tiny_backbone)  # its own activation loads
    identity = dict(tiny_backbone.identity, activation="quick_gelu")
    state = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
    metadata["backbone_identity"] = json.dumps(identity)
    save_file(state, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"activation quick_gelu != gelu"):
        load_checkpoint(path, tiny_backbone)


def test_a_feature_cache_of_the_other_activation_is_refused_and_old_records_read_as_the_tags(tmp_path, caplog):
    from demind.identity import _warn_if_ambiguous

    _warn_if_ambiguous.cache_clear()
    current = {"name": "ViT-L-14", "pretrained": "openai", "activation": "quick_gelu"}
    with pytest.raises(FeatureCacheError, match=r"activation gelu != quick_gelu"):
        check_identity({"backbone": dict(current, activation="gelu")}, current, tmp_path / "0.json")
    # written before the activation was recorded: the tag's own activation, same cache folder name,
    # with one warning, since such a record may have run GELU (ViT-L-14's own config) on open_clip >= 2.29
    old = {"name": "ViT-L-14", "pretrained": "openai"}
    with caplog.at_level("WARNING", logger="demind.identity"):
        check_identity({"backbone": old}, current, tmp_path / "0.json")
        assert identity_slug(old) == identity_slug(current)
        assert same_backbone({"name": "ViT-B-32", "pretrained": "laion2b_s34b_b79k"},
                             {"name": "ViT-B-32", "pretrained": "laion2b_s34b_b79k", "activation": "gelu"})
    warnings = [r.getMessage() for r in caplog.records if r.name == "demind.identity"]
    assert len(warnings) == 1 and "ViT-L-14:openai records no activation" in warnings[0]  # once, not for the GELU tag


# ----------------------------------------------------------------- unsupported text towers
TINY_VISION = {"image_size": 32, "layers": 1, "width": 32, "head_width": 8, "patch_size": 8}
TINY_TEXT = {"context_length": 32, "vocab_size": 1000, "width": 32, "heads": 4, "layers": 1}


@pytest.mark.parametrize("text_cfg, reason", [
    # CLIPA: BERT's tokenizer, last-token pooling, no causal mask
    ({"hf_tokenizer_name": "bert-base-uncased", "pool_type": "last", "no_causal_mask": True},
     "Hugging Face tokenizer bert-base-uncased"),
    # MetaCLIP-2 worldwide: an XLM-V tokenizer, pooled at its own eos id
    ({"hf_tokenizer_name": "facebook/xlm-v-base", "pool_type": "eos", "eos_id": 2},
     "Hugging Face tokenizer facebook/xlm-v-base"),
    ({"pool_type": "last"}, "pool_type 'last'"),
    ({"no_causal_mask": True}, "no causal mask"),
    ({"hf_model_name": "roberta-base", "hf_tokenizer_name": "roberta-base"}, "not CLIP's text transformer"),
])
def test_unsupported_text_towers_are_refused_at_load_naming_model_and_reason(tmp_path, text_cfg, reason):
    config = tmp_path / "odd-text-tower.json"
    config.write_text(json.dumps({"embed_dim": 32, "vision_cfg": TINY_VISION, "text_cfg": {**TINY_TEXT, **text_cfg}}))
    with pytest.raises(UnsupportedTextTowerError) as info:
        FrozenCLIP(BackboneConfig(name=str(config), pretrained=None))
    message = str(info.value)
    assert str(config) in message and reason in message and "argmax" in message and "\n" not in message


@pytest.mark.parametrize("name", ["ViT-L-14-CLIPA", "ViT-H-14-worldwide", "ViT-B-16-SigLIP"])
def test_real_unsupported_models_are_refused_before_any_download(name, monkeypatch):
    if name not in open_clip.list_models():
        pytest.skip(f"this open_clip has no {name}")
    monkeypatch.setattr(open_clip, "create_model_and_transforms",
                        lambda *a, **k: pytest.fail("a refused model was built"))
    with pytest.raises(UnsupportedTextTowerError, match=name):
        FrozenCLIP(BackboneConfig(name=name, pretrained=None))


def test_weights_that_cannot_be_downloaded_are_one_error_naming_the_backbone(tiny_tags, monkeypatch):
    """No network: open_clip's own download raises; the load names the backbone, tag and the fix."""
    name, _, _ = tiny_tags

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(open_clip.pretrained, "download_pretrained_from_url", offline)
    with pytest.raises(BackboneWeightsError, match=rf"backbone .*{QUICK_TAG}: Failed to download weights.*HF_HUB_OFFLINE"):
        FrozenCLIP(BackboneConfig(name=name, pretrained=QUICK_TAG))
    with pytest.raises(BackboneWeightsError, match=r"not a known tag"):
        FrozenCLIP(BackboneConfig(name=name, pretrained="no_such_tag"))
