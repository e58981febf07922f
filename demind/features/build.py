"""The training feature cache's write side: decode each shard's images once (:class:`ShardImageBatches`),
run the frozen encoders, add the GFQ fidelities (:func:`shard_fidelity`) and write one cache per shard,
done-marker last (:func:`build_feature_cache`; ``demind-features``). What is reused is
:func:`demind.features.cache.shards_to_build`'s decision.
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

from demind.data import ReaderStats, read_tar_samples, with_pixels
from demind.embedding_cache import cache_identity, write_entry
from demind.features.cache import CACHE_FORMAT, DECODE, DTYPES, cache_files, shard_fingerprint, shards_to_build
from demind.io import check_output_dir
from demind.logs import progress_bar
from demind.settings import resolve_workers
from demind.shard_format import shard_name

logger = logging.getLogger(__name__)


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
