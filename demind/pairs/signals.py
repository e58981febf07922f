"""The neighbour signals' features of a whole corpus, through the feature caches.

* ``image`` and ``caption``: the frozen CLIP's ``image_emb`` and the text embedding of each sample's
  caption, from the **training feature cache** (:func:`demind.features.build_feature_cache`, one
  entry per shard, built where missing and reused where present; ``missing_text=original``). Its
  ``rew_emb`` is the caption the corpus gives: T_ori on input shards (no ``rew.txt``), T_rew on intent
  shards, the MLLM's recaption (MegaPairs mines Recap-DataComp's recaptions). A corpus of intent
  shards thus shares one cache with ``demind-train``.
* ``second``: a second visual encoder (a timm model; MegaPairs: DINOv2), one entry of the one
  embedding cache (:mod:`demind.embedding_cache`) per shard under
  ``<features dir>/<encoder slug>/NNNNN.{safetensors,json}``, keyed by the encoder's name and weights
  digest and by the shard's fingerprint.

Rows are L2-normalised and held as float16, one block per shard, which the rankers
(:class:`demind.search.Ranker`) search without joining: memory is N x D x 2 bytes per signal. Only
the keys every enabled signal holds are mined; an image missing or corrupt in the corpus is a
counted skip of the cache's reader.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from demind.data import ReaderStats, read_tar_samples, with_pixels
from demind.embedding_cache import (EmbeddingCacheError, check_backbone, entry_paths, read_record, read_tensors,
                                    stale_reason, write_entry)
from demind.features import build_feature_cache, cache_files, read_index, shard_fingerprint
from demind.identity import weights_fingerprint
from demind.logs import progress_bar
from demind.pairs.config import SecondEncoderConfig
from demind.shard_format import shard_name

log = logging.getLogger(__name__)

SECOND_FORMAT = "demind-pair-features/1"


@dataclass
class CorpusFeatures:
    """Row-aligned features of the corpus: ``keys`` (N,), ``shard_rows`` input shard -> (start, end)
    rows, ``blocks`` signal -> per-shard (n_i, D) float16 L2-normalised rows, ``skipped`` reason -> count."""

    keys: list[str]
    shard_rows: dict[str, tuple[int, int]]
    blocks: dict[str, list[torch.Tensor]]
    skipped: Counter = field(default_factory=Counter)
    skipped_by_shard: dict[str, Counter] = field(default_factory=dict)


def _normalised(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1).half()


# --------------------------------------------------------------------------- the second encoder


def parse_overrides(text: str) -> dict[str, Any]:
    """``'depth=1,embed_dim=32,img_size=28'`` -> {"depth": 1, ...} (ints, floats, true/false, strings)."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        low = value.strip().lower()
        if low in ("true", "false"):
            out[key.strip()] = low == "true"
            continue
        for cast in (int, float):
            try:
                out[key.strip()] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = value.strip()
    return out


class SecondEncoder:
    """A timm image model with its eval transform and identity; ``encode`` (B, 3, H, W) -> (B, D)."""

    def __init__(self, cfg: SecondEncoderConfig, device: str | torch.device = "cpu"):
        import timm
        from timm.data import create_transform, resolve_data_config

        kwargs = parse_overrides(cfg.overrides)
        pretrained = cfg.pretrained and not cfg.checkpoint
        with torch.random.fork_rng(devices=[]):  # a random init (tests) is the same for the same seed
            torch.manual_seed(cfg.seed)
            self.model = timm.create_model(cfg.name, pretrained=pretrained, num_classes=0, **kwargs)
        if cfg.checkpoint:
            from demind.errors import InputError
            from demind.tensor_files import load_safetensors_file, load_torch_file

            load = load_safetensors_file if cfg.checkpoint.endswith(".safetensors") else load_torch_file
            state = load(cfg.checkpoint, InputError, "second.checkpoint", "give a weights file of " + cfg.name)
            self.model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
        self.model.eval().requires_grad_(False).to(device)
        self.device = torch.device(device)
        data_cfg = resolve_data_config({}, model=self.model)
        size = getattr(getattr(self.model, "patch_embed", None), "img_size", None)
        if size:  # the size the model was built for (an img_size override), not its pretrained card's
            data_cfg["input_size"] = (3, *size)
            data_cfg["crop_pct"] = 1.0
        self.transform = create_transform(**data_cfg)
        self.identity = {"name": cfg.name, "overrides": kwargs or None,
                         "weights_sha256": weights_fingerprint(self.model)[:32]}

    @property
    def slug(self) -> str:
        digest = hashlib.sha256(repr(sorted(self.identity.items())).encode()).hexdigest()[:10]
        return "".join(c if c.isalnum() or c in "-_" else "-" for c in self.identity["name"]) + "-" + digest

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixels.to(self.device)).float().cpu()


