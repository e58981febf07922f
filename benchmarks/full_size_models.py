"""Random-weight model folders with the exact files of the paper's models, written without a download.

* :func:`write_llava_mistral_7b` -- a folder laid out as ``llava-hf/llava-v1.6-mistral-7b-hf`` is
  served: ``config.json``, ``generation_config.json``, ``preprocessor_config.json``,
  ``processor_config.json``, ``chat_template.json``, the tokenizer files, and the weights as bf16
  safetensors shards under the Hub's names (``language_model.model.*``, ``vision_tower.vision_model.*``,
  ``multi_modal_projector.*``, ``image_newline``) with ``model.safetensors.index.json``. The weights are
  random and streamed to disk one tensor at a time (the model is never held in memory: peak about the
  largest tensor, 263 MB). ``layers``/``small=True`` keep every processor and config value but shrink
  the layers (a mid-size model for tests: the real image grid, 336 px tiles and 32,064 tokens).
* :func:`write_vit_l14` -- open_clip ``ViT-L-14`` with ``pretrained`` unset, its state dict as one
  safetensors file, the form ``backbone.pretrained: PATH`` loads.

Where each value comes from is said beside it. The Hub files are written out from the published
``llava-hf/llava-v1.6-mistral-7b-hf`` repository (config revision of transformers 4.39, processor
files as updated for transformers 4.45+'s ``num_additional_image_tokens``); what they leave out is the
default of transformers' ``MistralConfig`` / ``CLIPVisionConfig`` (hidden size 4096, 32 layers, 32 heads,
SiLU; CLIP ``quick_gelu``, LayerNorm eps 1e-5), which is also what the model was trained with.

The tokenizer: the real one is Mistral-7B's SentencePiece model (32,000 pieces, byte fallback) plus
``<image>`` (32000) and ``<pad>`` (32001); the embedding has 32,064 rows. The SentencePiece file ships
inside the ``mistral_common`` package (``mistral_common/data/tokenizer.model.v1``, the v0.1/v0.2
tokenizer) and is converted here with protobuf alone. Without it, :func:`stand_in_tokenizer` builds a
word-level tokenizer of the same size with the special tokens at their real ids -- not the real vocabulary
(prompts then cost about one token a word instead of ~1.3), which the folder's ``TOKENIZER.txt`` says.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any, Iterator

import torch

HUB_ID = "llava-hf/llava-v1.6-mistral-7b-hf"
VOCAB = 32064  # config.json "vocab_size" (32,000 SentencePiece pieces + added tokens, padded to a multiple of 64)
IMAGE_TOKEN_ID, PAD_TOKEN_ID = 32000, 32001  # tokenizer_config.json "added_tokens_decoder"
PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # config.json "image_grid_pinpoints"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # preprocessor_config.json: OpenAI CLIP's normalisation
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
SHARD_BYTES = 5_000_000_000  # save_pretrained's max_shard_size "5GB" (transformers 4.39): four shards, as on the Hub

# llava-hf/llava-v1.6-mistral-7b-hf config.json, as served (keys as in the file).
CONFIG_7B: dict[str, Any] = {
    "architectures": ["LlavaNextForConditionalGeneration"],
    "ignore_index": -100,
    "image_grid_pinpoints": PINPOINTS,
    "image_token_index": IMAGE_TOKEN_ID,
    "model_type": "llava_next",
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2",
        "architectures": ["MistralForCausalLM"],
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB,
    },
    "torch_dtype": "float16",
    "transformers_version": "4.39.0.dev0",
    "use_image_newline_parameter": True,
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": VOCAB,
}
# The small layers of the mid-size variant (head size 32: vLLM's CPU attention needs at least 32).
SMALL_TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}
SMALL_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 2,
                "projection_dim": 64}

GENERATION_CONFIG = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD_TOKEN_ID,
                     "transformers_version": "4.39.0.dev0"}
PREPROCESSOR_CONFIG = {
    "aspect_ratio_setting": "anyres",
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_grid_pinpoints": PINPOINTS,
    "image_mean": CLIP_MEAN,
    "image_processor_type": "LlavaNextImageProcessor",
    "image_std": CLIP_STD,
    "processor_class": "LlavaNextProcessor",
    "resample": 3,  # bicubic
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
# processor_config.json: the image-token count rule (576 base tokens: 577 patches less CLS)
PROCESSOR_CONFIG = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                    "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"}
# chat_template.json, current revision (the earlier one wrote '<\\s> ' for '</s> ', see demind.engines.chat)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'][0]['text'] "
    "+ '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' }}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'][0]['text'] + '</s> '}}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# tokenizer_config.json values of the llava-hf folder (a LlamaTokenizer over Mistral's SentencePiece model)
TOKENIZER_OPTIONS = {"add_bos_token": True, "add_eos_token": False, "padding_side": "left", "legacy": True,
                     "model_max_length": 1000000000000000019884624838656}


# ----------------------------------------------------------------------------- tokenizer
def mistral_sentencepiece_file() -> Path | None:
    """Mistral-7B's SentencePiece model as the ``mistral_common`` package ships it, or None."""
    try:
        import importlib.resources as resources

        path = Path(str(resources.files("mistral_common") / "data" / "tokenizer.model.v1"))
    except (ImportError, ModuleNotFoundError, TypeError):
        return None
    return path if path.is_file() else None


