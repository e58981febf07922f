"""Hard negatives in the contrastive loss, beside the in-batch ones (MegaPairs's training).

Generated triplets (``data.source=generated``, ``megapairs``) carry per triplet the images its pair
was mined beside (the query's neighbours that are not its target). With ``data.hard_negatives`` = H
> 0 each composed query q_i is scored against the batch's targets t_1..t_B *and* its own hard
negatives n_i1..n_iH:

    L_i = 1/2 [ CE(tau^-1 [q_i.t_1 .. q_i.t_B, q_i.n_i1 .. q_i.n_iH], i) + CE(tau^-1 [t_i.q_1 .. t_i.q_B], i) ]

the symmetric InfoNCE of :func:`demind.losses.per_sample_info_nce` with H more columns in the query ->
target direction (padding masked out where a triplet has fewer than H); with no hard negatives it is
that loss exactly. It trains under ``robust.mode=none`` (the noise modes keep in-batch negatives).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from demind.retrieval import ImageFeatureCache, encode_image_refs


@dataclass
class HardNegatives:
    """(N, H, D) raw frozen features of each triplet's hard negatives and the (N, H) bool mask of real ones."""

    features: torch.Tensor
    mask: torch.Tensor

    def batch(self, rows: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[rows.cpu()].to(device), self.mask[rows.cpu()].to(device)


def hard_negative_features(backbone, triplets: list, cache_dir: str | Path, source: str, h: int,
                           batch_size: int = 256, progress: bool = True) -> HardNegatives | None:
    """Up to ``h`` hard negatives per triplet (its first ones), encoded once each through the triplet
    image cache (:class:`demind.retrieval.ImageFeatureCache`, the folder of the triplets' own images);
    None when ``h`` is 0 or no triplet has one."""
    lists = [tuple(getattr(t, "hard_negatives", ()))[:h] for t in triplets]
    if h <= 0 or not any(lists):
        return None
    refs = list({r.name: r for refs in lists for r in refs}.values())
    cache = ImageFeatureCache.for_backbone(cache_dir, backbone, f"triplets-{source}", "train")
    found, _ = encode_image_refs(backbone, refs, cache, "gallery", batch_size, 0, progress=progress,
                                 desc="hard negatives")
    dim = next(iter(found.values())).shape[-1]
    features, mask = torch.zeros(len(triplets), h, dim), torch.zeros(len(triplets), h, dtype=torch.bool)
    for i, refs_i in enumerate(lists):
        for j, ref in enumerate(refs_i):
            features[i, j], mask[i, j] = found[ref.name].float(), True
    return HardNegatives(features, mask)


def hard_negative_info_nce(query: torch.Tensor, target: torch.Tensor, hard: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """(B,) the loss above. query, target: (B, D) L2-normalised; hard: (B, H, D) raw; mask: (B, H) bool."""
    labels = torch.arange(query.shape[0], device=query.device)
    hard = F.normalize(hard.float(), dim=-1)
    in_batch = scale * query @ target.T
    own = (scale * torch.einsum("bd,bhd->bh", query, hard)).masked_fill(~mask, float("-inf"))
    forward = F.cross_entropy(torch.cat([in_batch, own], dim=1), labels, reduction="none")
    backward = F.cross_entropy(scale * target @ query.T, labels, reduction="none")
    return 0.5 * (forward + backward)


def hard_negative_loss(forward, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, hard: torch.Tensor,
                       mask: torch.Tensor, scale: float, share) -> dict[str, torch.Tensor]:
    """One batch's terms ("loss", "nce", "kept") under ``robust.mode=none`` with hard negatives.

    ref, text, target: (B, D) the global batch, hard (B, H, D), mask (B, H); this process composes its
    rows ``share.rows(B)`` through ``forward`` and gathers every process's queries with gradients, as
    :func:`demind.triplets.modes.batch_loss` does, so several processes compute the one-process loss."""
    rows = share.rows(ref.shape[0])
    query = share.all_rows(forward(ref[rows], text[rows]))
    nce = hard_negative_info_nce(query, F.normalize(target.float(), dim=-1), hard, mask, scale).mean()
    return {"loss": nce, "nce": nce, "kept": nce.new_ones(())}
