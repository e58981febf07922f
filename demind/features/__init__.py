"""Frozen-feature cache: run the frozen encoders over the intent shards once.

The image tower and the teacher text embedding of T_int never change during training,
so ``demind-features --config configs/train/paper.yaml`` (:mod:`demind.cli.features`) computes, per shard,

* ``image_emb`` (N, D): ``FrozenCLIP.encode_image`` of each image (raw, not normalised),
* ``teacher_emb`` (N, D): ``FrozenCLIP.encode_text(T_int).pooled`` (raw, not normalised),
* ``rew_emb`` (N, D): ``FrozenCLIP.encode_text(T_rew).pooled`` (raw, not normalised),
* ``fidelity_int``, ``fidelity_rew`` (N,) float32: GFQ fidelity of T_int and T_rew against
  the image (:mod:`demind.fidelity`; the pool is the shard), computed from the tensors above,

and writes them with the sample keys and the three texts (the trainer still samples the
target description per step).  One cache per shard, two files:

* ``<shard>.safetensors`` -- the tensors, written to a temp file then renamed;
* ``<shard>.json`` -- keys, texts, counts, GFQ boundaries, the backbone identity and the
  shard's fingerprint (tar size and stats file digest) and how its images were decoded
  (``decode``: :data:`DECODE`); written last, so it is the done-marker: a rerun skips shards
  whose json exists and rebuilds the others. A cache of an older format, or of a shard that was
  rewritten since (e.g. with other noise settings), is rebuilt, logged. A json without ``decode``
  was written when images were decoded without their EXIF orientation: it is reused (and the
  field recorded) when no image of its shard is stored rotated, else that shard is rebuilt
  (:mod:`demind.features.cache_upgrade`; the same rule for the builder and the trainer).

The trainer reads one shard at a time (memory stays flat as shards grow), refuses a
cache made with another backbone, and then reads and decodes no image. The key rule (folder
:func:`~demind.embedding_cache.cache_slug`), the identity refusal, the staleness check, the writer and the reader are the
one embedding cache's (:mod:`demind.embedding_cache`), shared with evaluation galleries, the
search index and ExclMM.

Modules: ``cache`` (the read side: folders, files, what is reused, :class:`ShardFeatureCache`) and
``build`` (the write side: :func:`build_feature_cache`).
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.features.build import build_feature_cache, shard_fidelity
    from demind.features.cache import (
        CACHE_FORMAT, DECODE, FeatureCacheError, ShardFeatureCache, cache_dir_for, cache_files, check_identity,
        default_cache_dir, features_off, read_index, shard_fingerprint)

# names resolved on first use
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.features.build": ["build_feature_cache", "shard_fidelity"],
    "demind.features.cache": ["CACHE_FORMAT", "DECODE", "FeatureCacheError", "ShardFeatureCache", "cache_dir_for",
                              "cache_files", "check_identity", "default_cache_dir", "features_off", "read_index",
                              "shard_fingerprint"],
})

__all__ = ["CACHE_FORMAT", "DECODE", "FeatureCacheError", "ShardFeatureCache", "build_feature_cache", "cache_dir_for",
           "cache_files", "check_identity", "default_cache_dir", "features_off", "read_index", "shard_fidelity",
           "shard_fingerprint"]
