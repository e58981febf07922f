"""A tiny random LLaVA-NeXT (model + processor) for CPU smoke runs, tests and benchmarks.

It has the real architecture and processing path (CLIP vision tower, any-resolution image grid,
Llama text model, chat template) at a size that runs in milliseconds; its text is random words.
About 70k parameters, ~14 image tokens per image. ``demind/cli/make_tiny_model.py`` saves it for
the smoke config ``configs/data_gen/tiny-cpu.yaml``; ``benchmarks/gpu_models.py`` reuses its
tokenizer and chat template at real vocabulary sizes.

The folder is in the layout of the llava-hf folders users download (:func:`to_llava_hf_layout`: the
vision tower's weights under ``vision_tower.vision_model.*``), so that one folder loads in both engines:
transformers and vLLM (whose CPU attention needs a head size of at least 32, hence the text model's 64 / 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_WORDS = (
    "a an the photo painting sketch cartoon rendering image of with and in on at by near under behind "
    "dog cat bird horse car bus boat tree flower house street beach mountain sky water grass road city "
    "man woman child people red blue green yellow black white brown small large old young bright dark "
    "make turn change add remove put it into night day sunny snowy foreground background style colour"
).split()
SPECIAL_TOKENS = ["<unk>", "<pad>", "<s>", "</s>", "<image>"]
ROLE_TOKENS = ["USER", "ASSISTANT", ":", ".", ",", '"', "?", "!"]

# Formats HF chat content lists ({"type": "image"} / {"type": "text"}) like the LLaVA-1.6 templates.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }} "
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image> {% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def word_level_tokenizer(vocab_size: int | None = None):
    """A word-level tokenizer over SPECIAL_TOKENS + ROLE_TOKENS + TINY_WORDS, padded with
    filler words ``w<i>`` up to ``vocab_size`` (a real model's vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + ROLE_TOKENS + list(dict.fromkeys(TINY_WORDS))
    if vocab_size is not None:
        words += [f"w{i}" for i in range(vocab_size - len(words))]
    vocab = {tok: i for i, tok in enumerate(words)}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<image>"],
        # as llava-hf's Llama tokenizers: no token_type_ids, which generate() rejects before transformers 5
        model_input_names=["input_ids", "attention_mask"],
    )


def build_tiny_llava_next(output_dir: str | Path, seed: int = 0, chat_template: str = TINY_CHAT_TEMPLATE) -> Path:
    """Build and save a random tiny LLaVA-NeXT and its processor (with ``chat_template``); returns ``output_dir``.

    Vision: CLIP, hidden 32, 2 layers, 16 px tiles of 8 px patches; grid pinpoints
    16x16, 16x32, 32x16. Text: Llama, hidden 64, 2 heads of 32, 1 layer, word-level vocabulary.
    """
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    output_dir = Path(output_dir)
    tokenizer = word_level_tokenizer()
    vocab = tokenizer.get_vocab()
    pinpoints = [[16, 16], [16, 32], [32, 16]]
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=8, projection_dim=32)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=1024,
                       bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"])
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=vocab["<image>"],
                             image_grid_pinpoints=pinpoints, vision_feature_layer=-1, image_seq_length=4)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    return save_llava_next(model, tokenizer, output_dir, tile=16, patch_size=8, pinpoints=pinpoints,
                           chat_template=chat_template)


def save_llava_next(model: Any, tokenizer: Any, output_dir: str | Path, *, tile: int, patch_size: int,
                    pinpoints: list[list[int]], chat_template: str = TINY_CHAT_TEMPLATE,
                    **image_processor_options: Any) -> Path:
    """Save a LLaVA-NeXT ``model`` with the processor a llava-hf folder holds (image processor for
    ``tile``-px tiles on ``pinpoints``, ``tokenizer``, ``chat_template``: by default
    :data:`TINY_CHAT_TEMPLATE`, or a llava-hf model's own); the model's generation config stops at
    and pads with the tokenizer's ``</s>`` / ``<pad>``. Returns ``output_dir``."""
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    vocab = tokenizer.get_vocab()
    model.generation_config.eos_token_id = vocab["</s>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                              image_grid_pinpoints=pinpoints, **image_processor_options)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                   vision_feature_select_strategy="default", chat_template=chat_template,
                                   num_additional_image_tokens=1)
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    to_llava_hf_layout(output_dir)
    return Path(output_dir)


# transformers 5 saves a CLIP vision tower without its ``vision_model.`` level; llava-hf checkpoints on
# the Hub (converted by transformers' convert_llava_next_weights_to_hf.py) and vLLM's loader keep it.
_SAVED_VISION, _HUB_VISION = "vision_tower.", "vision_tower.vision_model."


def to_llava_hf_layout(folder: str | Path) -> None:
    """Rename the weights of a saved LLaVA-NeXT ``folder`` to the names llava-hf folders use
    (``vision_tower.embeddings.*`` -> ``vision_tower.vision_model.embeddings.*``), in every safetensors
    file and in the shard index; names already in that layout are left as they are."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    rename = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            tensors = {hub_weight_name(k): f.get_tensor(k) for k in f.keys()}
            rename.update({k: hub_weight_name(k) for k in f.keys()})
        save_file(tensors, str(path), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"] = {rename.get(k, k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2), encoding="utf-8")


def hub_weight_name(name: str) -> str:
    """One saved weight name in llava-hf's layout (see :func:`to_llava_hf_layout`)."""
    if name.startswith(_SAVED_VISION) and not name.startswith(_HUB_VISION):
        return _HUB_VISION + name[len(_SAVED_VISION):]
    return name