def second_entry(directory: Path, encoder: SecondEncoder, shard: str) -> Path:
    return directory / encoder.slug / shard_name(shard)


def read_second(directory: Path, encoder: SecondEncoder, shard: str) -> tuple[list[str], torch.Tensor] | None:
    """(keys, (n, D) raw features) of a current entry of ``shard``, or None (none yet, or stale)."""
    tensor_path, record_path = entry_paths(second_entry(directory, encoder, shard))
    fix = f"delete {record_path} to encode that shard again"
    record = read_record(record_path, EmbeddingCacheError, fix)
    if record is None or stale_reason(record, SECOND_FORMAT, shard_fingerprint(shard)):
        return None
    check_backbone(record.get("encoder"), encoder.identity, record_path, fix)
    return record["keys"], read_tensors(tensor_path, EmbeddingCacheError, "pair features", fix)["features"]


@torch.no_grad()
def encode_second(directory: Path, encoder: SecondEncoder, shard: str, batch_size: int) -> tuple[list[str], torch.Tensor]:
    """Encode every readable image of ``shard`` with ``encoder`` and write the entry (record last)."""
    stats, keys, batch, parts = ReaderStats(), [], [], []
    for sample in read_tar_samples(shard, "original", stats):
        if with_pixels(sample, encoder.transform, stats) is None:  # counted as the CLIP cache counts it
            continue
        batch.append(sample["pixels"])
        keys.append(sample["key"])
        if len(batch) == batch_size:
            parts.append(encoder.encode(torch.stack(batch)))
            batch.clear()
    if batch:
        parts.append(encoder.encode(torch.stack(batch)))
    features = torch.cat(parts) if parts else torch.zeros(0, 0)
    write_entry(second_entry(directory, encoder, shard), {"features": features},
                {"format": SECOND_FORMAT, "encoder": encoder.identity, "fingerprint": shard_fingerprint(shard),
                 "keys": keys, "counts": stats.take()})
    return keys, features


# --------------------------------------------------------------------------- the whole corpus


def load_corpus_features(shards: list[str], directory: Path, backbone, signals: list[str],
                         second: SecondEncoder | None, *, batch_size: int, num_workers: int,
                         device: str, progress: bool) -> CorpusFeatures:
    """Every enabled signal's rows for every shard (building what the caches lack), row-aligned on
    the keys all of them hold; a key seen in an earlier shard is skipped (counted ``duplicate_key``)."""
    if {"image", "caption"} & set(signals):
        build_feature_cache(shards, directory, backbone, batch_size=batch_size, num_workers=num_workers,
                            missing_text="original", device=device, progress=progress)
    keys, shard_rows, seen = [], {}, set()
    blocks: dict[str, list[torch.Tensor]] = {s: [] for s in signals}
    skipped, by_shard = Counter(), {}
    for shard in progress_bar(shards, desc="pair features", unit="shard", disable=not progress):
        counts, rows = Counter(), {}
        if {"image", "caption"} & set(signals):
            index = read_index(directory, shard)
            tensors = read_tensors(cache_files(directory, shard)[0], EmbeddingCacheError, "feature cache",
                                   "delete it and rerun to encode that shard again")
            counts.update({k: v for k, v in (index.get("counts") or {}).items() if k.startswith("skipped")})
            for name, signal in (("image_emb", "image"), ("rew_emb", "caption")):
                if signal in signals:
                    rows[signal] = dict(zip(index["keys"], tensors[name]))
        if second is not None:
            found = read_second(directory, second, shard) or encode_second(directory, second, shard, batch_size)
            rows["second"] = dict(zip(*found))
        common = [k for k in next(iter(rows.values())) if all(k in r for r in rows.values())]
        counts["skipped_missing_features"] += sum(len(r) for r in rows.values()) // len(rows) - len(common)
        fresh = [k for k in common if k not in seen]
        counts["skipped_duplicate_key"] += len(common) - len(fresh)
        seen.update(fresh)
        shard_rows[shard] = (len(keys), len(keys) + len(fresh))
        keys += fresh
        for signal in signals:
            block = torch.stack([rows[signal][k] for k in fresh]) if fresh else torch.zeros(0, 1)
            blocks[signal].append(_normalised(block))
        counts = Counter({k: v for k, v in counts.items() if v})
        by_shard[shard] = counts
        skipped.update(counts)
    log.info("pair features: %d images in %d shards, signals %s; skipped %s", len(keys), len(shards),
             ", ".join(signals), dict(skipped) or "none")
    return CorpusFeatures(keys, shard_rows, blocks, skipped, by_shard)
