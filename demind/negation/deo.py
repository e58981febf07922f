"""DEO's direct embedding optimisation (section 3.2), batched over queries.

For one query with original embedding e_o, positive sub-query embeddings p_1..p_P and
negative ones n_1..n_N, the paper minimises over e_u (the encoder stays frozen)

    L(e_u) = λp · mean_i ‖e_u − p_i‖² − λn · mean_j ‖e_u − n_j‖² + λo · ‖e_u − e_o‖²

with Adam from e_u = e_o for a fixed number of steps. Two modes here:

* ``adam`` (the paper's schedule): Adam, ``steps`` = 20, ``lr``; λp = λn = λo = 1 for
  multimodal retrieval, λo = 0.2 for text retrieval (:data:`PAPER_LAMBDAS`). The paper's
  learning rate was not available to us when this was written; ``lr`` = 0.01 is our a-priori
  choice: Adam's early steps move each coordinate by about ``lr``, a unit-norm embedding's
  coordinates are about 1/sqrt(D) (0.09 at D = 128, 0.04 at D = 768), so 20 steps can cover
  the distance to the minimiser without jumping far past it.
* ``exact``: L is a quadratic in e_u with Hessian 2·(λp − λn + λo)·I. When λp + λo > λn it is
  strictly convex and its minimiser is

      e* = (λp·p̄ − λn·n̄ + λo·e_o) / (λp − λn + λo),   p̄, n̄ the means of the p_i, n_j,

  the point Adam converges to (tested). This is the default of the ``+deo`` evaluation
  methods: it does not depend on a learning rate we could not check, and costs one
  weighted sum instead of 20 optimiser steps.

When λn ≥ λp + λo the loss is unbounded below (e_u → ∞ along p̄ − n̄ keeps lowering it):
``exact`` refuses with a ValueError naming the λs; ``adam`` runs its fixed step budget, which
bounds how far e_u can travel (Adam moves a coordinate at most about ``lr`` per step), logs
a warning, and the result is renormalised like every other.

Normalisation (the choices a reader would ask about):

* sub-query embeddings p_i, n_j and e_o are used as given; the evaluation methods pass
  L2-normalised embeddings (every method's query is normalised, negatives are normalised
  text embeddings), so all terms live on one scale;
* e_u is optimised unconstrained (no projection to the sphere between steps: the closed form
  holds only then) and L2-normalised once at the end (``normalise=True``), since retrieval
  ranks by cosine similarity;
* a query without negatives is returned EXACTLY as e_o (no optimisation, no renormalisation),
  so DEO cannot change a query the decomposer left alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from demind.errors import InputError
from demind.config import validate
from demind.settings import setting

log = logging.getLogger(__name__)

MODES = ("exact", "adam")
# (λp, λn, λo) from the paper.
PAPER_LAMBDAS = {"multimodal": (1.0, 1.0, 1.0), "text": (1.0, 1.0, 0.2)}


@dataclass(frozen=True)
class DEOConfig:
    """How e_u is found. Defaults: the paper's multimodal λs, 20 Adam steps, closed form."""

    mode: str = setting("exact", choices=MODES)
    steps: int = setting(20, ge=0)
    lr: float = setting(0.01, gt=0)
    lambda_p: float = setting(1.0, ge=0)
    lambda_n: float = setting(1.0, ge=0)
    lambda_o: float = setting(1.0, ge=0)
    normalise: bool = True

    def __post_init__(self) -> None:
        validate(self)  # built in code by the methods: the same declared rules a loaded config meets

    @property
    def curvature(self) -> float:
        """λp − λn + λo: the loss is strictly convex (bounded below) iff this is > 0."""
        return self.lambda_p - self.lambda_n + self.lambda_o


@dataclass
class SubQueries:
    """Padded sub-query embeddings of B queries.

    positives: (B, P, D), positive_mask: (B, P) bool; negatives: (B, N, D), negative_mask: (B, N).
    """

    positives: torch.Tensor
    positive_mask: torch.Tensor
    negatives: torch.Tensor
    negative_mask: torch.Tensor

    @classmethod
    def from_lists(cls, positives: list[torch.Tensor], negatives: list[torch.Tensor], dim: int,
                   device: torch.device | str = "cpu") -> SubQueries:
        """Per query a (P_b, D) and an (N_b, D) tensor (either may have 0 rows) -> padded batch."""
        if len(positives) != len(negatives):
            raise ValueError(f"{len(positives)} positive and {len(negatives)} negative lists: one of each per query")
        pos, pos_mask = _pad(positives, dim, device)
        neg, neg_mask = _pad(negatives, dim, device)
        return cls(pos, pos_mask, neg, neg_mask)


