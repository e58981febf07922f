"""The optional quality stage of data generation: GFQ fidelity of each output.

With ``quality.fidelity_clip`` set, every generated T_rew and T_int is scored against its
image with :mod:`demind.fidelity`'s GFQ (a frozen open_clip CLIP; F = sigmoid((s - B) / tau)).
The noise boundary B is estimated on a rolling pool of the most recent ``fidelity_pool``
samples of the shard (a chunk alone can be a single image, too few for a boundary), so a
sample's score depends on its shard's samples up to its own chunk: the same input gives the
same scores, and a shard that is redone after a kill recomputes them from its start. Scores go into the
sample's ``generation.fidelity``; a score below omega adds the flag
``<stage>:low_fidelity``. Nothing is dropped: training decides (``noise.mode``).
"""

from __future__ import annotations

import logging
from collections import deque

import torch
import torch.nn.functional as F
from PIL import Image

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig, GFQ_PAIRINGS
from demind.fidelity import fidelity_from_similarity, noise_boundary, pair_similarity

from .config import QualityConfig

logger = logging.getLogger(__name__)

LOW_FIDELITY = "low_fidelity"


class FidelityScorer:
    """Scores (image, text) pairs of successive chunks; keeps the boundary's rolling pool."""

    def __init__(self, backbone: FrozenCLIP, omega: float, pool: int, seed: int = 0):
        self.backbone = backbone
        self.omega = omega
        self.seed = seed
        self._pool: dict[str, deque] = {}
        self._pool_size = pool
        self._images: deque = deque(maxlen=pool)

    @classmethod
    def from_config(cls, quality: QualityConfig, seed: int = 0, device: str = "cpu") -> "FidelityScorer":
        backbone = FrozenCLIP(BackboneConfig(name=quality.fidelity_clip, pretrained=quality.fidelity_pretrained),
                              device)
        logger.info("fidelity stage: %s (%s), omega %.2f, pool %d", quality.fidelity_clip,
                    quality.fidelity_pretrained or "random init", quality.fidelity_omega, quality.fidelity_pool)
        return cls(backbone, quality.fidelity_omega, quality.fidelity_pool, seed)

    def reset(self) -> None:
        """Forget the pool (a new shard starts its own, so a rerun of one shard scores alike)."""
        self._images.clear()
        self._pool.clear()

    @torch.no_grad()
    def _embed_images(self, images: list[Image.Image]) -> torch.Tensor:
        pixels = torch.stack([self.backbone.preprocess(im) for im in images]).to(self.backbone.device)
        with self.backbone.autocast():
            return F.normalize(self.backbone.encode_image(pixels).float(), dim=-1).cpu()

    @torch.no_grad()
    def _embed_texts(self, texts: list[str]) -> torch.Tensor:
        with self.backbone.autocast():
            return F.normalize(self.backbone.encode_text(texts).pooled.float(), dim=-1).cpu()

    def score(self, images: list[Image.Image], texts: dict[str, list[str]]) -> list[dict[str, float]]:
        """Per sample, stage -> fidelity in (0, 1). ``texts``: stage -> one text per image."""
        image_emb = self._embed_images(images)  # (N, D)
        self._images.extend(image_emb)
        pool_images = torch.stack(list(self._images))
        scores: list[dict[str, float]] = [{} for _ in images]
        for stage, batch in texts.items():
            if len(batch) != len(images):
                raise ValueError(f"fidelity stage: {len(batch)} {stage} texts for {len(images)} images")
            text_emb = self._embed_texts(batch)
            pool = self._pool.setdefault(stage, deque(maxlen=self._pool_size))
            pool.extend(text_emb)
            # seeded by the pool's length, so the draw does not depend on how chunks were cut
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + len(pool))
            boundary = noise_boundary(pool_images, torch.stack(list(pool)), GFQ_PAIRINGS, generator)
            for i, f in enumerate(fidelity_from_similarity(pair_similarity(image_emb, text_emb), boundary).tolist()):
                scores[i][stage] = round(f, 4)
        return scores

    def flags(self, scores: dict[str, float]) -> list[str]:
        """``<stage>:low_fidelity`` for every stage scored below omega."""
        return [f"{stage}:{LOW_FIDELITY}" for stage, f in scores.items() if f < self.omega]
