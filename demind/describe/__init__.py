"""MLLM reasoning at query time: the training-free family (CIReVL, OSrCIR, LDRE-style ensembles)
and MLLM re-ranking, on the data_gen engines (:mod:`demind.gen.engines`).

* :mod:`~demind.describe.describers` -- (reference image, modification) -> target description(s);
* :mod:`~demind.describe.parse` -- the description read out of a chain-of-thought answer;
* :mod:`~demind.describe.store` -- descriptions and re-ranking scores as resumable, inspectable data;
* :mod:`~demind.describe.rerank` -- the yes/no verifier and the top-K re-ordering;
* :mod:`~demind.describe.session` -- one engine, the describers and the re-ranker of a benchmark split.

The methods that embed the descriptions live in the registry (:mod:`demind.retrieval.mllm_methods`);
this package sits above :mod:`demind.retrieval` (it reads its images and queries), never below it.
See docs/mllm.md.
"""

from demind.describe.config import DESCRIBERS, DescribeOptions, RerankOptions
from demind.describe.describers import (CIReVLDescriber, Describer, DescriberPrompts, LazyEngine, OSrCIRDescriber,
                                        load_describer_prompts, modification_text)
from demind.describe.parse import Parsed, parse_description
from demind.describe.rerank import MLLMVerifier, Reranker, Verifier, rerank_ranking
from demind.describe.session import MLLMRun, MLLMSetup
from demind.describe.store import MemoryStore, RecordStore, model_identity

__all__ = [
    "DESCRIBERS", "CIReVLDescriber", "DescribeOptions", "Describer", "DescriberPrompts", "LazyEngine", "MLLMRun",
    "MLLMSetup", "MLLMVerifier", "MemoryStore", "OSrCIRDescriber", "Parsed", "RecordStore", "RerankOptions",
    "Reranker", "Verifier", "load_describer_prompts", "model_identity", "modification_text", "parse_description",
    "rerank_ranking",
]
