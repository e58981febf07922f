"""Data glue: the feature cache or decoded images, the per-process loader, and a batch's embeddings."""

from __future__ import annotations

from typing import Any

import torch

from demind.backbone import FrozenCLIP
from demind.data import StreamSpec, build_loader
from demind.schema import DataConfig
from demind.shard_format import resolve_shards
from demind.embedding_cache import cache_identity, cache_slug
from demind.features import ShardFeatureCache, default_cache_dir, features_off
from demind.training.config import TrainConfig
from demind.training.resume import TrainState


def find_feature_cache(data: DataConfig, shards: list[str], backbone: FrozenCLIP) -> ShardFeatureCache | None:
    """The feature cache to train on, or None to decode images (see DataConfig.features)."""
    if features_off(data.features):
        return None
    if data.features == "auto":
        directory = default_cache_dir(shards, cache_slug(backbone))
        if not directory.is_dir():
            return None
        return ShardFeatureCache.find(directory, shards, cache_identity(backbone), required=False)
    return ShardFeatureCache.find(data.features, shards, cache_identity(backbone), required=True)


def build_data(cfg: TrainConfig, accelerator, backbone: FrozenCLIP, state: TrainState, micro_batch: int):
    """Per-process DataLoader, positioned after the data a resumed run already consumed.

    ``micro_batch``: the per-process batch :func:`demind.training.loop.train` derived once at
    start-up (:func:`demind.training.accel.micro_batch_size`).
    Returns (loader, cache or None).
    """
    shards = resolve_shards(cfg.data.shards)
    cache = find_feature_cache(cfg.data, shards, backbone)
    rank, world = accelerator.process_index, accelerator.num_processes
    start = dict(state.resumed_positions[rank]) if state.resumed_positions is not None else {}
    # A stream that cannot continue exactly restarts on fresh seeds rather than repeating data.
    seed = cfg.run.seed if (start or state.step == 0) else cfg.run.seed + state.step
    spec = StreamSpec(shards=shards, batch_size=micro_batch, seed=seed, rank=rank,
                      world_size=world, shuffle_buffer=cfg.data.shuffle_buffer,
                      shards_per_group=cfg.data.shards_per_group, resample=cfg.data.resample,
                      missing_text=cfg.data.missing_text, targets=cfg.data.targets, start=start)
    loader = build_loader(spec, cfg.data.num_workers, transform=None if cache else backbone.preprocess, cache=cache)
    return loader, cache


def batch_rewritten_embeddings(batch: dict[str, Any], backbone: FrozenCLIP) -> torch.Tensor:
    """(B, D) raw frozen text embeddings of T_rew: from the feature cache, or the text tower."""
    if "rew_emb" in batch:
        return batch["rew_emb"].to(backbone.device)
    return backbone.encode_text(batch["rewritten"]).pooled


def batch_embeddings(batch: dict[str, Any], backbone: FrozenCLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """(image_emb, teacher_emb), both (B, D) raw: from the feature cache, or the frozen encoders."""
    if "image_emb" in batch:
        return batch["image_emb"].to(backbone.device), batch["teacher_emb"].to(backbone.device)
    return backbone.encode_image(batch["images"]), backbone.encode_text(batch["intents"]).pooled

