"""The ``transformers`` engine: batched ``generate`` with left padding, CPU or GPU.

For small runs and tests. Per-request seeds are honoured inside a batch by
:class:`SeededRowSampler`, so a sample's text does not depend on its batch mates.

Prefix reuse: stage 2 continues stage 1's conversation, so its prompt starts with stage 1's
prompt token for token (image tokens and turn 1, most of the prompt). A ``keep_prefix``
request leaves its prompt's KV cache in :class:`PrefixStore`; a later request on the same
image whose prompt starts with those tokens prefills only the rest. Rows of a batch keep
their own prefix length, so the batch is laid out as [left padding, prefix | padding,
suffix]: positions come from the attention mask (padding takes none), so every row sees
the same positions and keys as in a full prefill; only float rounding of the shorter
matmuls differs. A batch reuses prefixes only when every row has one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache,
                          GenerationConfig, LogitsProcessor)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from demind.errors import InputError
from demind.engines.config import EngineConfig, SamplingConfig
from demind.engines.base import GenRequest, GenResult, resolve_max_model_len
from demind.engines.memory import free_memory_bytes, kv_bytes_per_token, prefix_store_budget
from demind.engines.model_ref import load_processor

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# transformers 5 renamed generate's ``past_key_values`` (argument and output field) to ``cache``; the old
# name warns there and goes in 6.0, the new one does not exist before 5.
CACHE_NAME = "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"


class SeededRowSampler(LogitsProcessor):
    """Sample each row with its own ``torch.Generator`` and hand the choice to greedy search.

    ``generate`` samples a batch from one global RNG, so a row's text would depend on the
    other rows. Here each row draws from its own generator (one draw per step), then all
    logits but the drawn token are set to -inf, and ``generate(do_sample=False)`` picks it.
    With temperature 0 the row takes the argmax. ``suppress_ids`` (e.g. the image token)
    can never be produced.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float, suppress_ids: list[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p
        self.suppress_ids = sorted(set(suppress_ids))

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (B, V) -> chosen token ids (B,)."""
        scores = scores.detach().float().cpu()
        if self.suppress_ids:
            scores[:, self.suppress_ids] = float("-inf")
        if self.temperature == 0:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.stack(
            [torch.multinomial(row, 1, generator=g)[0] for row, g in zip(probs, self.generators)]
        )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = self.choose(scores).to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(-1, chosen[:, None], 0.0)
        return forced


@dataclass
class Prefix:
    """One kept prompt: its token ids and per-layer (keys, values), each (heads, length, head_dim)."""

    image: Any  # held so that id(image) stays unique while the prefix is kept
    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


class PrefixStore:
    """Kept prompt KV caches by image object, oldest dropped beyond ``max_bytes`` (see demind/engines/memory.py)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.dropped = 0
        self._by_image: OrderedDict[int, Prefix] = OrderedDict()

    def put(self, prefix: Prefix) -> None:
        self._drop(self._by_image.pop(id(prefix.image), None), count=False)
        self._by_image[id(prefix.image)] = prefix
        self.bytes += prefix.nbytes
        while self.bytes > self.max_bytes and self._by_image:
            # a prefix larger than the whole budget is not kept either: the budget is what memory allows
            _, oldest = self._by_image.popitem(last=False)
            self._drop(oldest, count=True)

    def _drop(self, prefix: Prefix | None, count: bool) -> None:
        if prefix is None:
            return
        self.bytes -= prefix.nbytes
        if not count:
            return
        if self.dropped == 0:
            logger.warning("prefix store full (%.2f GiB): the oldest stage-1 prefixes are dropped and prefilled "
                           "again; raise engine.prefix_store_bytes or engine.prefix_store_fraction",
                           self.max_bytes / 1024**3)
        self.dropped += 1

    def match(self, image: Any, ids: list[int], forbidden: set[int]) -> Prefix | None:
        """The kept prefix of ``image`` if ``ids`` starts with it, leaves at least one token to
        compute and no ``forbidden`` token (image tokens need the pixels) in the rest."""
        prefix = self._by_image.get(id(image))
        n = len(prefix.ids) if prefix is not None else 0
        if prefix is None or n >= len(ids) or tuple(ids[:n]) != prefix.ids or forbidden.intersection(ids[n:]):
            return None
        return prefix

    def clear(self) -> None:
        self._by_image.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._by_image)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InputError(f"engine.dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


class TransformersEngine:
    """Hugging Face ``AutoModelForImageTextToText`` + its processor, batched with left padding; a text-only
    model (no vision config: the triplet job's instruction writer) is ``AutoModelForCausalLM`` + its tokenizer."""

    name = "transformers"

    def __init__(self, engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, device: str = "auto"):
        self.model_id = engine_cfg.model
        self.batch_size = engine_cfg.batch_size
        self.sampling = sampling_cfg
        if engine_cfg.cpu_threads > 0:
            # Small models on a shared CPU run far faster on one thread than with contended thread pools.
            torch.set_num_threads(engine_cfg.cpu_threads)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(engine_cfg.dtype, self.device)
        self.processor = load_processor(engine_cfg.model)  # a text-only model's: its tokenizer
        model_config = AutoConfig.from_pretrained(engine_cfg.model)
        self.takes_images = hasattr(model_config, "vision_config")
        # engine.max_model_len (0: the model's) bounds a sample's tokens for the first prefix wave
        self.max_model_len = resolve_max_model_len(engine_cfg.max_model_len, model_config, engine_cfg.model)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.tokenizer.padding_side = "left"  # decoder-only generation needs the prompt flush right
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        auto_model = AutoModelForImageTextToText if self.takes_images else AutoModelForCausalLM
        self.model = auto_model.from_pretrained(engine_cfg.model, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.eos_ids = self._eos_ids()
        image_token_id = getattr(self.processor, "image_token_id", None)
        self.suppress_ids = [image_token_id] if image_token_id is not None else []
        self.prefixes: PrefixStore | None = None
        self.prefix_capacity_tokens: int | None = None  # KV tokens the prefix store holds (IntentGenerator's waves)
        text_config = getattr(self.model.config, "text_config", self.model.config)
        if engine_cfg.prefix_cache and getattr(text_config, "sliding_window", None):
            # A sliding-window cache keeps only the last window of keys: a prompt's full prefix is not in it.
            logger.warning("engine.prefix_cache is off for %s: its text model uses a sliding window", self.model_id)
        elif engine_cfg.prefix_cache:
            per_token = kv_bytes_per_token(self.model.config, torch.finfo(self.dtype).bits // 8)
            budget = prefix_store_budget(engine_cfg.prefix_store_bytes, engine_cfg.prefix_store_fraction,
                                         None if engine_cfg.prefix_store_bytes else free_memory_bytes(self.device),
                                         per_token, device=str(self.device))
            self.prefixes = PrefixStore(budget.bytes)
            self.prefix_capacity_tokens = budget.tokens
            logger.info("%s", budget.describe())
        logger.info("transformers engine: %s on %s (%s), batch %d", self.model_id, self.device, self.dtype, self.batch_size)

    @property
    def renderer(self) -> Any:
        return self.processor

    def _eos_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        results: list[GenResult] = []
        for start in range(0, len(requests), self.batch_size):
            results.extend(self._generate_batch(requests[start : start + self.batch_size]))
        return results

    def release_prefixes(self) -> None:
        if self.prefixes is not None:
            self.prefixes.clear()

    @torch.inference_mode()
    def _generate_batch(self, batch: list[GenRequest]) -> list[GenResult]:
        if any(r.image is None for r in batch) and any(r.image is not None for r in batch):
            raise ValueError("a batch mixes text-only requests (image None) with image requests; send them apart")
        images = [image for r in batch for image in r.images]  # in placeholder order, row after row
        if not self.takes_images:
            if images:
                raise ValueError(f"{self.model_id} is a text-only model: it takes no images")
            inputs = self.tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        else:
            inputs = self.processor(images=images or None, text=[r.prompt for r in batch], return_tensors="pt",
                                    padding=True)
        mask = inputs["attention_mask"].bool()
        prompt_ids = [row[keep].tolist() for row, keep in zip(inputs["input_ids"], mask)]
        prefixes = self._matching_prefixes(batch, prompt_ids)
        keep = self.prefixes is not None and prefixes is None and any(r.keep_prefix for r in batch)
        sampler = SeededRowSampler([r.seed for r in batch], self.sampling.temperature, self.sampling.top_p, self.suppress_ids)
        config = GenerationConfig(
            max_new_tokens=max(r.max_new_tokens for r in batch),
            do_sample=False,  # sampling happens in SeededRowSampler, per row
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=sorted(self.eos_ids),
            return_dict_in_generate=keep,
        )
        if prefixes is None:
            # pixel values take the model's dtype; a tokenizer's encoding (text-only model) holds only ids
            model_inputs = inputs.to(self.device, dtype=self.dtype) if self.takes_images else inputs.to(self.device)
            prefilled = [len(ids) for ids in prompt_ids]
        else:
            model_inputs = self._continuation_inputs(prompt_ids, prefixes)
            prefilled = [len(ids) - len(p.ids) for ids, p in zip(prompt_ids, prefixes)]
        output = self.model.generate(**model_inputs, generation_config=config, logits_processor=[sampler])
        sequences = output.sequences if keep else output
        width = model_inputs["input_ids"].shape[1]
        if keep:
            self._keep_prefixes(batch, prompt_ids, getattr(output, CACHE_NAME), width)
        new_tokens = sequences[:, width:].cpu()
        return [
            self._result(row.tolist(), request.max_new_tokens, len(ids), n_prefilled)
            for row, request, ids, n_prefilled in zip(new_tokens, batch, prompt_ids, prefilled)
        ]

    def _matching_prefixes(self, batch: list[GenRequest], prompt_ids: list[list[int]]) -> list[Prefix] | None:
        """A kept prefix for every row, or None (the batch is prefilled in full)."""
        if self.prefixes is None or not len(self.prefixes):
            return None
        forbidden = set(self.suppress_ids)
        found = [self.prefixes.match(r.image, ids, forbidden) for r, ids in zip(batch, prompt_ids)]
        return found if all(p is not None for p in found) else None

    def _continuation_inputs(self, prompt_ids: list[list[int]], prefixes: list[Prefix]) -> dict[str, Any]:
        """input_ids / attention_mask laid out as [pad, prefix | pad, rest] and a DynamicCache
        holding each row's prefix keys and values right-aligned in the first block."""
        n_prefix = max(len(p.ids) for p in prefixes)
        n_rest = max(len(ids) - len(p.ids) for ids, p in zip(prompt_ids, prefixes))
        rows = len(prompt_ids)
        input_ids = torch.full((rows, n_prefix + n_rest), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, (ids, prefix) in enumerate(zip(prompt_ids, prefixes)):
            head, rest = ids[: len(prefix.ids)], ids[len(prefix.ids):]
            input_ids[i, n_prefix - len(head) : n_prefix] = torch.tensor(head)
            input_ids[i, n_prefix + n_rest - len(rest) :] = torch.tensor(rest)
            attention[i, n_prefix - len(head) : n_prefix] = 1
            attention[i, n_prefix + n_rest - len(rest) :] = 1
        layers = []
        for layer in range(len(prefixes[0].layers)):
            keys0, _ = prefixes[0].layers[layer]
            shape = (rows, keys0.shape[0], n_prefix, keys0.shape[2])
            keys = torch.zeros(shape, dtype=keys0.dtype, device=keys0.device)
            values = torch.zeros_like(keys)
            for i, prefix in enumerate(prefixes):
                k, v = prefix.layers[layer]
                keys[i, :, n_prefix - k.shape[1] :] = k
                values[i, :, n_prefix - v.shape[1] :] = v
            layers.append((keys, values))
        return {"input_ids": input_ids.to(self.device), "attention_mask": attention.to(self.device),
                CACHE_NAME: DynamicCache(ddp_cache_data=layers)}

    def _keep_prefixes(self, batch: list[GenRequest], prompt_ids: list[list[int]], cache: Any, width: int) -> None:
        """Keep the prompt part of ``keep_prefix`` rows' KV cache (their own tokens, no padding)."""
        for i, (request, ids) in enumerate(zip(batch, prompt_ids)):
            if not request.keep_prefix:
                continue
            layers = [(layer.keys[i, :, width - len(ids) : width].clone(), layer.values[i, :, width - len(ids) : width].clone())
                      for layer in cache.layers]
            self.prefixes.put(Prefix(request.image, tuple(ids), layers))

    def _result(self, token_ids: list[int], max_new_tokens: int, prompt_tokens: int, prefilled: int) -> GenResult:
        """Cut at the first EOS (rows that stopped early are padded) and at the row's own limit."""
        end = next((i for i, t in enumerate(token_ids) if t in self.eos_ids), None)
        if end is not None and end < max_new_tokens:
            kept, reason = token_ids[:end], "stop"
        else:
            kept, reason = token_ids[:max_new_tokens], "length"
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return GenResult(text=text, finish_reason=reason, prompt_tokens=prompt_tokens, output_tokens=len(kept),
                         prefilled_tokens=prefilled)
