"""The ``vllm`` engine: offline ``LLM.generate`` over a wave of requests, continuous batching on GPU.

vLLM is an optional dependency, imported only when this engine is built. Request building, the
version check and the cache size are split out (:func:`build_vllm_requests`,
:func:`check_vllm_version`, :func:`vllm_cache_tokens`) so they are testable without vLLM.

Prefix caching: stage 2's prompt starts with stage 1's, so vLLM's automatic prefix caching serves
it from stage 1's KV blocks while they are still in its cache. The cache holds
``num_gpu_blocks x block_size`` tokens; :class:`demind.gen.memory.WavePlanner` runs a chunk in
waves that fit it (a 1,024-sample chunk of LLaVA-1.6 prompts is several times the cache of one
GPU, and stage 2 would find almost nothing). Multimodal prefix caching needs vLLM >= 0.8, where
cached blocks are keyed by the image as well as the tokens.
"""

from __future__ import annotations

import logging
from typing import Any

from packaging.version import Version

from demind.config import MissingDependencyError
from demind.errors import DemindError
from demind.gen.config import EngineConfig, SamplingConfig
from demind.gen.engines.base import GenRequest, GenResult

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "the vllm engine needs the optional vLLM package, which runs on NVIDIA GPUs: "
    "pip install 'demind[vllm]' (or pip install vllm); "
    "to run without it, use the transformers engine: engine.name=transformers"
)


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


def sampling_kwargs(request: GenRequest, sampling: SamplingConfig) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request (its own seed)."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": request.max_new_tokens,
        "seed": request.seed,
        "skip_special_tokens": True,
    }


def build_vllm_requests(
    requests: list[GenRequest], sampling: SamplingConfig
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Prompts for ``LLM.generate`` and the matching SamplingParams kwargs, in request order.

    Each prompt is ``{"prompt": str, "multi_modal_data": {"image": PIL.Image}}``; the prompt
    string keeps the chat template's ``<image>`` placeholder, which vLLM expands itself.
    A text-only request (image None) is ``{"prompt": str}``.
    """
    prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": r.image}} if r.image is not None
               else {"prompt": r.prompt} for r in requests]
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


class VLLMEngine:
    """vLLM offline engine; the whole list of requests goes in one ``generate`` call."""

    name = "vllm"

    def __init__(self, engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, seed: int = 0):
        vllm = import_vllm()
        check_vllm_version(vllm.__version__, engine_cfg.prefix_cache)
        from transformers import AutoProcessor

        self.model_id = engine_cfg.model
        self.sampling = sampling_cfg
        self._sampling_params_cls = vllm.SamplingParams
        # The HF processor only renders chat templates and counts tokens; vLLM does the rest.
        self.processor = AutoProcessor.from_pretrained(engine_cfg.model)
        self.llm = vllm.LLM(
            model=engine_cfg.model,
            dtype=engine_cfg.dtype,
            tensor_parallel_size=engine_cfg.tensor_parallel_size,
            max_model_len=engine_cfg.max_model_len,
            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
            enforce_eager=engine_cfg.enforce_eager,
            # stage 2 repeats stage 1's prompt (image + turn 1): its KV blocks are reused, not recomputed
            enable_prefix_caching=engine_cfg.prefix_cache,
            limit_mm_per_prompt={"image": 1},
            seed=seed,
        )
        # What the KV cache holds bounds a prefix wave (IntentGenerator); None: unknown, one wave per chunk.
        self.prefix_capacity_tokens = vllm_cache_tokens(self.llm) if engine_cfg.prefix_cache else None
        if engine_cfg.prefix_cache and self.prefix_capacity_tokens is None:
            logger.warning("this vLLM does not tell its KV cache size: each chunk (engine.chunk_size %d) runs as one "
                           "wave; if the shard stats show a low engine_tokens.stage2_hit_rate, lower engine.chunk_size",
                           engine_cfg.chunk_size)
        logger.info("vllm engine: %s, tensor_parallel_size %d, KV cache %s tokens", self.model_id,
                    engine_cfg.tensor_parallel_size,
                    f"{self.prefix_capacity_tokens:,}" if self.prefix_capacity_tokens else "(size unknown)")

    @property
    def renderer(self) -> Any:
        return self.processor

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.processor.tokenizer(texts, add_special_tokens=False).input_ids]

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        prompts, param_kwargs = build_vllm_requests(requests, self.sampling)
        params = [self._sampling_params_cls(**kw) for kw in param_kwargs]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return results_from_outputs(outputs)

    def release_prefixes(self) -> None:
        """vLLM's prefix cache evicts by itself."""
