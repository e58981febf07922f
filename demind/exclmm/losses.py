"""ExclMM losses (paper Eq. 2-4, 12-13, 15-17), as we read them (see demind/exclmm/__init__.py).

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
