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


# ----------------------------------------------------------------------------- the memory guard
# Host memory an engine takes beyond weights, cache and activations: the Python processes with torch
# imported (vLLM runs two: the front end and its engine core) and the processor.
VLLM_CPU_BATCHED_TOKENS = 4096
# vLLM's CPU build with engine.kv_cache_gib 0: room for this many sequences of max_model_len tokens
CPU_KV_SEQUENCES = 64
RUNTIME_BYTES = {"vllm": int(1.5 * GIB), "transformers": int(0.75 * GIB)}


def cpu_kv_cache_bytes(kv_cache_gib: float, max_model_len: int, kv_bytes_per_token: int, available_bytes: int,
                       weight_bytes: int = 0) -> int:
    """KV cache bytes on vLLM's CPU build: ``kv_cache_gib`` when set, else room for
    :data:`CPU_KV_SEQUENCES` sequences of ``max_model_len`` tokens, at most a quarter of what
    ``available_bytes`` leaves once the model's ``weight_bytes`` are loaded (a quarter of the memory
    before loading would give a 7B's cache a quarter of its 14 GiB of weights too, which no host spares)."""
    if kv_cache_gib > 0:
        return int(kv_cache_gib * GIB)
    return max(min(CPU_KV_SEQUENCES * max_model_len * kv_bytes_per_token, max(available_bytes - weight_bytes, 0) // 4), 1)


def dtype_bytes(dtype: str, on_cpu: bool) -> int:
    """Bytes per weight of ``engine.dtype`` (``auto``: float32 on a CPU, bfloat16 on a GPU, as both engines read it)."""
    if dtype == "auto":
        return 4 if on_cpu else 2
    return 2 if dtype in ("bfloat16", "float16") else 4


def parameter_count(model_config: Any) -> int:
    """Parameters of the model ``model_config`` describes, counted on the meta device (nothing allocated)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM

    with init_empty_weights():
        try:
            model = AutoModelForImageTextToText.from_config(model_config)
        except ValueError:  # a text-only model
            model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class MemoryEstimate:
    """What an engine will take on its device, by part, and the setting that sizes each part."""

    weights: int
    kv_cache: int
    activations: int
    runtime: int
    kv_setting: str  # e.g. "engine.kv_cache_gib"
    activation_setting: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.runtime

    def describe(self) -> str:
        gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
        return (f"{gib(self.total)} (weights {gib(self.weights)} + KV cache {gib(self.kv_cache)} ({self.kv_setting}) + "
                f"activations {gib(self.activations)} ({self.activation_setting}) + runtime {gib(self.runtime)})")


def estimate_engine_memory(engine_cfg: Any, model_config: Any, *, on_cpu: bool, vllm_cpu: bool,
                           available: int, max_model_len: int, params: int | None = None) -> MemoryEstimate:
    """The memory ``engine_cfg`` asks for with the model of ``model_config``, before anything loads.

    weights = parameters x ``engine.dtype`` bytes. KV cache: on vLLM's CPU build the size the engine
    passes (``engine.kv_cache_gib``, or its default from ``available``); on the transformers engine the
    running batch's (``batch_size`` x ``max_model_len`` tokens) plus ``engine.prefix_store_bytes`` when
    set (a fraction of the free memory otherwise, which fits by construction). Activations: the widest
    tensors of one prefill (MLP in and out, attention projections) over the tokens it runs at once."""
    width = dtype_bytes(engine_cfg.dtype, on_cpu)
    weights = (params if params is not None else parameter_count(model_config)) * width
    per_token = kv_bytes_per_token(model_config, width)
    text = text_config(model_config)
    per_token_act = (2 * text.intermediate_size + 4 * text.hidden_size) * width
    if engine_cfg.name == "vllm":
        kv = (cpu_kv_cache_bytes(engine_cfg.kv_cache_gib, max_model_len, per_token, available, weights)  # as the engine
              if vllm_cpu else int(engine_cfg.kv_cache_gib * GIB))
        kv_setting = "engine.kv_cache_gib"
        # one scheduler step runs up to max_num_batched_tokens (what the vllm engine passes the CPU build:
        # 4096, or a whole prompt of max_model_len where that is more)
        activations = max(max_model_len, VLLM_CPU_BATCHED_TOKENS) * per_token_act
        act_setting = "engine.max_model_len"
    else:
        kv = engine_cfg.batch_size * max_model_len * per_token + engine_cfg.prefix_store_bytes
        kv_setting = "engine.batch_size x engine.max_model_len" + (
            " + engine.prefix_store_bytes" if engine_cfg.prefix_store_bytes else "")
        activations, act_setting = engine_cfg.batch_size * max_model_len * per_token_act, "engine.batch_size"
    return MemoryEstimate(weights, kv, activations, RUNTIME_BYTES.get(engine_cfg.name, 0), kv_setting, act_setting)


def memory_shortfall(estimate: MemoryEstimate, available: int, engine_cfg: Any, where: str) -> str | None:
    """None when ``estimate`` fits ``available``; else one line naming the setting to change."""
    if estimate.total <= available:
        return None
    short = estimate.total - available
    head = (f"engine.model={engine_cfg.model} on {where} needs about {estimate.describe()}, "
            f"but {available / GIB:.1f} GiB is available ({short / GIB:.1f} GiB short): ")
    if estimate.weights + estimate.runtime > available:
        fix = ("set engine.dtype=bfloat16 (half the weights)" if dtype_bytes(engine_cfg.dtype, True) == 4 and
               where == "cpu" else "the weights alone do not fit: free memory, or use a smaller engine.model")
    elif engine_cfg.name == "vllm" and estimate.kv_cache > short:
        fix = f"lower engine.kv_cache_gib to {max((estimate.kv_cache - short) / GIB * 0.9, 0.05):.2f} or less"
    elif engine_cfg.name != "vllm" and estimate.kv_cache + estimate.activations > short and engine_cfg.batch_size > 1:
        per_row = (estimate.kv_cache - engine_cfg.prefix_store_bytes + estimate.activations) / engine_cfg.batch_size
        fit = int((available - estimate.weights - estimate.runtime - engine_cfg.prefix_store_bytes) // per_row)
        one = estimate.weights + estimate.runtime + engine_cfg.prefix_store_bytes + per_row
        fix = (f"lower engine.batch_size to {fit}" if fit >= 1 else
               f"even engine.batch_size=1 needs about {one / GIB:.1f} GiB: free memory first"
               + (" or lower engine.prefix_store_bytes" if engine_cfg.prefix_store_bytes else ""))
    else:
        fix = "lower engine.max_model_len, or free memory"
    return head + fix


def check_engine_memory(engine_cfg: Any, model_config: Any, *, device: str, vllm_cpu: bool,
                        available: int | None = None, params: int | None = None) -> MemoryEstimate | None:
    """Refuse (DemindError, one line) an engine that will not fit the memory free on ``device`` now;
    returns the estimate, or None where it is not this process's to check (vLLM on a GPU sizes and
    checks its own cache by ``gpu_memory_utilization``) or the free memory cannot be told."""
    import torch

    from demind.engines.base import resolve_max_model_len

    on_cpu = vllm_cpu if engine_cfg.name == "vllm" else torch.device(device).type == "cpu"
    if engine_cfg.name == "vllm" and not vllm_cpu:
        return None
    if available is None:
        available = free_memory_bytes(torch.device("cpu" if on_cpu else device))
    if available is None:
        return None
    max_len = resolve_max_model_len(engine_cfg.max_model_len, model_config, engine_cfg.model)
    estimate = estimate_engine_memory(engine_cfg, model_config, on_cpu=on_cpu, vllm_cpu=vllm_cpu,
                                      available=available, max_model_len=max_len, params=params)
    problem = memory_shortfall(estimate, available, engine_cfg, "cpu" if on_cpu else device)
    if problem:
        raise DemindError(problem)
    logger.info("memory: %s of %.1f GiB available", estimate.describe(), available / GIB)
    return estimate


def check_memory_before_loading(engine_cfg: Any, device: str, vllm_cpu: bool) -> MemoryEstimate | None:
    """:func:`check_engine_memory` for ``engine_cfg``'s model, read from its config.json alone (a local
    folder or the Hub cache); None where that config cannot be read here (the engine says why when it loads).
    ``vllm_cpu``: the vllm engine is vLLM's CPU build (:func:`demind.engines.vllm_engine.vllm_on_cpu`)."""
    from transformers import AutoConfig

    from demind.settings import resolve_device

    try:
        model_config = AutoConfig.from_pretrained(engine_cfg.model)
    except (OSError, ValueError) as e:
        logger.info("memory check skipped: %s's config cannot be read here (%s)", engine_cfg.model, str(e).splitlines()[0])
        return None
    return check_engine_memory(engine_cfg, model_config, device=resolve_device(device),
                               vllm_cpu=engine_cfg.name == "vllm" and vllm_cpu)
