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

import numpy as np
import torch
import torch.nn.functional as F

from demind.fidelity import composed_boundary, fidelity_from_similarity
from demind.losses import per_sample_info_nce, weighted_mean
from demind.robust import btu_loss, nbl_loss
from demind.triplets.config import TripletRobustConfig

GFQ_MODES = ("gfq", "conesep", "conesep-nobtu")
NBL_MODES = ("conesep", "conesep-nobtu")


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
                      batch_size: int, order: torch.Tensor) -> torch.Tensor:
    """(N,) every triplet's InfoNCE loss under ``model`` (eval mode), in batches of ``batch_size``
    along ``order`` (the negatives of a loss are its batch's other targets, as in training)."""
    was_training = model.training
    model.eval()
    losses = torch.zeros(ref.shape[0])
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        query = model(ref[rows], text[rows])
        losses[rows] = per_sample_info_nce(query, F.normalize(target[rows].float(), dim=-1), scale).cpu()
    model.train(was_training)
    return losses


def gmm_clean_probability(losses: torch.Tensor, seed: int) -> torch.Tensor:
    """(N,) posterior of the low-loss component of a 2-component GMM on min-max normalised losses."""
    from sklearn.mixture import GaussianMixture

    x = losses.double().numpy()
    x = (x - x.min()) / max(x.max() - x.min(), 1e-12)
    gmm = GaussianMixture(n_components=2, max_iter=20, tol=1e-2, reg_covar=5e-4, random_state=seed)
    gmm.fit(x.reshape(-1, 1))
    clean = int(np.argmin(gmm.means_.ravel()))
    return torch.from_numpy(gmm.predict_proba(x.reshape(-1, 1))[:, clean]).float()


def batch_loss(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, cfg: TripletRobustConfig,
               scale: float, *, after_warmup: bool, clean_prior: torch.Tensor | None,
               generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The loss of one batch under ``cfg.mode`` and its terms ("loss", "nce", "intra", "ul", "kept": share
    of the batch in L_robust). ``clean_prior``: (B,) bool from small-loss's epoch GMM (else None)."""
    query = model(ref, text)
    target_n = F.normalize(target.float(), dim=-1)
    per = per_sample_info_nce(query, target_n, scale)
    clean = None
    if after_warmup and cfg.mode == "small-loss":
        clean = clean_prior
    elif after_warmup and cfg.mode in GFQ_MODES:
        clean = batch_fidelity(model, ref, text, target, cfg.pairings, generator) >= cfg.omega
    nce = weighted_mean(per, clean.float() if clean is not None else None)
    zero = nce.new_zeros(())
    terms = {"nce": nce, "intra": zero, "ul": zero,
             "kept": clean.float().mean() if clean is not None else nce.new_ones(())}
    loss = nce
    if cfg.mode in NBL_MODES:
        negative = model.negative(ref)
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
