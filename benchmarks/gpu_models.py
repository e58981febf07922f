"""Random-weight models at the paper's real shapes, built from configs without any download.

Throughput does not depend on the weights once every output runs to its token limit (random
weights almost never sample the end-of-sequence token), so these stand in for the released
checkpoints in ``benchmarks/bench_gpu.py``:

* :func:`build_llava_next_mistral_7b` -- LLaVA-1.6 Mistral-7B: CLIP-L/336 vision tower
  (24 layers, width 1024, 14 px patches, penultimate-layer features), a 2-layer GELU
  projector, Mistral-7B text model (32 layers, width 4096, 32 heads / 8 KV heads, MLP 14,336,
  RoPE theta 1e6, no sliding window), any-resolution grid up to 672 px, 32,064-token
  vocabulary (a word-level tokenizer padded to that size: prompts cost about one token a
  word), saved with its processor so the project's engines load it like a hub checkpoint;
* :func:`build_clip` -- an open_clip model (ViT-L-14 for the paper) with ``pretrained=None``.

``tiny=True`` gives the same builders at test size (the tiny LLaVA-NeXT of the test suite,
the tiny CLIP config), so ``bench_gpu.py --tiny`` runs on a CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig
from demind.engines.tiny_llava import build_tiny_llava_next, save_llava_next, word_level_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY_CLIP = REPO / "configs/model/tiny-clip.json"
# llava-hf/llava-v1.6-mistral-7b-hf's config.json, written out (no download).
LLAVA_16_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAVA_16_VOCAB = 32064


def llava_next_mistral_7b_config(vocab: dict[str, int]):
    """The LlavaNextConfig of LLaVA-1.6 Mistral-7B, with ``vocab``'s special token ids."""
    from transformers import CLIPVisionConfig, LlavaNextConfig, MistralConfig

    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
    text = MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=LLAVA_16_VOCAB, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, sliding_window=None, rms_norm_eps=1e-5,
                         bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"])
    return LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=vocab["<image>"],
                           image_grid_pinpoints=LLAVA_16_PINPOINTS, vision_feature_layer=-2,
                           vision_feature_select_strategy="default", projector_hidden_act="gelu",
                           image_seq_length=576, tie_word_embeddings=False)


def build_llava_next_mistral_7b(output_dir: str | Path, device: str = "cuda", seed: int = 0) -> Path:
    """Build LLaVA-1.6 Mistral-7B with random bf16 weights directly on ``device`` and save it
    with its processor (about 15 GB, tens of seconds); returns ``output_dir``. Reuses a
    folder that already holds the model."""
    from transformers import LlavaNextForConditionalGeneration

    output_dir = Path(output_dir)
    if (output_dir / "config.json").is_file() and (output_dir / "preprocessor_config.json").is_file():
        return output_dir
    tokenizer = word_level_tokenizer(LLAVA_16_VOCAB)
    vocab = tokenizer.get_vocab()
    config = llava_next_mistral_7b_config(vocab)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the GPU: seconds, no 30 GB fp32 copy
    try:
        with torch.device(device):
            model = LlavaNextForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(previous)
    save_llava_next(model, tokenizer, output_dir, tile=336, patch_size=14, pinpoints=LLAVA_16_PINPOINTS,
                    image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return output_dir


def build_llava(output_dir: str | Path, tiny: bool, device: str) -> tuple[Path, float]:
    """(model folder, seconds to build and save): the 7B shapes, or the tests' tiny LLaVA-NeXT."""
    start = time.perf_counter()
    path = build_tiny_llava_next(output_dir) if tiny else build_llava_next_mistral_7b(output_dir, device)
    return Path(path), time.perf_counter() - start


def clip_config(tiny: bool, name: str = "ViT-L-14", precision: str = "fp32") -> BackboneConfig:
    """Random-init backbone config: ``name`` (ViT-L-14, the paper's) or the tiny test CLIP."""
    return BackboneConfig(name=str(TINY_CLIP) if tiny else name, pretrained=None, precision=precision)


def build_clip(tiny: bool, device: str, name: str = "ViT-L-14", precision: str = "fp32", seed: int = 0) -> FrozenCLIP:
    """A random-init FrozenCLIP on ``device`` (same seed, same weights for every precision)."""
    torch.manual_seed(seed)
    return FrozenCLIP(clip_config(tiny, name, precision), device=device)
