"""The noise modes of supervised triplet training (``robust.mode``): one batch's loss, and each mode's
noise detector.

* ``none``: InfoNCE (symmetric, tau = ``optim.temperature``) of composed queries f(r, m) against the
  frozen target features, every triplet.
* ``small-loss`` (TME / DivideMix style): at the start of each epoch after the warm-up, every
  triplet's InfoNCE loss under the current model (eval mode, in batches of the training size), a
  two-component Gaussian mixture on the losses (scikit-learn), P(clean) = posterior of the low-mean
  component; triplets below ``gmm_threshold`` leave the loss for that epoch.
* ``gfq``: per batch, ConeSep's fidelity through the model being trained
  (:func:`demind.fidelity.composed_boundary`: Gaussian stand-in references and targets, the batch's
  texts permuted, K pairings), F = sigmoid((cos(f(r, m), t) - B) / tau_B); F < omega leaves the loss.
* ``conesep``: L_robust (the ``gfq`` loss) + zeta * L_intra (NBL, :func:`demind.robust.nbl_loss`,
  F_neg = f(r, P_neg)) + kappa * L_ul (BTU, :func:`demind.robust.btu_loss`: masked entropic OT).
  Warm-up epochs: InfoNCE on every triplet + zeta * L_intra (the anchors learn first).
* ``conesep-nobtu``: ``conesep`` without L_ul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from demind.fidelity import composed_boundary, fidelity_from_similarity
from demind.losses import Gather, per_sample_info_nce, weighted_mean
from demind.robust import btu_loss, gmm_clean_probability, nbl_loss
from demind.triplets.config import TripletRobustConfig

GFQ_MODES = ("gfq", "conesep", "conesep-nobtu")
NBL_MODES = ("conesep", "conesep-nobtu")


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class ProcessShare:
    """This process's part of the work when several processes train (``accelerate launch``).

    rows: the rows of each global batch this process composes (with gradients); gather: the
    queries of every process, with gradients (:func:`demind.training.make_gather`; None in one
    process); total: sums a tensor over processes (each holds its rows, zeros elsewhere); agree:
    the main process's value of a tensor in every process. The defaults are one process."""

    index: int = 0
    count: int = 1
    gather: Gather | None = None
    total: Callable[[torch.Tensor], torch.Tensor] = _same
    agree: Callable[[torch.Tensor], torch.Tensor] = _same

    def rows(self, batch_size: int) -> slice:
        """This process's slice of a global batch of ``batch_size`` (a multiple of ``count``)."""
        per = batch_size // self.count
        return slice(self.index * per, (self.index + 1) * per)

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) every process's rows of ``x`` (this process's share of the batch), with gradients."""
        return x if self.gather is None else self.gather(x)[0]


ONE_PROCESS = ProcessShare()


@torch.no_grad()
def batch_fidelity(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, k: int,
                   generator: torch.Generator) -> torch.Tensor:
    """(B,) GFQ fidelity of a batch through ``model`` (eval mode for the scoring, restored after)."""
    was_training = model.training
    model.eval()
    boundary = composed_boundary(model, ref, text, target, k, generator)
    sims = F.cosine_similarity(model(ref, text), F.normalize(target.float(), dim=-1), dim=-1)
    model.train(was_training)
    return fidelity_from_similarity(sims, boundary)


@torch.no_grad()
def per_sample_losses(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, scale: float,
                      batch_size: int, order: torch.Tensor, share: ProcessShare = ONE_PROCESS) -> torch.Tensor:
    """(N,) every triplet's InfoNCE loss under ``model`` (eval mode), in batches of ``batch_size``
    along ``order`` (the negatives of a loss are its batch's other targets, as in training).
    Several processes score every ``share.count``-th batch each and sum the (N,) results: every
    process gets all N losses, the same ones (each row comes from one process, zeros elsewhere)."""
    was_training = model.training
    model.eval()
    losses = torch.zeros(ref.shape[0])
    for number, start in enumerate(range(0, len(order), batch_size)):
        if number % share.count != share.index:
            continue
        rows = order[start : start + batch_size]
        query = model(ref[rows], text[rows])
        losses[rows] = per_sample_info_nce(query, F.normalize(target[rows].float(), dim=-1), scale).cpu()
    model.train(was_training)
    return share.total(losses)


def batch_loss(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, cfg: TripletRobustConfig,
               scale: float, *, after_warmup: bool, clean_prior: torch.Tensor | None,
               generator: torch.Generator, forward=None, share: ProcessShare = ONE_PROCESS
               ) -> dict[str, torch.Tensor]:
    """The loss of one batch under ``cfg.mode`` and its terms ("loss", "nce", "intra", "ul", "kept": share
    of the batch in L_robust). ``clean_prior``: (B,) bool from small-loss's epoch GMM (else None).

    ref, text, target: (B, D) the global batch. This process composes its rows ``share.rows(B)``
    through ``forward`` (the model as Accelerate prepared it; default ``model``) and gathers every
    process's queries with gradients, so each process computes the one-process loss of the whole
    batch. The gather's backward sums the P processes' (equal) gradients into each process's rows
    and data parallelism averages them: the update is the one-process update of the global batch.
    GFQ's fidelity is computed on the whole batch (its boundary is fitted on the batch) and taken
    from the main process, so every process filters the same rows."""
    forward = forward if forward is not None else model
    rows = share.rows(ref.shape[0])
    with_negative = cfg.mode in NBL_MODES
    out = forward(ref[rows], text[rows], with_negative=with_negative)
    query, negative = (share.all_rows(o) for o in out) if with_negative else (share.all_rows(out), None)
    target_n = F.normalize(target.float(), dim=-1)
    per = per_sample_info_nce(query, target_n, scale)
    clean = None
    if after_warmup and cfg.mode == "small-loss":
        clean = clean_prior
    elif after_warmup and cfg.mode in GFQ_MODES:
        clean = share.agree(batch_fidelity(model, ref, text, target, cfg.pairings, generator) >= cfg.omega)
    nce = weighted_mean(per, clean.float() if clean is not None else None)
    zero = nce.new_zeros(())
    terms = {"nce": nce, "intra": zero, "ul": zero,
             "kept": clean.float().mean() if clean is not None else nce.new_ones(())}
    loss = nce
    if cfg.mode in NBL_MODES:
        terms["intra"] = nbl_loss(negative, target_n, query, cfg.nu)
        loss = loss + cfg.zeta * terms["intra"]
        if after_warmup and cfg.mode == "conesep":
            terms["ul"], _ = btu_loss(query, target_n, negative, ~clean, scale, cfg.gamma, cfg.sinkhorn_reg,
                                      cfg.sinkhorn_iters)
            loss = loss + cfg.kappa * terms["ul"]
    terms["loss"] = loss
    return terms


@torch.no_grad()
def noise_scores(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, cfg: TripletRobustConfig,
                 scale: float, batch_size: int, seed: int) -> torch.Tensor:
    """(N,) each triplet's noise score under the mode's own detector (higher = more likely noisy):
    1 - F (GFQ modes, batches in index order), 1 - P(clean) (small-loss), the loss itself (none)."""
    order = torch.arange(ref.shape[0])
    if cfg.mode in GFQ_MODES:
        generator = torch.Generator().manual_seed(seed)
        scores = torch.zeros(ref.shape[0])
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            scores[rows] = 1 - batch_fidelity(model, ref[rows], text[rows], target[rows], cfg.pairings,
                                              generator).cpu()
        return scores
    losses = per_sample_losses(model, ref, text, target, scale, batch_size, order)
    return 1 - gmm_clean_probability(losses, seed) if cfg.mode == "small-loss" else losses
