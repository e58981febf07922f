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
from demind.mllm.config import DESCRIBERS, DescribeOptions, RerankOptions
from demind.mllm.describers import DESCRIBER_CLASSES, Describer, LazyEngine, load_describer_prompts
from demind.mllm.rerank import MLLMVerifier, Reranker
from demind.mllm.digest_memo import DigestMemo, text_digest
from demind.mllm.model_identity import ModelIdentity
from demind.mllm.store import AnswerStore, check_store_root
from demind.engines import Engine


@dataclass
class MLLMSetup:
    """``engine_factory`` builds the engine (called at most once, only when an answer is missing);
    ``model`` (``engine.model``: its files' content keys the answers), ``engine_name`` and ``dtype``
    identify it without loading it. ``content_identity``: the identity of an engine that has no model
    files (a program such as the toy world's MLLM, whose name states everything its answers depend on)."""

    engine_factory: Callable[[], Engine]
    model: str
    engine_name: str = "transformers"
    dtype: str = "auto"
    describe: DescribeOptions = field(default_factory=DescribeOptions)
    rerank: RerankOptions = field(default_factory=RerankOptions)
    content_identity: str | None = None

    def __post_init__(self) -> None:
        self.engine = LazyEngine(self.engine_factory)  # shared by every split this setup is bound to

    def bind(self, benchmark: str, split: str, store_root: str | Path | None) -> "MLLMRun":
        """The run of one benchmark split (``benchmark`` and ``split`` are labels, never part of a key);
        answers go under ``describe.store``, else ``store_root`` (None: in memory). An unwritable store
        is refused here, before any model loads."""
        root = self.describe.store or store_root
        if root is not None:
            check_store_root(Path(root))
        return MLLMRun(self, benchmark, split, Path(root) if root is not None else None)


class MLLMRun:
    """The describers and the re-ranker of one benchmark split (built on first use)."""

    def __init__(self, setup: MLLMSetup, benchmark: str, split: str, root: Path | None) -> None:
        self.setup = setup
        self.options = setup.describe
        self.benchmark, self.split, self.root = benchmark, split, root
        self.prompts = load_describer_prompts(self.options.prompts)
        self.memo = DigestMemo(root / "digests.jsonl" if root is not None else None)
        self.model = ModelIdentity(setup.model, self.memo, root)
        if setup.content_identity is not None:
            self.model.given(setup.content_identity)
        self._describers: dict[str, Describer] = {}
        self._verifier: MLLMVerifier | None = None

    def _store(self, kind: str, prompt_texts: tuple[str, ...], settings: dict[str, Any]) -> AnswerStore:
        """The store of ``kind``: its key holds the model's content, the kind's prompt texts and ``settings``
        with the engine and dtype (demind.mllm.store)."""
        settings = {"engine": self.setup.engine_name, "dtype": self.setup.dtype, **settings}
        return AnswerStore(self.root, kind, self.model, text_digest(*prompt_texts), settings, self.memo)

    def describer(self, name: str) -> Describer:
        if name not in DESCRIBER_CLASSES:
            raise ConfigError(f"unknown describer {name!r}; choose from {', '.join(DESCRIBERS)}")
        if name not in self._describers:
            o = self.options
            settings = {"temperature": o.temperature, "top_p": o.top_p, "seed": o.seed,
                        "image_max_side": o.image_max_side,
                        "max_tokens": o.max_tokens if name == "osrcir" else [o.caption_max_tokens, o.rewrite_max_tokens]}
            texts = (self.prompts.osrcir,) if name == "osrcir" else (self.prompts.caption, self.prompts.rewrite)
            self._describers[name] = DESCRIBER_CLASSES[name](self.setup.engine, self.prompts, o,
                                                             self._store(name, texts, settings))
        return self._describers[name]

    def reranker(self) -> Reranker | None:
        """None while ``rerank.k`` is 0. Built once; answer words that cannot work (empty, or without a
        token in the model's tokenizer, read without the model where its files are here) are refused
        on the first call, before any description is generated."""
        if self.setup.rerank.k == 0:
            return None
        if self._verifier is None:
            r = self.setup.rerank
            problems = r.config_problems()
            if problems:
                raise ConfigError("; ".join(f"rerank.{key} {message}" for key, message in problems))
            settings = {"yes": r.yes, "no": r.no, "image_max_side": self.options.image_max_side}
            verifier = MLLMVerifier(self.setup.engine, self.prompts, r,
                                    self._store("verify", (self.prompts.verify,), settings), self.options.image_max_side)
            verifier.check_answer_words(self.model.folder())
            self._verifier = verifier
        return Reranker(self._verifier, self.setup.rerank.k)

    def rerank_targets(self, method_names: list[str]) -> list[str]:
        """Which of the run's methods get a ``+rerank`` variant (``rerank.methods``, default all)."""
        spec = self.setup.rerank.methods
        if spec is None:
            return list(method_names)
        names = [n.strip() for n in spec.split(",") if n.strip()]
        if not names:
            raise ConfigError(f"rerank.methods={spec!r} names no method; name the methods to re-rank "
                              f"(rerank.methods={','.join(method_names[:2])}), or leave it out to re-rank every method")
        unknown = [n for n in names if n not in method_names]
        if unknown:
            raise ConfigError(f"rerank.methods names {unknown}, which this run does not offer "
                              f"(methods: {', '.join(method_names)})")
        return names

    def summary(self) -> dict[str, Any]:
        """results.json's ``mllm`` section."""
        out: dict[str, Any] = {"model": self.setup.model, "engine": self.setup.engine_name,
                               "prompts": self.prompts.id, "samples": self.options.samples,
                               "model_loaded": self.setup.engine.loaded, "model_identity": self.model.digest,
                               "model_identity_source": self.model.source,
                               "describers": {n: d.summary() for n, d in self._describers.items()}}
        if self._verifier is not None:
            out["rerank"] = self._verifier.summary()
        return out
