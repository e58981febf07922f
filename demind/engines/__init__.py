"""The MLLM engines behind one interface (:class:`~demind.engines.base.Engine`), and what every
user of an engine shares: the ``engine``/``sampling`` config sections (:mod:`.config`), where the
model is loaded from (:mod:`.model_ref`), chat rendering (:mod:`.chat`), the KV budget
(:mod:`.memory`) and tiny random models for smoke runs and tests (:mod:`.tiny_llava`).

Users: intent generation (:mod:`demind.gen`), the triplet job (:mod:`demind.gen.triplet_job`), the
describers and re-ranker (:mod:`demind.mllm`), the negation rewriter (:mod:`demind.negation.llm`).
"""

from __future__ import annotations

from demind.engines.base import Engine, GenRequest, GenResult, TokenScores, request_seed
from demind.engines.budget import check_prompt_fits
from demind.engines.chat import Conversation, assistant_turn, fill_prompt, render, user_turn
from demind.engines.config import EngineConfig, SamplingConfig
from demind.engines.memory import WavePlanner
from demind.engines.model_ref import (EngineModelError, check_engine_model, engine_load_error, load_processor,
                                      local_model_folder)
from demind.errors import DemindError, InputError

__all__ = ["Conversation", "Engine", "EngineConfig", "EngineModelError", "GenRequest", "GenResult", "SamplingConfig",
           "TokenScores", "WavePlanner", "assistant_turn", "build_engine", "check_engine_fits", "check_engine_model",
           "check_prompt_fits", "disable_loading_progress", "engine_load_error", "fill_prompt", "load_processor",
           "local_model_folder", "render", "request_seed", "user_turn"]


def build_engine(engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, *, device: str = "auto",
                 seed: int = 0) -> Engine:
    """Load the model named by ``engine_cfg`` on the chosen engine (vLLM is imported only here).

    ``device`` (``run.device``) places the transformers engine; ``seed`` (``run.seed``) seeds vLLM.
    An ``engine.model`` that cannot be loaded is one :class:`~demind.engines.model_ref.EngineModelError`
    naming it and the fix (checked before the engine's libraries are imported)."""
    if engine_cfg.name not in ("transformers", "vllm"):
        raise InputError(f"engine.name must be 'vllm' or 'transformers', got {engine_cfg.name!r}")
    check_engine_model(engine_cfg.model)
    # weights + KV cache + activations against the memory free now: one error line naming the setting, not an OOM kill
    check_engine_fits(engine_cfg, device)
    # what the model's files cause: OSError (not found, not fetched), and from transformers' Auto*
    # classes ValueError (unknown architecture, no processor); vLLM's ValueErrors are about memory and sizes
    file_errors = (OSError, ValueError) if engine_cfg.name == "transformers" else (OSError,)
    try:
        if engine_cfg.name == "transformers":
            from demind.engines.transformers_engine import TransformersEngine

            return TransformersEngine(engine_cfg, sampling_cfg, device=device)
        from demind.engines.vllm_engine import VLLMEngine

        return VLLMEngine(engine_cfg, sampling_cfg, seed=seed)
    except DemindError:
        raise
    except file_errors as e:
        raise engine_load_error(engine_cfg.model, engine_cfg.name, e) from e


def disable_loading_progress() -> None:
    """Hide the model-loading progress bars of transformers ("Loading weights") and huggingface_hub
    (downloads), for ``run.progress=false`` runs whose output goes to a log file."""
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()


def check_engine_fits(engine_cfg: EngineConfig, device: str = "auto") -> None:
    """Refuse, before loading, a model whose weights, KV cache and activations exceed the memory free now:
    one :class:`~demind.errors.DemindError` line naming the setting to change
    (:func:`demind.engines.memory.check_memory_before_loading`)."""
    from demind.engines.memory import check_memory_before_loading

    on_vllm_cpu = False
    if engine_cfg.name == "vllm":
        from demind.engines.vllm_engine import vllm_on_cpu

        on_vllm_cpu = vllm_on_cpu()
    check_memory_before_loading(engine_cfg, device, on_vllm_cpu)