def _pad(rows: list[torch.Tensor], dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max([r.shape[0] for r in rows] + [1])
    out = torch.zeros(len(rows), width, dim, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        if r.dim() != 2 or r.shape[1] != dim:
            raise ValueError(f"query {b}: sub-query embeddings must be (k, {dim}), got {tuple(r.shape)}")
        out[b, : r.shape[0]] = r.float().to(device)
        mask[b, : r.shape[0]] = True
    return out, mask


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, K, D), (B, K) -> (B, D) mean over the valid rows (zeros where there are none)."""
    m = mask.unsqueeze(-1).float()
    return (x * m).sum(1) / m.sum(1).clamp(min=1.0)


def deo_loss(e_u: torch.Tensor, e_o: torch.Tensor, sub: SubQueries, cfg: DEOConfig) -> torch.Tensor:
    """(B, D) candidates -> (B,) DEO losses (the paper's L, squared L2 distances, means over valid rows)."""
    pos_d = ((e_u.unsqueeze(1) - sub.positives) ** 2).sum(-1)  # (B, P)
    neg_d = ((e_u.unsqueeze(1) - sub.negatives) ** 2).sum(-1)  # (B, N)
    pos_term = (pos_d * sub.positive_mask).sum(1) / sub.positive_mask.sum(1).clamp(min=1)
    neg_term = (neg_d * sub.negative_mask).sum(1) / sub.negative_mask.sum(1).clamp(min=1)
    return cfg.lambda_p * pos_term - cfg.lambda_n * neg_term + cfg.lambda_o * ((e_u - e_o) ** 2).sum(-1)


def closed_form(e_o: torch.Tensor, sub: SubQueries, cfg: DEOConfig) -> torch.Tensor:
    """(B, D) minimisers e* = (λp·p̄ − λn·n̄ + λo·e_o) / (λp − λn + λo), not normalised.

    Raises ValueError when λp + λo <= λn (the loss has no minimum).
    """
    if cfg.curvature <= 0:
        raise InputError(f"DEO exact mode needs λp + λo > λn (a convex loss), got λp={cfg.lambda_p}, "
                         f"λn={cfg.lambda_n}, λo={cfg.lambda_o}: the loss is unbounded below. Lower λn, or use "
                         "mode='adam', whose fixed step budget bounds how far e_u moves")
    p_bar = _masked_mean(sub.positives, sub.positive_mask)
    n_bar = _masked_mean(sub.negatives, sub.negative_mask)
    return (cfg.lambda_p * p_bar - cfg.lambda_n * n_bar + cfg.lambda_o * e_o.float()) / cfg.curvature


def adam_optimise(e_o: torch.Tensor, sub: SubQueries, cfg: DEOConfig) -> torch.Tensor:
    """(B, D) e_u after ``cfg.steps`` Adam steps from e_o, not normalised.

    Adam is element-wise and the loss is a sum over queries, so each row's trajectory is the
    one it would have alone (batched == one at a time).
    """
    if cfg.curvature <= 0:
        log.warning("DEO: λn=%g >= λp + λo = %g: the loss is unbounded below; e_u moves for the fixed %d steps "
                    "only (at most about lr=%g per coordinate and step)", cfg.lambda_n,
                    cfg.lambda_p + cfg.lambda_o, cfg.steps, cfg.lr)
    e_o = e_o.detach().float()
    e_u = e_o.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([e_u], lr=cfg.lr)
    with torch.enable_grad():
        for _ in range(cfg.steps):
            optimiser.zero_grad(set_to_none=True)
            deo_loss(e_u, e_o, sub, cfg).sum().backward()
            optimiser.step()
    return e_u.detach()


def optimise(e_o: torch.Tensor, sub: SubQueries, cfg: DEOConfig) -> torch.Tensor:
    """(B, D) original queries + their sub-queries -> (B, D) DEO queries.

    Rows with no negative are returned exactly as e_o. Every row with a negative needs at
    least one positive (the evaluation methods always give one).
    """
    if e_o.dim() != 2:
        raise ValueError(f"e_o must be (B, D), got {tuple(e_o.shape)}")
    active = sub.negative_mask.any(1)
    out = e_o.clone()
    if not bool(active.any()):
        return out
    lacking = (active & ~sub.positive_mask.any(1)).nonzero().flatten().tolist()
    if lacking:
        raise InputError(f"queries {lacking[:5]} have negatives but no positive sub-query; DEO needs at least one")
    idx = active.nonzero().flatten()
    sub_active = SubQueries(sub.positives[idx], sub.positive_mask[idx], sub.negatives[idx], sub.negative_mask[idx])
    solve = closed_form if cfg.mode == "exact" else adam_optimise
    e_u = solve(e_o[idx].float(), sub_active, cfg)
    if cfg.normalise:
        e_u = F.normalize(e_u, dim=-1)
    out[idx] = e_u.to(out.dtype)
    return out
