"""Symmetric contrastive losses of De-MINDS (seed paper Eq. 2-4).

L_distil pulls the intention embedding t* towards the frozen CLIP embedding of the MLLM's
pseudo-manipulation description; L_align pulls the composed query t_hat towards the image.
Both are CLIP's symmetric InfoNCE. For multi-process training the trainer passes features
gathered from every process (``torch.distributed.nn.all_gather`` keeps their gradients),
so each process scores its own rows against the global batch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from demind.model import ComposeOutput

Gather = Callable[[torch.Tensor], tuple[torch.Tensor, int]]


def per_sample_info_nce(
    a: torch.Tensor,
    b: torch.Tensor,
    logit_scale: torch.Tensor | float,
    a_all: torch.Tensor | None = None,
    b_all: torch.Tensor | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """(B,) per row i: half the sum of row i's a->b and b->a cross-entropies (see symmetric_info_nce)."""
    a_all = a if a_all is None else a_all
    b_all = b if b_all is None else b_all
    labels = torch.arange(a.shape[0], device=a.device) + offset
    logits_ab = logit_scale * a @ b_all.T
    logits_ba = logit_scale * b @ a_all.T
    return 0.5 * (F.cross_entropy(logits_ab, labels, reduction="none")
                  + F.cross_entropy(logits_ba, labels, reduction="none"))


def symmetric_info_nce(
    a: torch.Tensor,
    b: torch.Tensor,
    logit_scale: torch.Tensor | float,
    a_all: torch.Tensor | None = None,
    b_all: torch.Tensor | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Mean of the a->b and b->a cross-entropies over this process's rows.

    a, b: (B, D) L2-normalised, row i of a matches row i of b.
    a_all, b_all: (N, D) the global batch (defaults to a, b); this process's rows sit at
        ``offset : offset + B`` in them.
    Returns a scalar. With one process it equals CLIP's loss; averaged over processes it
    equals the single-process loss on the global batch.
    """
    return per_sample_info_nce(a, b, logit_scale, a_all, b_all, offset).mean()


def weighted_mean(losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """sum(w_i * l_i) / sum(w_i) of per-sample losses (B,); the plain mean when weights is None.

    All-zero weights give 0 (with a zero gradient), not NaN: a batch whose samples were all
    filtered out teaches nothing.
    """
    if weights is None:
        return losses.mean()
    weights = weights.to(losses)
    return (weights * losses).sum() / weights.sum().clamp(min=1e-12)


def _pair_loss(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, gather: Gather | None,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE of (a_i, b_i), weighted per row. Down-weighted or filtered samples still
    serve as negatives of the others: their images are true, only their rows' own loss is noisy."""
    if gather is None:
        return weighted_mean(per_sample_info_nce(a, b, scale), weights)
    a_all, offset = gather(a)
    b_all, _ = gather(b)
    return weighted_mean(per_sample_info_nce(a, b, scale, a_all, b_all, offset), weights)


def demind_losses(
    out: ComposeOutput,
    teacher_emb: torch.Tensor,
    image_emb: torch.Tensor,
    logit_scale: torch.Tensor,
    distil: bool = True,
    gather: Gather | None = None,
    align_weights: torch.Tensor | None = None,
    distil_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """L = L_distil(t*, teacher) + L_align(t_hat, v).

    teacher_emb: (B, D) frozen CLIP embedding of T_int; image_emb: (B, D) image embedding
    (either may be unnormalised). ``distil=False`` is the "w/o distillation" ablation.
    align_weights, distil_weights: optional (B,) per-sample weights (the noise modes filter
    and downweight, :mod:`demind.conesep`); each term is then sum(w l) / sum(w).
    Returns {"loss", "distil", "align"}; "distil" is reported (detached) even when unused.
    """
    teacher = F.normalize(teacher_emb.float(), dim=-1)
    image = F.normalize(image_emb.float(), dim=-1)
    align = _pair_loss(out.t_hat, image, logit_scale, gather, align_weights)
    distil_term = _pair_loss(out.t_star, teacher, logit_scale, gather, distil_weights)
    loss = align + distil_term if distil else align
    return {"loss": loss, "distil": distil_term if distil else distil_term.detach(), "align": align}