def sentencepiece_bpe(model_file: str | Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a SentencePiece BPE model, read with protobuf alone (no sentencepiece):
    a merge ``a b`` for every piece that splits into two pieces, ranked by the merged piece's id
    (SentencePiece's BPE applies higher-scored, lower-id pieces first), as transformers' converter does."""
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    if proto.trainer_spec.model_type != 2:
        raise ValueError(f"{model_file} is not a SentencePiece BPE model")
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    merges = []
    for piece, rank in vocab.items():
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        for a, b in pairs:
            if a in vocab and b in vocab:
                merges.append((rank, vocab[a], vocab[b], a, b))
    merges.sort()
    return vocab, [(a, b) for *_ranks, a, b in merges]


def mistral_tokenizer(model_file: str | Path):
    """The llava-hf tokenizer: Mistral's SentencePiece BPE (byte fallback) + ``<image>`` 32000, ``<pad>`` 32001."""
    from transformers import LlamaTokenizer

    vocab, merges = sentencepiece_bpe(model_file)
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, legacy=True, add_prefix_space=None, add_bos_token=True,
                               add_eos_token=False, padding_side="left", model_input_names=["input_ids", "attention_mask"])
    # as transformers' convert_llava_next_weights_to_hf.py: <image> first (32000), then <pad> (32001)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    added = tokenizer.convert_tokens_to_ids(["<image>", "<pad>"])
    if added != [IMAGE_TOKEN_ID, PAD_TOKEN_ID]:
        raise ValueError(f"{model_file}: <image>, <pad> got ids {added}, expected {IMAGE_TOKEN_ID}, {PAD_TOKEN_ID}")
    return tokenizer


def stand_in_tokenizer():
    """A word-level tokenizer of 32,064 tokens with <unk> 0, <s> 1, </s> 2, <image> 32000, <pad> 32001,
    the chat template's ``[INST]``/``[/INST]`` as words -- the real ids, not the real vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from demind.engines.tiny_llava import ROLE_TOKENS, TINY_WORDS

    words = ["<unk>", "<s>", "</s>"] + ["[INST]", "[/INST]"] + ROLE_TOKENS + list(dict.fromkeys(TINY_WORDS))
    words += [f"w{i}" for i in range(IMAGE_TOKEN_ID - len(words))] + ["<image>", "<pad>"]
    words += [f"x{i}" for i in range(VOCAB - len(words))]
    word_level = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=["<image>"], padding_side="left",
                                   model_input_names=["input_ids", "attention_mask"])


def llava_tokenizer(sentencepiece: str | Path | None = None) -> tuple[Any, str, Path | None]:
    """(tokenizer, what it is, its SentencePiece file): the real one from ``sentencepiece`` or
    mistral_common's file, else the stand-in (no file)."""
    model_file = Path(sentencepiece) if sentencepiece else mistral_sentencepiece_file()
    if model_file is not None and model_file.is_file():
        return mistral_tokenizer(model_file), f"Mistral-7B's SentencePiece vocabulary ({model_file.name})", model_file
    return stand_in_tokenizer(), ("a STAND-IN word-level tokenizer of 32,064 tokens with the real special-token ids "
                                  "(not the real vocabulary: install mistral_common or pass its tokenizer.model.v1)"), None


# ----------------------------------------------------------------------------- weights
def hub_name(name: str) -> str:
    """A transformers-5 LlavaNext state-dict name -> its name in llava-hf's safetensors files."""
    for ours, hubs in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                       ("model.vision_tower.", "vision_tower.vision_model."),
                       ("model.multi_modal_projector.", "multi_modal_projector."), ("model.image_newline", "image_newline")):
        if name.startswith(ours):
            return hubs + name[len(ours):]
    raise ValueError(f"no llava-hf name for weight {name}")


def weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(llava-hf name, shape) of every weight of ``config``'s LlavaNext, from a model built on the meta device."""
    from accelerate import init_empty_weights
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    with init_empty_weights():
        model = LlavaNextForConditionalGeneration(LlavaNextConfig.from_dict(config))
    return [(hub_name(k), tuple(v.shape)) for k, v in model.state_dict().items()]


def random_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """bf16 weight: norms 1, biases 0, everything else N(0, 0.02) (transformers' initializer_range),
    from a generator seeded by (seed, name): the same folder on every machine."""
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    parts = name.split(".")
    if len(parts) > 1 and "norm" in parts[-2] and parts[-1] == "weight":
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little"))
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def shard_plan(shapes: list[tuple[str, tuple[int, ...]]], max_bytes: int = SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Weights in order, cut into shards of at most ``max_bytes`` (bf16), as save_pretrained cuts them."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_safetensors_streamed(path: Path, tensors: list[tuple[str, tuple[int, ...]]],
                               make: Any) -> int:
    """Write a safetensors file of bf16 ``tensors`` (name, shape), each made by ``make(name, shape)``
    only when its bytes are written: memory holds one tensor. Returns the bytes of tensor data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in tensors:
            f.write(make(name, shape).contiguous().view(torch.int16).numpy().tobytes())
    tmp.replace(path)
    return offset


# ----------------------------------------------------------------------------- folders
def llava_config(small: bool = False) -> dict[str, Any]:
    """config.json of the 7B; ``small``: the same file with :data:`SMALL_TEXT` / :data:`SMALL_VISION` layers."""
    config = json.loads(json.dumps(CONFIG_7B))
    if small:
        config["text_config"].update(SMALL_TEXT)
        config["vision_config"].update(SMALL_VISION)
    return config


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_llava_mistral_7b(folder: str | Path, *, small: bool = False, sentencepiece: str | Path | None = None,
                           seed: int = 0, log: Any = print) -> Path:
    """Write the llava-hf folder (see the module docstring) into ``folder``; returns it. The index is
    written last: a folder with ``model.safetensors.index.json`` is complete and is reused as it is."""
    folder = Path(folder)
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        log(f"{folder}: complete (model.safetensors.index.json), reused")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = llava_config(small)
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", GENERATION_CONFIG)
    write_json(folder / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(folder / "processor_config.json", PROCESSOR_CONFIG)
    write_json(folder / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    tokenizer, what, model_file = llava_tokenizer(sentencepiece)
    tokenizer.save_pretrained(folder)
    if model_file is not None:  # the Hub folder carries the SentencePiece file beside tokenizer.json
        shutil.copyfile(model_file, folder / "tokenizer.model")
    tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_config.update(TOKENIZER_OPTIONS, processor_class="LlavaNextProcessor",
                      tokenizer_class="LlamaTokenizer" if model_file is not None else tok_config.get("tokenizer_class"))
    tok_config.pop("chat_template", None)  # chat_template.json holds it, as on the Hub
    write_json(folder / "tokenizer_config.json", tok_config)
    (folder / "README.md").write_text(
        f"Random weights with the files of {HUB_ID}{' (SMALL layers: a test model)' if small else ''}.\n"
        f"Tokenizer: {what}.\nWritten by scripts/make_full_size_models.py; nothing here was downloaded.\n",
        encoding="utf-8")
    shards = shard_plan(weight_shapes(config))
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        if (folder / name).is_file():  # renamed into place only once whole: a killed run resumes at its shard
            total += sum(iter_weight_bytes(tensors))
        else:
            total += write_safetensors_streamed(folder / name, tensors, lambda n, s: random_weight(n, s, seed))
        weight_map.update({t: name for t, _ in tensors})
        log(f"{folder / name}: {len(tensors)} tensors, {total / 1e9:.2f} GB so far")
    write_json(index_path, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return folder


def write_vit_l14(path: str | Path, name: str = "ViT-L-14", seed: int = 0) -> Path:
    """open_clip ``name`` with ``pretrained`` unset (seeded random init), its fp32 state dict saved as
    one safetensors file at ``path`` (what ``backbone.pretrained: PATH`` loads); reused when present."""
    import open_clip
    from safetensors.torch import save_file

    path = Path(path)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = open_clip.create_model(name, pretrained=None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "open_clip_model": name})
    tmp.replace(path)
    return path


def iter_weight_bytes(shapes: list[tuple[str, tuple[int, ...]]]) -> Iterator[int]:
    for _name, shape in shapes:
        yield 2 * _numel(shape)
