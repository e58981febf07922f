"""The models a command loads, and their settings: what demind-eval, demind-index, demind-search and
demind-serve share.

* the trained model: a De-MINDS checkpoint (its backbone rebuilt from it) or a backbone alone
  (:class:`ModelOptions`, the flags :data:`MODEL_FLAGS`, :func:`load_model`);
* the multimodal LLM of the query-time methods (``cirevl``, ``osrcir``, ``demind+mllm``) and of
  re-ranking: demind-eval's ``engine``, ``describe`` and ``rerank`` sections
  (:func:`build_mllm_setup`; demind-search's and demind-serve's :class:`SearchModelOptions`).

Not a command: no console script points here. Model code (and torch) is imported inside the
functions that load a model: ``--help`` must not load it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Protocol

from demind.cli.common import Flag
from demind.settings import ModelRunConfig, QueryRunConfig, resolve_device, setting
from demind.mllm.config import DescribeOptions, RerankOptions
from demind.errors import InputError
from demind.engines import EngineConfig
from demind.schema import PRECISION_NAMES, RANDOM_TAGS, BackboneConfig


@dataclass
class BackboneChoice:
    """The frozen backbone of the commands that load a trained model (eval, index, search, serve)."""

    spec: str | None = setting(None, refuses="ViT-B-32", help="NAME:TAG_OR_PATH, e.g. ViT-L-14:openai (backbone-only methods without a "
                                          "checkpoint, or to check the checkpoint's); NAME:none = random weights")
    precision: str = setting("fp32", choices=PRECISION_NAMES, help="open_clip precision; an index records it")

    def config_problems(self) -> list[tuple[str, str]]:
        """NAME:TAG_OR_PATH."""
        if self.spec is not None and not all(self.spec.partition(":")[::2]):
            return [("spec", f"= {self.spec!r} must be NAME:TAG_OR_PATH (e.g. ViT-L-14:openai, "
                             f"configs/model/tiny-clip.json:none)")]
        return []

    def input_problems(self) -> list[tuple[str, str]]:
        """The files NAME:TAG_OR_PATH names exist (the backbone's own rule), before any model loads."""
        if self.spec is None:
            return []
        name, sep, tag = self.spec.partition(":")
        if not sep or not name or not tag:
            return [("spec", f"= {self.spec!r} must be NAME:TAG_OR_PATH (e.g. ViT-L-14:openai, "
                             f"configs/model/tiny-clip.json:none)")]
        cfg = BackboneConfig(name=name, pretrained=None if tag.lower() in RANDOM_TAGS else tag)
        return [("spec", message) for _, message in cfg.input_problems()]


def checkpoint_setting() -> Any:
    """The ``checkpoint`` key of a command that loads a trained model (a config field, as :func:`setting`)."""
    return setting(None, input="path", help="De-MINDS checkpoint (.safetensors, a demind-publish folder, or "
                              "hf-hub:ORG/NAME[@REVISION]); its backbone is rebuilt from it")


@dataclass
class ModelOptions:
    """What the search commands load: a checkpoint (its backbone rebuilt) or a backbone alone."""

    checkpoint: str | None = checkpoint_setting()
    backbone: BackboneChoice = field(default_factory=BackboneChoice)
    run: ModelRunConfig = field(default_factory=ModelRunConfig)


MODEL_FLAGS = {"--checkpoint": Flag("checkpoint"), "--backbone": Flag("backbone.spec"),
               "--precision": Flag("backbone.precision")}
"""The flags of the keys above, shared by demind-eval, demind-index, demind-search and demind-serve."""


class ChoosesModel(Protocol):
    """A command config that names a trained model: :class:`ModelOptions`, or demind-eval's."""

    checkpoint: str | None
    backbone: BackboneChoice
    run: ModelRunConfig


def query_mode_problems(checkpoint: str | None, run: Any) -> list[tuple[str, str]]:
    """``run.query_mode`` where it would do nothing, refused with the config (before any model loads): no
    checkpoint, or CUDA graphs with run.device=cpu. What only the loaded model tells (a combiner) stays in
    :func:`apply_query_mode`."""
    mode = getattr(run, "query_mode", "eager")
    if mode == "eager":
        return []
    if checkpoint is None:
        return [("run.query_mode", f"= {mode!r}: run.query_mode={mode} speeds up a checkpoint's queries and no "
                                   f"--checkpoint was given: leave run.query_mode=eager")]
    if mode == "cudagraphs" and run.device == "cpu":
        return [("run.query_mode", "= 'cudagraphs': run.query_mode=cudagraphs replays CUDA graphs and needs "
                                   "run.device=cuda; on a CPU use run.query_mode=compile")]
    return []


def apply_query_mode(model: Any, mode: str) -> None:
    """``run.query_mode`` on a loaded De-MINDS model (``DeMinds.set_query_mode``); refused in one
    line where it would do nothing: no checkpoint, or CUDA graphs on a CPU."""
    if mode == "eager":
        return
    if model is None:
        raise InputError(f"run.query_mode={mode} speeds up a checkpoint's queries and no --checkpoint was given: "
                         "leave run.query_mode=eager")
    if not hasattr(model, "set_query_mode"):  # a combiner trained on triplets (demind-train-triplets)
        raise InputError(f"run.query_mode={mode} speeds up a De-MINDS checkpoint's queries; this checkpoint is a "
                         "combiner, whose queries are one small MLP: leave run.query_mode=eager")
    if mode == "cudagraphs" and model.backbone.device.type != "cuda":
        raise InputError("run.query_mode=cudagraphs replays CUDA graphs and needs run.device=cuda; "
                         "on a CPU use run.query_mode=compile")
    model.set_query_mode(mode)


def load_model(cfg: ChoosesModel):
    """(backbone, model or None) as the config asks; ``run.query_mode`` applied where the config has one."""
    from demind.checkpoint import load_backbone_and_model

    backbone, model = load_backbone_and_model(cfg.checkpoint, cfg.backbone.spec, precision=cfg.backbone.precision,
                                              device=resolve_device(cfg.run.device))
    apply_query_mode(model, getattr(cfg.run, "query_mode", "eager"))  # demind-index composes no query
    return backbone, model


def build_mllm_setup(engine: EngineConfig, describe: DescribeOptions, rerank: RerankOptions, run: ModelRunConfig):
    """The :class:`demind.mllm.MLLMSetup` of these config sections; the engine itself is built
    only when an answer is missing from the stores (a rerun loads no model)."""
    from demind.mllm import MLLMSetup
    from demind.engines import SamplingConfig

    def build():
        from demind.engines import build_engine, disable_loading_progress

        if not run.progress:
            disable_loading_progress()
        sampling = SamplingConfig(temperature=describe.temperature, top_p=describe.top_p)
        return build_engine(engine, sampling, device=run.device, seed=describe.seed)

    return MLLMSetup(build, engine.model, engine.name, engine.dtype, describe, rerank)


def vllm_installed() -> bool:
    """Whether the optional vLLM package is installed (looked up, not imported: no CUDA starts)."""
    return importlib.util.find_spec("vllm") is not None


def engine_problems(engine: EngineConfig) -> list[tuple[str, str]]:
    """The ``engine`` section's problems a command must say before any model loads or any image is
    encoded: an engine whose optional package is missing (else found only when the first answer is
    missing from the store, after the gallery is encoded)."""
    if engine.name == "vllm" and not vllm_installed():
        return [("name", "= 'vllm' needs the optional vLLM package, which is not installed here: pip install "
                         "'demind[vllm]' on an NVIDIA GPU, or bash scripts/setup.sh --vllm without one "
                         "(docs/generation.md); or use engine.name=transformers")]
    return []


@dataclass
class SearchEngineConfig(EngineConfig):
    """demind-search's and demind-serve's engine section: demind-eval's (:class:`demind.engines.EngineConfig`)
    without a model by default, the MLLM methods being a choice there."""

    model: str | None = setting(None, free="a Hub id or a model folder, checked (one line naming engine.model) "
                                           "when the engine is first needed: answers in the store need no weights",
                                help="MLLM (llava-hf folder or hub id) for cirevl, osrcir, demind+mllm and "
                                           "rerank.k (none: those methods are not offered)")

    def config_problems(self) -> list[tuple[str, str]]:
        return engine_problems(self) if self.model is not None else []


@dataclass
class SearchModelOptions(ModelOptions):
    """demind-search's and demind-serve's models: the checkpoint and, optionally, an MLLM (docs/mllm.md)."""

    engine: SearchEngineConfig = field(default_factory=SearchEngineConfig)
    describe: DescribeOptions = field(default_factory=DescribeOptions)
    rerank: RerankOptions = field(default_factory=RerankOptions)
    run: QueryRunConfig = field(default_factory=QueryRunConfig)


def search_mllm_setup(cfg: SearchModelOptions):
    """The MLLM of ``engine.model`` (None without one; ``rerank.k`` without one is an InputError)."""
    if cfg.engine.model is None:
        if cfg.rerank.k > 0:
            raise InputError("rerank.k re-ranks with a multimodal LLM: give engine.name=transformers "
                             "engine.model=DIR (a llava-hf folder; see docs/mllm.md), or leave rerank.k at 0")
        return None
    return build_mllm_setup(cfg.engine, cfg.describe, cfg.rerank, cfg.run)


def bind_search_mllm(cfg: SearchModelOptions, index_dir: str):
    """The MLLM of a search over ``index_dir``, bound to its answer store (:class:`demind.mllm.SearchMLLM`;
    None without ``engine.model``): the store's folder and the re-ranking words (read from the model's
    tokenizer files, not its weights) are checked here, before any model loads or any image is encoded."""
    setup = search_mllm_setup(cfg)
    if setup is None:
        return None
    from pathlib import Path

    from demind.mllm import SearchMLLM

    return SearchMLLM(setup, Path(index_dir).name, Path(index_dir))
