"""A tiny random Qwen2-VL (model + processor), the multi-image family, for CPU smoke runs and tests.

Qwen2-VL is made for several images per prompt (each image its own ``<|vision_start|><|image_pad|>
<|vision_end|>`` span, M-RoPE positions per image), which a pair's relation description needs
(both images in one prompt). This builder has the real architecture and processing path (the
ViT with 2x2 patch merging, the Qwen2 text model with multimodal rotary positions, the dynamic
resolution image processor, Qwen2-VL's own chat template) at a size that runs in milliseconds:
16 image tokens per image at the processor's ``max_pixels`` of 112x112; its text is random words.

The folder is in the layout of the Qwen2-VL folders on the Hub (:func:`to_qwen2vl_hub_layout`:
``model.layers.*``, ``visual.*``, ``lm_head.*``; transformers 5 saves ``model.language_model.*`` and
``model.visual.*``), so that one folder loads in both engines: transformers and vLLM. Head sizes
are 32 (text) and 16x2 (vision), at least what vLLM's CPU attention takes for the text model.
"""

from __future__ import annotations

from pathlib import Path

from demind.engines.tiny_llava import TINY_WORDS

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
QWEN_WORDS = ["system", "user", "assistant", "You", "are", "helpful", "Picture", ":", ".", ",", '"', "?", "!",
              "[", "]", "{", "}", "0", "1", "2", "3"]

# Qwen2-VL-Instruct's chat template on the Hub (one image span per {"type": "image"} entry).
QWEN2VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer():
    """A word-level tokenizer with Qwen2-VL's special tokens (image pad, vision start/end, turns)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = QWEN_SPECIAL + ["<unk>"] + QWEN_WORDS + [w for w in dict.fromkeys(TINY_WORDS) if w not in QWEN_WORDS]
    vocab = {tok: i for i, tok in enumerate(words)}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # special tokens are split from the words around them (no space needed between "<|im_start|>" and "user")
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", pad_token="<|endoftext|>", eos_token="<|im_end|>",
        additional_special_tokens=QWEN_SPECIAL[1:], model_input_names=["input_ids", "attention_mask"])


def build_tiny_qwen2vl(output_dir: str | Path, seed: int = 0) -> Path:
    """Build and save a random tiny Qwen2-VL and its processor; returns ``output_dir``.

    Vision: 1 block, embed 32, 2 heads, 14 px patches merged 2x2; images at most 112x112 px (16
    tokens). Text: Qwen2, hidden 64, 2 heads of 32 (1 KV head), 1 layer, word-level vocabulary."""
    import torch
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    output_dir = Path(output_dir)
    tokenizer = qwen_tokenizer()
    vocab = tokenizer.get_vocab()
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=len(vocab), max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
                bos_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"],
                pad_token_id=vocab["<|endoftext|>"], tie_word_embeddings=False)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                           video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                           vision_end_token_id=vocab["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.generation_config.pad_token_id = vocab["<|endoftext|>"]
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                            merge_size=2, temporal_patch_size=2)
    video_processor = Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor, chat_template=QWEN2VL_CHAT_TEMPLATE)
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    to_qwen2vl_hub_layout(output_dir)
    return output_dir


_SAVED_TO_HUB = (("model.language_model.", "model."), ("model.visual.", "visual."))


def to_qwen2vl_hub_layout(folder: str | Path) -> None:
    """Rename a saved Qwen2-VL's weights to the names of the Hub's Qwen2-VL folders (see the module
    docstring), in every safetensors file and in the shard index; Hub names are left as they are."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    def hub(name: str) -> str:
        for saved, on_hub in _SAVED_TO_HUB:
            if name.startswith(saved):
                return on_hub + name[len(saved):]
        return name

    folder = Path(folder)
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            tensors = {hub(k): f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(path), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"] = {hub(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2), encoding="utf-8")
