"""How much stage-1 KV the generation engines can keep, and how many samples a prefix wave holds.

Stage 2 continues stage 1's conversation, so its prompt starts with stage 1's (image and turn 1,
most of the tokens). Reusing stage 1's keys and values saves that prefill, but only while they
are still held: in the transformers engine's prefix store, or in vLLM's paged KV cache. Both are
bounded in bytes, and a model's KV size per token differs by a factor of six across LLaVA-1.6:

    bytes per token = layers x 2 (keys, values) x KV heads x head dim x dtype bytes

Mistral-7B (32 layers, 8 KV heads of 128, bf16) keeps 128 KiB per token; Vicuna-7B (32 heads)
512 KiB; Vicuna-13B (40 layers, 40 heads) 800 KiB. A chunk's stage 1 is therefore run in *waves*
(:func:`prefix_wave_size`): stage 1 then stage 2 on as many samples as the store holds, so every
stage-2 prompt still finds its prefix.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from demind.errors import DemindError

logger = logging.getLogger(__name__)

GIB = 1024**3
# Share of the store a wave may plan to fill: vLLM rounds every sequence up to whole blocks, and a
# later image may have a few more tokens than the largest seen so far.
WAVE_HEADROOM = 0.1


def text_config(config: Any) -> Any:
    """The text model's config of a multimodal (LLaVA-NeXT) or a text-only HF config."""
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else getattr(config, "text_config", config)


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Bytes one token's keys and values take over every layer of ``config``'s text model.

    layers x 2 x ``num_key_value_heads`` (= attention heads without GQA) x head dim x ``dtype_bytes``;
    the head dim is the config's ``head_dim`` when it has one, else hidden size / attention heads."""
    text = text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


def free_memory_bytes(device: Any) -> int | None:
    """Free memory of ``device`` (a torch.device): ``torch.cuda.mem_get_info`` on a GPU, the host's
    available memory on a CPU; None where it cannot be told."""
    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            pass
        try:  # Linux without psutil: free pages (excludes reclaimable cache, so it errs low)
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


@dataclass(frozen=True)
class PrefixBudget:
    """The byte budget of kept stage-1 prefixes and the tokens of KV it holds."""

    bytes: int
    bytes_per_token: int
    source: str  # where the bytes come from, for the start-up line

    @property
    def tokens(self) -> int:
        return self.bytes // self.bytes_per_token

    def describe(self) -> str:
        size = f"{self.bytes / GIB:.2f} GiB" if self.bytes >= GIB else f"{self.bytes / 1024**2:.2f} MiB"
        return (f"prefix store: {size} ({self.source}) / {self.bytes_per_token / 1024:.1f} KiB "
                f"of KV per token = {self.tokens:,} tokens")


def prefix_store_budget(configured_bytes: int, fraction: float, free_bytes: int | None,
                        bytes_per_token: int, device: str = "the device") -> PrefixBudget:
    """``configured_bytes`` (``engine.prefix_store_bytes``) when set, else ``fraction``
    (``engine.prefix_store_fraction``) of ``free_bytes``, the memory free once the model is loaded;
    the rest stays for the running batch's own KV cache and activations."""
    if configured_bytes > 0:
        return PrefixBudget(configured_bytes, bytes_per_token, "engine.prefix_store_bytes")
    if free_bytes is None:
        raise DemindError(f"cannot tell how much memory {device} has free to size the stage-1 prefix store: "
                          "set engine.prefix_store_bytes (e.g. engine.prefix_store_bytes=8589934592 for 8 GiB) "
                          "or engine.prefix_cache=false")
    return PrefixBudget(int(free_bytes * fraction), bytes_per_token,
                        f"{fraction:g} of {free_bytes / GIB:.2f} GiB free on {device}")


def prefix_wave_size(n_samples: int, capacity_tokens: int | None, tokens_per_sample: int,
                     headroom: float = WAVE_HEADROOM) -> int:
    """Samples per wave (stage 1 then stage 2) so that every stage-1 prefix of a wave is still held
    when its stage-2 prompt comes: ``capacity_tokens`` x (1 - ``headroom``) / ``tokens_per_sample``,
    at least 1, at most ``n_samples``. ``capacity_tokens`` None: nothing bounds it (one wave)."""
    if capacity_tokens is None:
        return n_samples
    fit = int(capacity_tokens * (1 - headroom)) // max(tokens_per_sample, 1)
    return max(1, min(n_samples, fit))


class WavePlanner:
    """Wave sizes for one engine: starts from an upper bound of a sample's tokens (``engine.max_model_len``),
    then uses the largest stage-2 sequence (prompt + answer limit) seen, which is what a wave must hold."""

    def __init__(self, capacity_tokens: int | None, max_sample_tokens: int):
        self.capacity_tokens = capacity_tokens
        self.sample_tokens = max_sample_tokens
        self._seen = False
        self._told: set[str] = set()

    def size(self, n_samples: int) -> int:
        wave = prefix_wave_size(n_samples, self.capacity_tokens, self.sample_tokens)
        if wave < n_samples and self._seen and "waves" not in self._told:
            self._told.add("waves")
            logger.info("stage 1 and stage 2 run in waves of up to %d samples so that stage 2 finds stage 1's prefix: "
                        "the prefix cache holds %s tokens of KV, a sample takes up to %d", wave,
                        f"{self.capacity_tokens:,}", self.sample_tokens)
        return wave

    def observe(self, sample_tokens: list[int]) -> None:
        """Record the stage-2 sequence lengths (prompt + answer limit) of a finished wave."""
        if not sample_tokens:
            return
        largest = max(sample_tokens)
        self.sample_tokens = max(self.sample_tokens, largest) if self._seen else largest
        self._seen = True
        if (self.capacity_tokens is not None and prefix_wave_size(2, self.capacity_tokens, self.sample_tokens) < 2
                and "small" not in self._told):
            self._told.add("small")
            logger.warning("the prefix cache (%s tokens of KV) holds at most one sample (%d tokens): stage 1 and "
                           "stage 2 run one sample at a time; give it more memory (engine.prefix_store_bytes, "
                           "engine.prefix_store_fraction, vLLM's gpu_memory_utilization) or engine.prefix_cache=false",
                           f"{self.capacity_tokens:,}", self.sample_tokens)
