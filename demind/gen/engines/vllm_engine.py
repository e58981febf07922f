"""The ``vllm`` engine: offline ``LLM.generate`` over a whole chunk, continuous batching on GPU.

vLLM is an optional dependency, imported only when this engine is built. Request
building is split out (:func:`build_vllm_requests`) so it is testable without vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from demind.config import MissingDependencyError
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
    """vLLM ``RequestOutput`` list -> GenResult list (first completion of each)."""
    results = []
    for out in outputs:
        completion = out.outputs[0]
        results.append(
            GenResult(
                text=completion.text,
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                prompt_tokens=len(out.prompt_token_ids or []),
                output_tokens=len(completion.token_ids),
                # vLLM reports the prompt tokens its prefix cache served (None or absent without it)
                prefilled_tokens=len(out.prompt_token_ids or []) - int(getattr(out, "num_cached_tokens", 0) or 0),
            )
        )
    return results


class VLLMEngine:
    """vLLM offline engine; the whole list of requests goes in one ``generate`` call."""

    name = "vllm"

    def __init__(self, engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, seed: int = 0):
        vllm = import_vllm()
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
        logger.info("vllm engine: %s, tensor_parallel_size %d", self.model_id, engine_cfg.tensor_parallel_size)

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
