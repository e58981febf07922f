"""The base of every retrieval method and the display names (the registry: :mod:`demind.retrieval.methods`).

Its own module so that method families in other modules (:mod:`demind.retrieval.mllm_methods`)
subclass it without an import cycle with the registry that builds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from demind.backbone import FrozenCLIP
from demind.retrieval.names import METHOD_SPECS
from demind.retrieval.refs import Query



class RetrievalMethod:
    """Base: ``embed(ref_features (B, D) raw, prompts, texts) -> (B, D)`` normalised queries.

    What a method reads is declared once, in its name's :data:`~demind.retrieval.names.METHOD_SPECS`
    entry; ``language`` (which argument carries the user's words, the one DEO decomposes) is read
    from there.
    """

    name = ""

    def __init__(self, backbone: FrozenCLIP) -> None:
        self.backbone = backbone

    @property
    def label(self) -> str:
        return METHOD_SPECS[self.name].label

    @property
    def language(self) -> str | None:
        """Which ``embed`` argument carries the user's words: "prompts" (the template with the ``*``
        placeholder), "texts" (plain text) or None (no words)."""
        return {"prompt": "prompts", "text": "texts"}.get(METHOD_SPECS[self.name].words)

    def embed(self, ref_features: torch.Tensor, prompts: list[str], texts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    def map_gallery(self, gallery: torch.Tensor) -> torch.Tensor:
        """(N, D) normalised gallery features -> what ``embed``'s queries are scored against."""
        return gallery

    def query_texts(self, queries: list[Query]) -> list[str]:
        """The ``texts`` given to :meth:`embed` for these queries (the baselines' text)."""
        return [q.text for q in queries]

    def _text_embeddings(self, texts: list[str]) -> torch.Tensor:
        """(B, D) normalised text embeddings; repeated texts (ImageNet-R domains) are encoded once."""
        unique = list(dict.fromkeys(texts))
        pooled = F.normalize(self.backbone.encode_text(unique).pooled, dim=-1)
        row = {t: i for i, t in enumerate(unique)}
        return pooled[torch.tensor([row[t] for t in texts], device=pooled.device)]
