"""The MLLM at query time: the training-free family (CIReVL, OSrCIR, LDRE-style ensembles) and
MLLM re-ranking, on the data_gen engines (:mod:`demind.engines`), for benchmarks and search.

* :mod:`~demind.mllm.describers` -- (reference image, modification) -> target description(s);
* :mod:`~demind.mllm.parse` -- the description read out of a chain-of-thought answer;
* :mod:`~demind.mllm.store` -- the one rule of stored answers (descriptions, re-ranking scores):
  keyed by the model's content, the image's pixels, the text, the prompt texts and the settings;
* :mod:`~demind.mllm.digest_memo` and :mod:`~demind.mllm.model_identity` -- the digests those keys
  are made of, remembered; the model's content identity, also with its weights absent;
* :mod:`~demind.mllm.rerank` -- the yes/no verifier and the top-K re-ordering;
* :mod:`~demind.mllm.session` -- one engine, the describers and the re-ranker of a benchmark split;
* :mod:`~demind.mllm.search_binding` -- the same, bound to a search index for queries typed by a user.

The methods that embed the descriptions live in the registry (:mod:`demind.retrieval.mllm_methods`):
this package sits above :mod:`demind.retrieval` (it reads its images and queries), never below it, so
the registry cannot import it; a method is handed an :class:`MLLMRun` instead.
See docs/mllm.md.
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.mllm.config import DESCRIBERS, DescribeOptions, RerankOptions
    from demind.mllm.describers import (
        CIReVLDescriber, Describer, DescriberPrompts, LazyEngine, OSrCIRDescriber, load_describer_prompts,
        modification_text)
    from demind.mllm.parse import Parsed, parse_description
    from demind.mllm.rerank import MLLMVerifier, Reranker, Verifier, rerank_ranking
    from demind.mllm.search_binding import SearchMLLM
    from demind.mllm.session import MLLMRun, MLLMSetup
    from demind.mllm.digest_memo import DigestMemo, pixel_digest
    from demind.mllm.model_identity import ModelIdentity
    from demind.mllm.store import AnswerStore, MemoryStore

# Resolved on first use: importing demind.mllm.config (a command's --help) loads no engine or torch.
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.mllm.config": ["DESCRIBERS", "DescribeOptions", "RerankOptions"],
    "demind.mllm.describers": ["CIReVLDescriber", "Describer", "DescriberPrompts", "LazyEngine",
                               "OSrCIRDescriber", "load_describer_prompts", "modification_text"],
    "demind.mllm.parse": ["Parsed", "parse_description"],
    "demind.mllm.rerank": ["MLLMVerifier", "Reranker", "Verifier", "rerank_ranking"],
    "demind.mllm.search_binding": ["SearchMLLM"],
    "demind.mllm.session": ["MLLMRun", "MLLMSetup"],
    "demind.mllm.digest_memo": ["DigestMemo", "pixel_digest"],
    "demind.mllm.model_identity": ["ModelIdentity"],
    "demind.mllm.store": ["AnswerStore", "MemoryStore"],
})

__all__ = [
    "DESCRIBERS", "AnswerStore", "CIReVLDescriber", "DescribeOptions", "Describer", "DescriberPrompts", "DigestMemo",
    "LazyEngine", "MLLMRun", "MLLMSetup", "MLLMVerifier", "MemoryStore", "ModelIdentity", "OSrCIRDescriber", "Parsed",
    "RerankOptions", "Reranker", "SearchMLLM", "Verifier", "load_describer_prompts", "modification_text",
    "parse_description", "pixel_digest", "rerank_ranking",
]
