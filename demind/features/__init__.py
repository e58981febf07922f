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
:func:`cache_slug`), the identity refusal, the staleness check, the writer and the reader are the
one embedding cache's (:mod:`demind.embedding_cache`), shared with evaluation galleries, the
search index and ExclMM.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from demind.logs import progress_bar
from demind.settings import resolve_workers

from demind.data import ReaderStats, read_tar_samples, with_pixels
from demind.embedding_cache import (EmbeddingCacheError, cache_identity, cache_slug, check_backbone, read_record,
                                    read_tensors, stale_reason, write_entry)
from demind.features.cache_upgrade import check_unoriented
from demind.io import check_output_dir
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
__all__ = ["CACHE_FORMAT", "DECODE", "FeatureCacheError", "ShardFeatureCache", "build_feature_cache", "cache_dir_for",
           "cache_identity", "cache_slug", "check_identity", "default_cache_dir", "features_off"]


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


# --------------------------------------------------------------------------- building


class ShardImageBatches(IterableDataset):
    """Decoded image batches of whole shards; each shard is read by one worker, in order.

    Yields dict(shard, keys, pixels (b, 3, H, W) or None, original, rewritten, intent,
    last, counts); the batch with ``last`` closes its shard.
    """

    def __init__(self, shards: list[str], transform: Any, batch_size: int, missing_text: str):
        super().__init__()
        self.shards, self.transform = shards, transform
        self.batch_size, self.missing_text = batch_size, missing_text

    def _shard_batches(self, shard: str) -> Iterator[dict[str, Any]]:
        stats = ReaderStats()
        rows: list[dict[str, Any]] = []

        def emit(last: bool) -> dict[str, Any]:
            batch = dict(shard=shard, keys=[r["key"] for r in rows],
                         pixels=torch.stack([r["pixels"] for r in rows]) if rows else None,
                         original=[r["original"] for r in rows], rewritten=[r["rewritten"] for r in rows],
                         intent=[r["intent"] for r in rows], last=last, counts=stats.take())
            rows.clear()
            return batch

        for sample in read_tar_samples(shard, self.missing_text, stats):
            for label in sample.pop("fallbacks"):
                stats.add(f"fallback_{label}")
            if with_pixels(sample, self.transform, stats) is None:
                continue
            rows.append(sample)
            if len(rows) == self.batch_size:
                yield emit(last=False)
        yield emit(last=True)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for shard in self.shards[worker::num_workers]:
            yield from self._shard_batches(shard)




def write_shard_cache(directory: Path, shard: str, identity: dict[str, Any], parts: dict[str, list],
                      counts: dict[str, int], dtype: torch.dtype) -> dict[str, Any]:
    """Write one shard's tensors, then its index json (the done-marker): :func:`demind.embedding_cache.write_entry`."""
    tensors_path, _ = cache_files(directory, shard)
    emb = {name: torch.cat(parts[name]) if parts[name] else torch.zeros(0, 0)
           for name in ("image_emb", "teacher_emb", "rew_emb")}
    # fidelity from the stored (possibly bf16) values, so it equals what a reader recomputes
    emb = {name: value.to(dtype) for name, value in emb.items()}
    fidelity, gfq = shard_fidelity(shard, emb)
    index = dict(format=CACHE_FORMAT, backbone=identity, shard=str(shard), dtype=str(dtype).removeprefix("torch."),
                 shard_fingerprint=shard_fingerprint(shard), decode=DECODE, gfq=gfq,
                 num_samples=len(parts["keys"]), counts=counts, keys=parts["keys"],
                 original=parts["original"], rewritten=parts["rewritten"], intent=parts["intent"])
    write_entry(tensors_path.with_suffix(""), {**emb, **fidelity}, index)
    return index


