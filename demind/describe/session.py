"""What an evaluation needs of an MLLM: one lazily built engine, the describers and the re-ranker of a
benchmark split, each with its store, and the counts that go into results.json.

The command line builds an :class:`MLLMSetup` (engine factory + options); :func:`demind.eval.evaluate`
binds it to the benchmark split it reads (:meth:`MLLMSetup.bind`) and hands the
:class:`MLLMRun` to the method registry (``describer(name)``) and the re-ranking step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from demind.config import ConfigError
from demind.describe.config import DESCRIBERS, DescribeOptions, RerankOptions
from demind.describe.describers import DESCRIBER_CLASSES, Describer, LazyEngine, load_describer_prompts
from demind.describe.rerank import MLLMVerifier, Reranker
from demind.describe.store import MemoryStore, RecordStore, model_identity
from demind.gen import Engine


@dataclass
class MLLMSetup:
    """``engine_factory`` builds the engine (called at most once, only when an answer is missing);
    ``model`` / ``engine_name`` / ``dtype`` identify it without loading it (the stores' key)."""

    engine_factory: Callable[[], Engine]
    model: str
    engine_name: str = "transformers"
    dtype: str = "auto"
    describe: DescribeOptions = field(default_factory=DescribeOptions)
    rerank: RerankOptions = field(default_factory=RerankOptions)

    def __post_init__(self) -> None:
        self.engine = LazyEngine(self.engine_factory)  # shared by every split this setup is bound to

    def bind(self, benchmark: str, split: str, store_root: str | Path | None) -> "MLLMRun":
        root = self.describe.store or store_root
        return MLLMRun(self, benchmark, split, Path(root) if root is not None else None)


class MLLMRun:
    """The describers and the re-ranker of one benchmark split (built on first use)."""

    def __init__(self, setup: MLLMSetup, benchmark: str, split: str, root: Path | None) -> None:
        self.setup = setup
        self.options = setup.describe
        self.benchmark, self.split, self.root = benchmark, split, root
        self.prompts = load_describer_prompts(self.options.prompts)
        self._describers: dict[str, Describer] = {}
        self._verifier: MLLMVerifier | None = None

    def _store(self, kind: str, settings: dict[str, Any]) -> RecordStore:
        model = {**model_identity(self.setup.model), "engine": self.setup.engine_name, "dtype": self.setup.dtype}
        if self.root is None:
            return MemoryStore()
        return RecordStore.under(self.root, self.benchmark, self.split, kind, self.prompts.id, model, settings)

    def describer(self, name: str) -> Describer:
        if name not in DESCRIBER_CLASSES:
            raise ConfigError(f"unknown describer {name!r}; choose from {', '.join(DESCRIBERS)}")
        if name not in self._describers:
            o = self.options
            settings = {"temperature": o.temperature, "top_p": o.top_p, "seed": o.seed,
                        "image_max_side": o.image_max_side,
                        "max_tokens": o.max_tokens if name == "osrcir" else [o.caption_max_tokens, o.rewrite_max_tokens]}
            self._describers[name] = DESCRIBER_CLASSES[name](self.setup.engine, self.prompts, o,
                                                             self._store(name, settings))
        return self._describers[name]

    def reranker(self) -> Reranker | None:
        """None while ``rerank.k`` is 0."""
        if self.setup.rerank.k == 0:
            return None
        if self._verifier is None:
            r = self.setup.rerank
            settings = {"yes": r.yes, "no": r.no, "image_max_side": self.options.image_max_side}
            self._verifier = MLLMVerifier(self.setup.engine, self.prompts, r, self._store("verify", settings),
                                          self.options.image_max_side)
        return Reranker(self._verifier, self.setup.rerank.k)

    def rerank_targets(self, method_names: list[str]) -> list[str]:
        """Which of the run's methods get a ``+rerank`` variant (``rerank.methods``, default all)."""
        spec = self.setup.rerank.methods
        if spec is None:
            return list(method_names)
        names = [n.strip() for n in spec.split(",") if n.strip()]
        unknown = [n for n in names if n not in method_names]
        if unknown:
            raise ConfigError(f"rerank.methods names {unknown}, which this run does not evaluate "
                              f"(methods: {', '.join(method_names)})")
        return names

    def summary(self) -> dict[str, Any]:
        """results.json's ``mllm`` section."""
        out: dict[str, Any] = {"model": self.setup.model, "engine": self.setup.engine_name,
                               "prompts": self.prompts.id, "samples": self.options.samples,
                               "model_loaded": self.setup.engine.loaded,
                               "describers": {n: d.summary() for n, d in self._describers.items()}}
        if self._verifier is not None:
            out["rerank"] = self._verifier.summary()
        return out
