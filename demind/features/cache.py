"""The training feature cache's read side: where a cache lies (``data.features``), its files, what a
shard's cache must match to be reused (format, the shard's fingerprint, the backbone, how images were
decoded: :func:`shards_to_build`, the builder's and the trainer's one rule) and :class:`ShardFeatureCache`,
which the trainer reads instead of images. The package docstring (:mod:`demind.features`) says what is cached.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from demind.embedding_cache import EmbeddingCacheError, check_backbone, read_record, read_tensors, stale_reason
from demind.features.cache_upgrade import check_unoriented
from demind.shard_format import shard_name

logger = logging.getLogger(__name__)

CACHE_FORMAT = "demind-feature-cache/2"  # /2: rew_emb and GFQ fidelity
DECODE = "exif-oriented"
"""How the cached images were decoded (each record's ``decode``): as a viewer shows them, EXIF
orientation applied (:func:`demind.data.decode_to_tensor`). Records written before have no ``decode``."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class FeatureCacheError(EmbeddingCacheError):
    """A feature cache that does not fit the shards or the backbone."""


OFF_VALUES = ("none", "null", "")
REBUILD = ("point data.features at a cache of this backbone, rebuild it with python -m demind.features, "
           "or set data.features=null to decode images")


def features_off(setting: str | None) -> bool:
    """True when ``data.features`` turns the cache off: null, or the strings none/null/'' (any case)."""
    return setting is None or str(setting).strip().lower() in OFF_VALUES


def default_cache_dir(shards: list[str], identity_str: str) -> Path:
    """``<folder of the first shard>/features/<backbone identity>``."""
    return Path(shards[0]).parent / "features" / identity_str


def cache_dir_for(setting: str | None, shards: list[str], identity_str: str) -> Path:
    """The folder ``data.features`` names: an explicit path, else (auto, or off) the default beside the shards.

    Off means "do not train on a cache", never a folder called ``none``.
    """
    if features_off(setting) or setting == "auto":
        return default_cache_dir(shards, identity_str)
    return Path(setting)


def cache_files(directory: str | Path, shard: str) -> tuple[Path, Path]:
    """(tensor file, index json) of ``shard``'s cache inside ``directory``."""
    base = Path(directory) / shard_name(shard)
    return base.with_suffix(".safetensors"), base.with_suffix(".json")


def read_index(directory: str | Path, shard: str) -> dict[str, Any] | None:
    """The done-marker json of a shard's cache, or None when the shard is not cached."""
    tensors, index = cache_files(directory, shard)
    if not tensors.is_file():
        return None
    return read_record(index, FeatureCacheError, "delete it and rerun python -m demind.features to rebuild that shard")


def shard_fingerprint(shard: str | Path) -> dict[str, Any]:
    """What identifies a shard's content cheaply: the tar's size and the digest of its stats
    file (the done-marker every writer leaves, which records the writer's config), if any."""
    import hashlib

    from demind.shard_format import stats_path

    tar, stats = Path(shard), stats_path(shard)
    digest = hashlib.sha256(stats.read_bytes()).hexdigest()[:16] if stats.is_file() else None
    return {"size": tar.stat().st_size if tar.is_file() else None, "stats_sha256": digest}


def is_stale(index: dict[str, Any], shard: str) -> str | None:
    """Why a shard's cache must be rebuilt (older format, rewritten shard, images decoded another
    way), or None (:func:`demind.embedding_cache.stale_reason`). A record without ``decode`` is not
    stale by itself: :func:`~demind.features.cache_upgrade.check_unoriented` decides from the shard's
    image headers."""
    stale = stale_reason(index, CACHE_FORMAT, shard_fingerprint(shard) if Path(shard).is_file() else None)
    if stale is None and index.get("decode", DECODE) != DECODE:
        stale = f"its images were decoded {index['decode']!r}, not {DECODE!r}"
    return stale


def check_identity(index: dict[str, Any], identity: dict[str, Any], where: Path) -> None:
    """Refuse a cache written by another backbone, naming both (the one refusal of
    :func:`demind.embedding_cache.check_backbone`)."""
    check_backbone(index.get("backbone"), identity, f"feature cache {where}", REBUILD, FeatureCacheError)


def shards_to_build(directory: Path, shards: list[str], identity: dict[str, Any]) -> dict[str, str]:
    """Shards without a current cache, in ``shards`` order, each with why (logged): none, an older
    format, a rewritten shard, or rotated images cached before EXIF orientation was applied
    (:func:`~demind.features.cache_upgrade.check_unoriented`). A cache of another backbone here is an
    error. The one decision of what is reused, for the builder and the trainer (:meth:`ShardFeatureCache.find`)."""
    todo: dict[str, str] = {}
    current: dict[str, tuple[dict[str, Any], Path]] = {}
    for shard in shards:
        index = read_index(directory, shard)
        if index is None:
            todo[shard] = "not cached"
            continue
        check_identity(index, identity, cache_files(directory, shard)[1])
        stale = is_stale(index, shard)
        if stale:
            logger.info("feature cache of %s is rebuilt: %s", shard_name(shard), stale)
            todo[shard] = stale
        else:
            current[shard] = (index, cache_files(directory, shard)[1])
    todo.update(check_unoriented(current, DECODE))
    return {shard: todo[shard] for shard in shards if shard in todo}


class ShardFeatureCache:
    """Read side of the cache: per-shard samples with embeddings instead of images."""

    def __init__(self, directory: str | Path, identity: dict[str, Any]):
        self.directory = Path(directory)
        self.identity = identity

    @classmethod
    def find(cls, directory: str | Path, shards: list[str], identity: dict[str, Any],
             required: bool) -> ShardFeatureCache | None:
        """The cache in ``directory`` if it holds every shard, checked against ``identity``; what
        counts as held is :func:`shards_to_build`'s rule, the builder's (a shard cached before EXIF
        orientation was applied counts only when none of its images is stored rotated).

        ``required`` (an explicit data.features path): a missing shard is an error.
        Otherwise (``auto``) an incomplete cache is reported and None returned.
        """
        directory = Path(directory)
        missing = shards_to_build(directory, shards, identity)
        if not missing:
            return cls(directory, identity)
        first, why = next(iter(missing.items()))
        why = "" if why == "not cached" else f": {why}"
        message = (f"feature cache {directory} lacks {len(missing)} of {len(shards)} shards "
                   f"(e.g. {shard_name(first)}{why}); build them with "
                   f"python -m demind.features --config <train config>")
        if required:
            raise FeatureCacheError(message)
        if len(missing) < len(shards):
            logger.warning("%s; decoding images instead", message)
        return None

    def _tensors(self, shard: str) -> dict[str, torch.Tensor]:
        """The tensors of ``shard``'s cache; a damaged file is one FeatureCacheError saying how to rebuild it."""
        tensors_path, index_path = cache_files(self.directory, shard)
        return read_tensors(tensors_path, FeatureCacheError, "feature cache",
                            f"delete it and {index_path.name}, then rerun demind-features (or "
                            f"python -m demind.features) to rebuild that shard")

    def samples(self, shard: str) -> Iterator[dict[str, Any]]:
        """Samples of ``shard`` in tar order: key, texts, image_emb (D,), teacher_emb (D,), rew_emb (D,)
        float32 and the GFQ fidelities fidelity_int, fidelity_rew (scalars)."""
        tensors_path, index_path = cache_files(self.directory, shard)
        index = read_index(self.directory, shard)
        if index is None:
            raise FeatureCacheError(f"feature cache {index_path} disappeared during training")
        tensors = self._tensors(shard)
        image_emb = tensors["image_emb"].float()
        teacher_emb = tensors["teacher_emb"].float()
        rew_emb = tensors["rew_emb"].float()
        fid_int, fid_rew = tensors["fidelity_int"].float(), tensors["fidelity_rew"].float()
        for i, key in enumerate(index["keys"]):
            yield dict(key=key, shard=shard, original=index["original"][i],
                       rewritten=index["rewritten"][i], intent=index["intent"][i],
                       image_emb=image_emb[i], teacher_emb=teacher_emb[i], rew_emb=rew_emb[i],
                       fidelity_int=fid_int[i], fidelity_rew=fid_rew[i])

    def fidelities(self, shards: list[str]) -> dict[str, torch.Tensor]:
        """GFQ fidelity of every sample of ``shards``, in shard then tar order: {"int": (N,), "rew": (N,)}."""
        out: dict[str, list[torch.Tensor]] = {"int": [], "rew": []}
        for shard in shards:
            tensors = self._tensors(shard)
            for kind in out:
                out[kind].append(tensors[f"fidelity_{kind}"].float())
        return {kind: torch.cat(parts) if parts else torch.zeros(0) for kind, parts in out.items()}
