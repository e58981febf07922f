"""ExclMM losses (paper Eq. 2-4, 12-13, 15-17), as we read them (see demind/exclmm/__init__.py).

Two forms of Eq. 12, 15 and 16 live side by side (``space.contrastive``, ``query.contrastive``,
``query.triplet``):

* ``paper``: as written. Eq. 12 / 15: InfoNCE on l2-normalised codes at tau, both directions
  averaged (:func:`normalised_contrastive_loss`); Eq. 16: the triplet
  ``max(0, d(spar_ip, exc_cp) - d(spar_ip, exc_cx) + m)`` with cosine distance
  ``d = 1 - cos`` and the positive query encoded by F_theta too (:func:`paper_triplet_loss`).
* ``dot`` (the earlier variants): unnormalised dot products; Eq. 15 one direction against one
  sampled ground truth (:func:`query_contrastive_loss`); the triplet between a ground-truth
  image and the positive image for the exclusion query (:func:`triplet_loss`).

Shapes: N rows per batch; D the CLIP width; d the sparse width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reconstruction_loss(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Eq. 2 / Eq. 13: mean over rows of the squared L2 error, (N, D) x2 -> scalar."""
    return (x - x_hat).pow(2).sum(dim=1).mean()


def average_sparsity_loss(z: torch.Tensor, rho: float) -> torch.Tensor:
    """Eq. 3 (SPINE's ASL): sum over units of max(0, mean activation over the batch - rho)^2.

    z: (N, d) codes in [0, 1]; rho: the target fraction of rows each unit is active on.
    """
    return F.relu(z.mean(dim=0) - rho).pow(2).sum()


def partial_sparsity_loss(z: torch.Tensor) -> torch.Tensor:
    """Eq. 4 (SPINE's PSL): mean over rows of sum_j z_j (1 - z_j); pushes codes to 0 or 1."""
    return (z * (1 - z)).sum(dim=1).mean()


def contrastive_loss(a: torch.Tensor, b: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Eq. 12: symmetric InfoNCE on dot products / tau; row i of ``a`` matches row i of ``b``.

    a, b: (N, d) sparse codes (images, captions).
    """
    logits = a @ b.T / tau
    target = torch.arange(a.shape[0], device=a.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def query_contrastive_loss(queries: torch.Tensor, images: torch.Tensor, also_relevant: torch.Tensor,
                           tau: float = 1.0) -> torch.Tensor:
    """Eq. 15: InfoNCE of each query against its sampled ground-truth image (row i of ``images``),
    the other in-batch images as negatives -- except those that are ground truth of the query
    too (``also_relevant`` (N, N) bool, diagonal False), which are left out rather than pushed away.
    """
    logits = queries @ images.T / tau
    logits = logits.masked_fill(also_relevant, float("-inf"))
    return F.cross_entropy(logits, torch.arange(queries.shape[0], device=queries.device))


def triplet_loss(queries: torch.Tensor, relevant: torch.Tensor, positive_images: torch.Tensor,
                 margin: float) -> torch.Tensor:
    """Eq. 16: max(0, margin - s(q, ground truth) + s(q, positive image)), mean over rows.

    The *positive image* is the caption's own image, which shows the excluded object: the
    query must score it below a ground-truth image by ``margin``.
    """
    s_gt = (queries * relevant).sum(dim=1)
    s_pos = (queries * positive_images).sum(dim=1)
    return F.relu(margin - s_gt + s_pos).mean()


def normalised_contrastive_loss(a: torch.Tensor, b: torch.Tensor, tau: float = 1.0,
                                also_relevant: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 12 / Eq. 15 as written: symmetric InfoNCE on l2-normalised rows, logits cos / tau.

    a, b: (N, d); row i of ``a`` matches row i of ``b``. ``also_relevant`` (N, N) bool (diagonal
    False): pairs that are matches too (another ground-truth image of the same query), left out
    of both denominators rather than pushed apart; None = none.
    """
    logits = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T / tau
    if also_relevant is not None:
        logits = logits.masked_fill(also_relevant, float("-inf"))
        cols = logits.T.masked_fill(also_relevant.T, float("-inf"))
    else:
        cols = logits.T
    target = torch.arange(a.shape[0], device=a.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(cols, target))


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise 1 - cos(a_i, b_i): (N, d) x2 -> (N,)."""
    return 1.0 - F.cosine_similarity(a, b, dim=-1, eps=1e-8)


def paper_triplet_loss(positive_images: torch.Tensor, positive_queries: torch.Tensor,
                       exclusion_queries: torch.Tensor, margin: float) -> torch.Tensor:
    """Eq. 16 as written: mean over rows of max(0, d(ip, exc_cp) - d(ip, exc_cx) + m), d cosine.

    positive_images: (N, d) spar_ip, the positive caption's own image (it shows the excluded
    object); positive_queries: (N, d) exc_cp = F_theta(spar_cp), the encoded positive caption;
    exclusion_queries: (N, d) exc_cx = F_theta(spar_cx). The positive image must be closer to
    the positive query than to the exclusion query by ``m``.
    """
    gap = cosine_distance(positive_images, positive_queries) - cosine_distance(positive_images, exclusion_queries)
    return F.relu(gap + margin).mean()
