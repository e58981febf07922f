"""Generation engines behind one interface (:class:`~demind.gen.engines.base.Engine`)."""

from __future__ import annotations

from demind.gen.config import EngineConfig, SamplingConfig
from demind.gen.engines.base import Engine, GenRequest, GenResult, request_seed

__all__ = ["Engine", "GenRequest", "GenResult", "build_engine", "request_seed"]


def build_engine(engine_cfg: EngineConfig, sampling_cfg: SamplingConfig) -> Engine:
    """Load the model named by ``engine_cfg`` on the chosen engine (vLLM is imported only here)."""
    if engine_cfg.name == "transformers":
        from demind.gen.engines.transformers_engine import TransformersEngine

        return TransformersEngine(engine_cfg, sampling_cfg)
    if engine_cfg.name == "vllm":
        from demind.gen.engines.vllm_engine import VLLMEngine

        return VLLMEngine(engine_cfg, sampling_cfg)
    raise ValueError(f"engine.name must be 'vllm' or 'transformers', got {engine_cfg.name!r}")
