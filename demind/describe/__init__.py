"""MLLM reasoning at query time: the training-free family (CIReVL, OSrCIR, LDRE-style ensembles)
and MLLM re-ranking, on the data_gen engines (:mod:`demind.gen.engines`).

* :mod:`~demind.describe.describers` -- (reference image, modification) -> target description(s);
* :mod:`~demind.describe.parse` -- the description read out of a chain-of-thought answer;
* :mod:`~demind.describe.store` -- the one rule of stored answers (descriptions, re-ranking scores):
  keyed by the model's content, the image's pixels, the text, the prompt texts and the settings;
* :mod:`~demind.describe.rerank` -- the yes/no verifier and the top-K re-ordering;
* :mod:`~demind.describe.session` -- one engine, the describers and the re-ranker of a benchmark split.

The methods that embed the descriptions live in the registry (:mod:`demind.retrieval.mllm_methods`);
this package sits above :mod:`demind.retrieval` (it reads its images and queries), never below it.
See docs/mllm.md.
"""

# Resolved on first use: importing demind.describe.config (a command's --help) loads no engine or torch.
from demind.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.describe.config": ["DESCRIBERS", "DescribeOptions", "RerankOptions"],
    "demind.describe.describers": ["CIReVLDescriber", "Describer", "DescriberPrompts", "LazyEngine",
                                   "OSrCIRDescriber", "load_describer_prompts", "modification_text"],
    "demind.describe.parse": ["Parsed", "parse_description"],
    "demind.describe.rerank": ["MLLMVerifier", "Reranker", "Verifier", "rerank_ranking"],
    "demind.describe.session": ["MLLMRun", "MLLMSetup"],
    "demind.describe.store": ["AnswerStore", "DigestMemo", "MemoryStore", "ModelIdentity", "pixel_digest"],
})

__all__ = [
    "DESCRIBERS", "AnswerStore", "CIReVLDescriber", "DescribeOptions", "Describer", "DescriberPrompts", "DigestMemo",
    "LazyEngine", "MLLMRun", "MLLMSetup", "MLLMVerifier", "MemoryStore", "ModelIdentity", "OSrCIRDescriber", "Parsed",
    "RerankOptions", "Reranker", "Verifier", "load_describer_prompts", "modification_text", "parse_description",
    "pixel_digest", "rerank_ranking",
]
