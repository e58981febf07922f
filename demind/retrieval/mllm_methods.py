"""Methods that read an MLLM's target descriptions (:mod:`demind.mllm` writes them).

* ``cirevl``, ``osrcir``: the description's text embedding against the gallery; with several
  descriptions per query (``describe.samples``), an LDRE-style weighted ensemble
  (:func:`ensemble_embeddings`).
* ``demind+mllm``: the trained De-MINDS query t_hat and the description embedding e_d mixed,
  normalize((1 - w) t_hat + w e_d) with w = ``describe.hybrid_weight``; ``demind+mllm+deo``
  runs DEO on it like on any prompt-reading method.

This module does not import :mod:`demind.mllm` (which sits above the registry): a method gets
an object with ``describer(name)`` (an :class:`demind.mllm.MLLMRun`) and the ``options``.
The descriptions of one query travel to :meth:`embed` as one text, joined by newlines
(a parsed description is one line), because the harness hands ``embed`` one text per query.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from demind.config import ConfigError
from demind.retrieval.methods_base import RetrievalMethod
from demind.retrieval.names import HYBRID_METHOD
from demind.retrieval.refs import Query

SEPARATOR = "\n"


def ensemble_embeddings(descriptions: torch.Tensor, tau: float) -> torch.Tensor:
    """(S, D) normalised embeddings of one query's descriptions -> (D,) normalised query.

    LDRE-style: descriptions that agree with the others weigh more. Weight of description i:
    softmax over i of c_i / tau, c_i = mean cosine similarity of i to the other S - 1
    (a description far from the consensus is likely a mis-reading). S = 1: the embedding itself.
    """
    if descriptions.shape[0] == 1:
        return descriptions[0]
    sims = descriptions @ descriptions.T
    consensus = (sims.sum(dim=1) - sims.diagonal()) / (descriptions.shape[0] - 1)
    weights = torch.softmax(consensus / tau, dim=0)
    return F.normalize((weights[:, None] * descriptions).sum(dim=0), dim=-1)


class DescribedQuery(RetrievalMethod):
    """``cirevl`` / ``osrcir``: the target description(s) through the frozen text tower."""


    def __init__(self, backbone, name: str, mllm: Any) -> None:
        super().__init__(backbone)
        self.name = name
        self.mllm = mllm
        self.describer = mllm.describer(name)

    def query_texts(self, queries: list[Query]) -> list[str]:
        return [SEPARATOR.join(d) for d in self.describer.describe(queries)]

    def embed(self, ref_features, prompts, texts):
        groups = [t.split(SEPARATOR) for t in texts]
        flat = self._text_embeddings([d for g in groups for d in g])  # (sum S, D), repeats encoded once
        out, start = [], 0
        for g in groups:
            out.append(ensemble_embeddings(flat[start:start + len(g)], self.mllm.options.ensemble_tau))
            start += len(g)
        return torch.stack(out)


class HybridQuery(RetrievalMethod):
    """``demind+mllm``: De-MINDS's query mixed with the description's embedding."""

    name = HYBRID_METHOD

    def __init__(self, backbone, model, mllm: Any) -> None:
        super().__init__(backbone)
        self.model = model
        self.weight = mllm.options.hybrid_weight
        self.described = DescribedQuery(backbone, mllm.options.hybrid_describer, mllm)

    def query_texts(self, queries: list[Query]) -> list[str]:
        return self.described.query_texts(queries)

    def embed(self, ref_features, prompts, texts):
        t_hat = F.normalize(self.model.compose(ref_features, prompts).t_hat.float(), dim=-1)
        described = self.described.embed(ref_features, prompts, texts).to(t_hat.device)
        return F.normalize((1 - self.weight) * t_hat + self.weight * described, dim=-1)


def build_mllm_method(name: str, backbone, model, mllm: Any) -> RetrievalMethod:
    """The method object of an MLLM method name; ``mllm``: an MLLMRun (None: a clear error)."""
    if mllm is None:
        raise ConfigError(f"method {name!r} runs a multimodal LLM: give engine.name=transformers|vllm and "
                          f"engine.model=DIR_OR_HUB_ID (a llava-hf model folder) (see docs/mllm.md)")
    if name == HYBRID_METHOD:
        if model is None:
            raise ConfigError(f"method {name!r} needs a trained model: pass --checkpoint CKPT")
        return HybridQuery(backbone, model, mllm)
    return DescribedQuery(backbone, name, mllm)
