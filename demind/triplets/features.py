"""Frozen features of training triplets, encoded once and cached.

Images go through the one image-feature cache of evaluation galleries
(:class:`demind.retrieval.ImageFeatureCache`, keyed per image by name and file), under
``<cache_dir>/<backbone>/triplets-<source>/train-<images>``, where ``<images>`` is a digest of the
image set (names, files and cache keys: version, decoding): runs on other triplets sharing one
``data.cache_dir`` write into their own folders, never into each other's ``part-00000``, and a
folder is only ever read for the images it was made from. Texts are one entry of the one embedding
cache (:mod:`demind.embedding_cache`), keyed by the backbone's identity and the sha256 of the texts
themselves: another set of texts (another noise rate, another file) is another entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from demind.embedding_cache import (
    EmbeddingCacheError, cache_identity, cache_slug, check_backbone, entry_paths, read_record, read_tensors,
    write_entry)
from demind.retrieval import ImageFeatureCache, encode_image_refs
from demind.triplets.readers import Triplet

log = logging.getLogger(__name__)

TEXT_FORMAT = "demind-triplet-texts/1"


@dataclass
class TripletFeatures:
    """Row-aligned raw frozen features of N triplets: reference (N, D), target (N, D)."""

    reference: torch.Tensor
    target: torch.Tensor


def image_features(backbone, triplets: list[Triplet], cache_dir: str | Path, source: str, batch_size: int = 256,
                   progress: bool = True) -> TripletFeatures:
    """Reference and target features of ``triplets`` (each image encoded once, from the cache where it is)."""
    refs = list({r.name: r for t in triplets for r in (t.reference, t.target)}.values())
    cache = ImageFeatureCache.for_backbone(cache_dir, backbone, f"triplets-{source}", f"train-{images_key(refs)}")
    features, _ = encode_image_refs(backbone, refs, cache, "gallery", batch_size, 0, progress=progress,
                                    desc="triplet images")
    reference = torch.stack([features[t.reference.name] for t in triplets]).float()
    target = torch.stack([features[t.target.name] for t in triplets]).float()
    return TripletFeatures(reference, target)


def images_key(refs: list) -> str:
    """The image set's key: 16 hex digits of a sha256 over the sorted names, cache keys and absolute
    paths (a cache key names only the file's last two path parts: two data folders holding
    ``img/0.png`` of one size and time must not share features)."""
    rows = sorted([r.name, r.cache_key, str(Path(r.path).absolute())] for r in refs)
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def texts_key(texts: list[str]) -> str:
    """sha256 of the texts (in order), the text entry's content key."""
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode("utf-8")).hexdigest()


def text_features(backbone, texts: list[str], cache_dir: str | Path, batch_size: int = 256) -> torch.Tensor:
    """(N, D) raw frozen text features of ``texts``; each distinct text encoded once; cached by content."""
    unique = sorted(set(texts))
    key = texts_key(unique)
    stem = Path(cache_dir) / cache_slug(backbone) / "triplet-texts" / key[:24]
    tensor_path, record_path = entry_paths(stem)
    fix = f"delete {tensor_path} and {record_path} to encode the texts again"
    record = read_record(record_path, EmbeddingCacheError, fix)
    if record is not None and record.get("format") == TEXT_FORMAT and record.get("texts_sha256") == key:
        check_backbone(record.get("backbone"), cache_identity(backbone), record_path, fix)
        encoded = read_tensors(tensor_path, EmbeddingCacheError, "text cache", fix)["features"]
    else:
        parts = []
        with torch.no_grad():
            for start in range(0, len(unique), batch_size):
                parts.append(backbone.encode_text(unique[start : start + batch_size]).pooled.float().cpu())
        encoded = torch.cat(parts) if parts else torch.zeros(0, backbone.embed_dim)
        write_entry(stem, {"features": encoded}, {"format": TEXT_FORMAT, "backbone": cache_identity(backbone),
                                                  "texts_sha256": key, "count": len(unique)})
        log.info("encoded %d distinct texts into %s", len(unique), tensor_path)
    row = {t: i for i, t in enumerate(unique)}
    return encoded[torch.tensor([row[t] for t in texts], dtype=torch.long)]