def shard_fidelity(shard: str, emb: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """GFQ fidelity of T_int and T_rew over the shard's pool: ({"fidelity_int": (N,), "fidelity_rew": (N,)}
    float32, {kind: {"boundary", "tau", "k"}}). Seeded by the shard's name, so a rebuild writes the same values."""
    import hashlib

    from demind.fidelity import gfq_fidelity
    from demind.schema import GFQ_PAIRINGS

    fidelity, gfq = {}, {}
    for kind, name in (("int", "teacher_emb"), ("rew", "rew_emb")):
        if emb[name].numel() == 0:
            fidelity[f"fidelity_{kind}"] = torch.zeros(0)
            continue
        seed = int.from_bytes(hashlib.sha256(f"gfq/{shard_name(shard)}/{kind}".encode()).digest()[:8], "little") >> 1
        generator = torch.Generator().manual_seed(seed)
        values, boundary = gfq_fidelity(emb["image_emb"], emb[name], GFQ_PAIRINGS, generator)
        fidelity[f"fidelity_{kind}"] = values.float().contiguous()
        gfq[kind] = {"boundary": boundary.boundary, "tau": boundary.tau, "k": GFQ_PAIRINGS}
    return fidelity, gfq


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


@torch.no_grad()
def build_feature_cache(shards: list[str], directory: str | Path, backbone: Any, *, batch_size: int = 256,
                        num_workers: int = 4, missing_text: str = "error", dtype: str = "float32",
                        device: str | torch.device = "cpu", progress: bool = True) -> dict[str, Any]:
    """Cache image, T_int (teacher) and T_rew embeddings and GFQ fidelity of every shard not yet cached in ``directory``.

    ``backbone`` is a ``FrozenCLIP``.  Returns a summary: shards built/skipped, samples,
    skip/fallback counts, seconds.
    """
    directory = check_output_dir(directory)  # a read-only or full disk fails before any encoding
    identity = cache_identity(backbone)
    todo = list(shards_to_build(directory, shards, identity))
    logger.info("feature cache %s: %d shards to build, %d already done", directory, len(todo), len(shards) - len(todo))
    backbone = backbone.to(device)
    start, totals, samples = time.time(), Counter(), 0
    parts_by_shard: dict[str, dict[str, list]] = {}
    # Workers decode whole shards in parallel; pinned batches copy to the GPU asynchronously.
    loader = DataLoader(ShardImageBatches(todo, backbone.preprocess, batch_size, missing_text),
                        batch_size=None, num_workers=min(resolve_workers(num_workers), len(todo)),
                        pin_memory=torch.device(device).type == "cuda")
    bar = progress_bar(total=len(todo), desc="feature cache", unit="shard", disable=not progress)
    for batch in loader:
        parts = parts_by_shard.setdefault(batch["shard"], dict(
            keys=[], original=[], rewritten=[], intent=[], image_emb=[], teacher_emb=[], rew_emb=[],
            counts=Counter()))
        parts["counts"].update(batch["counts"])
        if batch["keys"]:
            parts["image_emb"].append(backbone.encode_image(batch["pixels"].to(device)).cpu())
            truncated = backbone.text_counts["truncated"]
            parts["teacher_emb"].append(backbone.encode_text(batch["intent"]).pooled.float().cpu())
            # T_int longer than the context is cut (from its end); counted with the shard's skips
            if backbone.text_counts["truncated"] > truncated:
                parts["counts"]["intent_text_truncated"] += backbone.text_counts["truncated"] - truncated
            truncated = backbone.text_counts["truncated"]
            # T_rew's embedding: GFQ scores it against the image (demind.fidelity)
            parts["rew_emb"].append(backbone.encode_text(batch["rewritten"]).pooled.float().cpu())
            if backbone.text_counts["truncated"] > truncated:
                parts["counts"]["rewritten_text_truncated"] += backbone.text_counts["truncated"] - truncated
            for name in ("keys", "original", "rewritten", "intent"):
                parts[name].extend(batch[name])
        if batch["last"]:
            done = parts_by_shard.pop(batch["shard"])
            counts = dict(done.pop("counts"))
            write_shard_cache(directory, batch["shard"], identity, done, counts, DTYPES[dtype])
            totals.update(counts)
            samples += len(done["keys"])
            bar.update(1)
    bar.close()
    return dict(directory=str(directory), shards_built=len(todo), shards_skipped=len(shards) - len(todo),
                samples=samples, counts=dict(totals), seconds=round(time.time() - start, 2))
