"""A CLIP4Cir-style combiner (Baldrati et al., 2022) over a frozen CLIP's features: the model that
supervised training on triplets fits (:mod:`demind.triplets.train`).

    t' = ReLU(W_t t), v' = ReLU(W_v v)                     projections, D -> P (dropout)
    h  = ReLU(W_h [t'; v'])                                 2P -> H (dropout)
    lambda = sigmoid(W_l ReLU(W_g [t'; v']))                the per-query text/image mixing weight
    f(v, t) = normalise(W_o h + lambda * t + (1 - lambda) * v)

v, t: the L2-normalised frozen image feature of the reference and text feature of the modification;
the target side is the frozen image feature itself, so a trained combiner ranks the same gallery
features every other method ranks. ``negative_prompt`` is ConeSep's NBL prompt P_neg: one
learnable vector in the text-feature space, F_neg = f(v, P_neg) (the paper's Q prompts through its
Q-Former; here one vector through the combiner), or an offset added to a negated text's feature.

The checkpoint is a De-MINDS checkpoint file (:func:`demind.checkpoint.save_checkpoint`: weights,
backbone identity, config with ``architecture: combiner``); :func:`demind.checkpoint.load_checkpoint`
rebuilds either model from it, and the ``combiner`` retrieval method serves it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from demind.schema import COMBINER_ARCHITECTURE, CombinerConfig

class Combiner(nn.Module):
    """f(reference feature, text feature) -> (B, D) normalised composed query (see the module docstring)."""

    def __init__(self, cfg: CombinerConfig, backbone=None) -> None:
        super().__init__()
        if cfg.embed_dim == 0:
            if backbone is None:
                raise ValueError("CombinerConfig.embed_dim is 0 and no backbone gives it")
            cfg.embed_dim = int(backbone.embed_dim)
        self.cfg = cfg
        self.__dict__["backbone"] = backbone  # not a submodule: checkpoints hold our weights only
        d, p, h = cfg.embed_dim, cfg.projection_dim, cfg.hidden_dim
        self.text_projection = nn.Linear(d, p)
        self.image_projection = nn.Linear(d, p)
        self.mixing = nn.Linear(2 * p, h)
        self.output = nn.Linear(h, d)
        self.gate_hidden = nn.Linear(2 * p, h)
        self.gate = nn.Linear(h, 1)
        self.dropout = nn.Dropout(cfg.dropout)
        # P_neg at the scale of a normalised text feature
        self.negative_prompt = nn.Parameter(torch.randn(d) / d ** 0.5)

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    def forward(self, image: torch.Tensor, text: torch.Tensor, with_negative: bool = False,
                negative_text: torch.Tensor | None = None):
        """image, text: (B, D) raw or normalised features -> (B, D) L2-normalised composed queries;
        ``with_negative``: the pair (queries, :meth:`negative` of ``image`` and ``negative_text``), from
        one call (so a data-parallel wrapper sees P_neg used inside its forward)."""
        query = self._compose(image, text)
        return (query, self.negative(image, negative_text)) if with_negative else query

    def _compose(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        image = F.normalize(image.float(), dim=-1)
        text = F.normalize(text.float(), dim=-1)
        joint = torch.cat([self.dropout(F.relu(self.text_projection(text))),
                           self.dropout(F.relu(self.image_projection(image)))], dim=-1)
        mixed = self.output(self.dropout(F.relu(self.mixing(joint))))
        weight = torch.sigmoid(self.gate(self.dropout(F.relu(self.gate_hidden(joint)))))  # (B, 1)
        return F.normalize(mixed + weight * text + (1 - weight) * image, dim=-1)

    def negative(self, image: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """(B, D) NBL's negative compositions: F_neg = f(v, P_neg), or with ``text`` (B, D) (a negation
        phrase + the modification, as ConeSep's code reads it) f(v, normalise(text) + P_neg), P_neg then a
        learnable offset (:func:`demind.triplets.modes.start_negative_offset` starts it at 0)."""
        prompt = self.negative_prompt.expand(image.shape[0], -1)
        if text is None:
            return self._compose(image, prompt)
        return self._compose(image, F.normalize(text.float(), dim=-1) + prompt)


def is_combiner_config(model_config: dict) -> bool:
    """Whether a checkpoint's recorded model config is a combiner's."""
    return isinstance(model_config, dict) and model_config.get("architecture") == COMBINER_ARCHITECTURE
