"""The tiny random LLaVA-NeXT folder (``data_gen/make_tiny_model.py``) is in the layout of the llava-hf
folders users download, so that one folder serves the transformers and the vLLM engine."""

from __future__ import annotations

import json

import pytest
import torch

from demind.cli.make_tiny_model import main as make_tiny_model_main


def llava_hf_weight_names(vision_layers: int, text_layers: int) -> set[str]:
    """The weight names of a llava-hf LLaVA-NeXT checkpoint (e.g. llava-hf/llava-v1.6-mistral-7b-hf's
    model.safetensors.index.json, written by transformers' convert_llava_next_weights_to_hf.py): a CLIP
    vision tower under ``vision_tower.vision_model.``, the Llama/Mistral text model under
    ``language_model.model.``, ``language_model.lm_head``, the projector and ``image_newline``."""
    vision = "vision_tower.vision_model."
    names = {f"{vision}embeddings.class_embedding", f"{vision}embeddings.patch_embedding.weight",
             f"{vision}embeddings.position_embedding.weight"}
    names |= {f"{vision}{norm}.{p}" for norm in ("pre_layrnorm", "post_layernorm") for p in ("weight", "bias")}
    for i in range(vision_layers):
        layer = f"{vision}encoder.layers.{i}."
        names |= {f"{layer}self_attn.{proj}.{p}" for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
                  for p in ("weight", "bias")}
        names |= {f"{layer}{part}.{p}" for part in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")
                  for p in ("weight", "bias")}
    names |= {f"multi_modal_projector.linear_{n}.{p}" for n in (1, 2) for p in ("weight", "bias")}
    names |= {"image_newline", "language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
              "language_model.model.norm.weight"}
    for i in range(text_layers):
        layer = f"language_model.model.layers.{i}."
        names |= {f"{layer}self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
        names |= {f"{layer}mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")}
        names |= {f"{layer}input_layernorm.weight", f"{layer}post_attention_layernorm.weight"}
    return names


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llava-next"
    assert make_tiny_model_main(["--output", str(folder)]) == 0
    return folder


def test_the_tiny_folder_has_llava_hf_weight_names_and_a_head_size_vllm_takes(tiny_folder):
    from safetensors import safe_open

    config = json.loads((tiny_folder / "config.json").read_text())
    with safe_open(str(tiny_folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == llava_hf_weight_names(config["vision_config"]["num_hidden_layers"],
                                          config["text_config"]["num_hidden_layers"])
    text = config["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] >= 32  # vLLM's CPU attention refuses head size 16
    assert config["model_type"] == "llava_next" and config["architectures"] == ["LlavaNextForConditionalGeneration"]


def test_the_transformers_engine_loads_every_weight_of_the_tiny_folder(tiny_folder):
    """Every tensor of the file lands in the model (none missing, none left over), value for value."""
    from safetensors import safe_open
    from transformers import LlavaNextForConditionalGeneration

    model, info = LlavaNextForConditionalGeneration.from_pretrained(tiny_folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with safe_open(str(tiny_folder / "model.safetensors"), "pt") as f:
        patch = f.get_tensor("vision_tower.vision_model.embeddings.patch_embedding.weight")
        q_proj = f.get_tensor("language_model.model.layers.0.self_attn.q_proj.weight")
        lm_head = f.get_tensor("language_model.lm_head.weight")
    assert torch.equal(model.model.vision_tower.embeddings.patch_embedding.weight, patch)
    assert torch.equal(model.model.language_model.layers[0].self_attn.q_proj.weight, q_proj)
    assert torch.equal(model.lm_head.weight, lm_head)
