"""The mining job: one pair shard per input shard, the shard the unit of work.

``pairs-NNNNN.tar`` holds the pairs whose query lies in input shard ``NNNNN`` (schema in
shards/README.md); it is written through the one :class:`demind.shard_format.ShardWriter` (``.tmp``,
renamed when complete) and ``pairs-NNNNN_stats.json`` last marks it done, so a rerun skips finished
shards and a kill leaves no half shard. Each query shard is searched against the whole corpus, so
every run loads every signal's features (from the caches) and builds the rankers once.

Memory, for N corpus images: per enabled signal N x D x 2 bytes (float16 rows; a 1 M corpus with
ViT-L/14 image and caption features, D = 768, and DINOv2 ViT-L, D = 1024: 5.1 GB), plus the exact
ranker's score buffer N x 64 x 4 bytes (256 MB), plus the corpus index of the second stage; FAISS
HNSW adds a float32 copy (N x D x 4) per signal, IVF a float16 one, IVF-PQ D / 8 bytes a row.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from demind.errors import DemindError
from demind.pairs.config import MinePairsConfig
from demind.pairs.select import in_window_counts, quantiles, select_pairs, without_self
from demind.pairs.signals import CorpusFeatures
from demind.shard_format import SHARD_SUFFIX, JSON_FIELD, ShardOutput, ShardWriter, shard_name

log = logging.getLogger(__name__)

PAIR_PREFIX = "pairs-"
BYTES_PER_ROW = 2  # float16


class EmptyWindowError(DemindError, ValueError):
    """A signal's window keeps no pair: the similarities seen lie outside it."""


def pair_output(output: str | Path, input_shard: str) -> ShardOutput:
    """``shards/cc3m/00012.tar`` -> ``OUTPUT/pairs-00012.tar`` and its stats file."""
    return ShardOutput.of(Path(output) / f"{PAIR_PREFIX}{shard_name(input_shard)}{SHARD_SUFFIX}")


@dataclass
class PairsPlan:
    shards: list[str]
    done: list[str]
    todo: list[str]
    images: int | None  # from the input shards' stats files, where every shard has one


def make_plan(shards: list[str], output: str | Path, overwrite: bool) -> PairsPlan:
    done = [] if overwrite else [s for s in shards if pair_output(output, s).is_done()]
    counts = []
    for shard in shards:
        stats = ShardOutput.of(shard).load_stats() or {}
        counts.append(stats.get("successes", stats.get("written")))
    images = sum(counts) if all(isinstance(c, int) for c in counts) else None
    return PairsPlan(shards, done, [s for s in shards if s not in done], images)


def format_plan(plan: PairsPlan, cfg: MinePairsConfig) -> str:
    """The plan ``--dry-run`` prints: corpus, signals and windows, K, H, ranker, memory, shards."""
    n = plan.images
    windows = ", ".join(f"{s} ({w.low:g} < s < {w.high:g})" for s, w in cfg.windows().items())
    memory = (f"{len(cfg.windows())} signal(s) x N x D x {BYTES_PER_ROW} bytes"
              + (f", N = {n}: {len(cfg.windows()) * n * 768 * BYTES_PER_ROW / 2**30:.2f} GiB at D = 768" if n else "")
              + " + the exact ranker's buffer N x 64 x 4 bytes")
    lines = [f"corpus: {cfg.input} ({len(plan.shards)} shards, {n if n is not None else 'unknown number of'} images)",
             f"backbone: {cfg.backbone.name} ({cfg.backbone.pretrained or 'random init'})"
             + (f"; second encoder: {cfg.second.name}" if cfg.second.enabled else ""),
             f"signals: {windows}",
             f"per query: {cfg.mining.neighbours} neighbours per signal, at most K = {cfg.mining.targets} targets "
             f"and H = {cfg.mining.hard_negatives} hard negatives; ranker {cfg.mining.ranker}",
             f"memory: {memory}",
             f"output: {cfg.output}: {len(plan.done)} shards done, {len(plan.todo)} to mine"]
    return "\n".join(lines)


def check_window(signal: str, window: tuple[float, float], kept: int, seen: dict[str, float], shard: str) -> None:
    """A window that keeps no pair in the first shard mined is an error naming the similarities seen."""
    if kept:
        return
    low, high = window
    spread = ", ".join(f"{q} {v:.3f}" for q, v in seen.items()) or "none"
    raise EmptyWindowError(
        f"signal {signal}: the window {low:g} < s < {high:g} keeps no pair in shard {shard_name(shard)} "
        f"(neighbour similarities seen: {spread}); set {signal}.low / {signal}.high to a window the "
        f"similarities fall in, or {signal}.enabled=false")


def mine_shard(shard: str, index: int, features: CorpusFeatures, rankers: dict[str, Any], cfg: MinePairsConfig,
               output: str | Path, check_windows: bool) -> dict[str, Any]:
    """Mine the pairs of one input shard's queries and write its pair shard; returns its stats."""
    started = time.perf_counter()
    windows = {s: (w.low, w.high) for s, w in cfg.windows().items()}
    start, end = features.shard_rows[shard]
    kept = dict.fromkeys(windows, 0)
    samples = {s: [] for s in windows}
    records, pairs_by_signal, pairs, hard = [], dict.fromkeys(windows, 0), 0, 0
    k = min(cfg.mining.neighbours + 1, len(features.keys))
    for first in range(start, end, cfg.mining.query_batch):
        last = min(first + cfg.mining.query_batch, end)
        query_rows = torch.arange(first, last)
        found = {}
        for signal in windows:
            queries = features.blocks[signal][index][first - start:last - start].float()
            scores, rows = without_self(*rankers[signal].top_k(queries, k), query_rows)
            found[signal] = (scores, rows)
            kept[signal] += in_window_counts(scores, *windows[signal])
            samples[signal].append(scores[torch.isfinite(scores)].flatten()[:200_000])
        for row, selection in zip(query_rows.tolist(), select_pairs(found, windows, cfg.mining.targets,
                                                                     cfg.mining.hard_negatives)):
            if not selection.targets:
                continue
            targets = [{"key": features.keys[t], "signals": sig, "scores": sc} for t, sig, sc in selection.targets]
            for _, sig, _ in selection.targets:
                for s in sig:
                    pairs_by_signal[s] += 1
            pairs += len(targets)
            hard += len(selection.hard_negatives)
            records.append({"reference": features.keys[row], "targets": targets,
                            "hard_negatives": [features.keys[r] for r in selection.hard_negatives]})
    seen = {s: quantiles(torch.cat(v)) if v else {} for s, v in samples.items()}
    if check_windows and end > start:
        for signal, window in windows.items():
            check_window(signal, window, kept[signal], seen[signal], shard)
    out = pair_output(output, shard)
    with ShardWriter(out.tar) as writer:
        for record in records:
            writer.write({"__key__": record["reference"],
                          JSON_FIELD: json.dumps(record, ensure_ascii=False, sort_keys=True).encode("utf-8")})
    skipped = dict(features.skipped_by_shard.get(shard, {}))
    if end - start - len(records):
        skipped["no_target"] = end - start - len(records)
    elapsed = time.perf_counter() - started
    stats = {"shard": out.tar.name, "input": shard, "queries": end - start, "written": len(records),
             "pairs": pairs, "pairs_by_signal": pairs_by_signal, "in_window": kept, "hard_negatives": hard,
             "skipped": skipped, "skipped_total": sum(skipped.values()), "similarity_quantiles": seen,
             "elapsed_s": round(elapsed, 3), "pairs_per_s": round(pairs / elapsed, 1) if elapsed else None,
             "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out.mark_done(stats)
    return stats


def pairs_manifest(cfg: MinePairsConfig, corpus: dict[str, Any], backbone=None, second=None) -> dict[str, Any]:
    """The manifest of this run (backbone fields only once the models are loaded)."""
    from demind.embedding_cache import cache_identity

    windows = cfg.windows()
    return {"corpus": corpus,
            "backbone": cache_identity(backbone) if backbone is not None else None,
            "backbone_config": {"name": cfg.backbone.name, "pretrained": cfg.backbone.pretrained},
            "second_encoder": second.identity if second is not None else None,
            "signals": list(windows), "windows": {s: [w.low, w.high] for s, w in windows.items()},
            "k": cfg.mining.targets, "h": cfg.mining.hard_negatives, "neighbours": cfg.mining.neighbours,
            "ranker": cfg.mining.ranker, "recipe": cfg.recipe()}


def mine_pairs(cfg: MinePairsConfig, backbone=None) -> dict[str, Any]:
    """Mine every pair shard not yet done (all with ``cfg.overwrite``); returns a summary.

    Checks before any model loads: the corpus resolves, the output is writable, an earlier run in
    the output folder used the same corpus and recipe. ``backbone``: a loaded FrozenCLIP (default:
    built from ``cfg.backbone``)."""
    from demind.features import cache_dir_for
    from demind.embedding_cache import cache_slug
    from demind.io import check_output_dir
    from demind.pairs.corpus import corpus_record
    from demind.pairs.manifest import check_same_recipe, write_pairs_manifest
    from demind.pairs.signals import SecondEncoder, load_corpus_features
    from demind.search import Ranker

    corpus = corpus_record(cfg.input, "--input")
    plan = make_plan(corpus["shards"], cfg.output, cfg.overwrite)
    check_output_dir(cfg.output)
    if not cfg.overwrite:
        check_same_recipe(cfg.output, pairs_manifest(cfg, corpus), keys=("recipe",))
    if not plan.todo:
        return {"shards_done": len(plan.done), "shards_mined": 0}
    if backbone is None:
        from demind.backbone import build_backbone

        backbone = build_backbone(cfg.backbone, device=cfg.run.device)
    second = SecondEncoder(cfg.second, cfg.run.device) if cfg.second.enabled else None
    manifest = pairs_manifest(cfg, corpus, backbone, second)
    if not cfg.overwrite:
        check_same_recipe(cfg.output, manifest)
    for shard in plan.todo:
        pair_output(cfg.output, shard).remove(include_done=cfg.overwrite)
    write_pairs_manifest(cfg.output, manifest)
    directory = check_output_dir(cache_dir_for(cfg.features.dir, corpus["shards"], cache_slug(backbone)))
    signals = list(cfg.windows())
    started = time.perf_counter()
    features = load_corpus_features(corpus["shards"], directory, backbone, signals, second,
                                    batch_size=cfg.features.batch_size, num_workers=cfg.features.num_workers,
                                    device=cfg.run.device, progress=cfg.run.progress)
    features_s = time.perf_counter() - started
    rankers = {s: Ranker(features.blocks[s], cfg.mining.ranker) for s in signals}
    started, totals = time.perf_counter(), {"queries": 0, "written": 0, "pairs": 0, "hard_negatives": 0}
    for number, shard in enumerate(plan.todo):
        stats = mine_shard(shard, corpus["shards"].index(shard), features, rankers, cfg, cfg.output,
                           check_windows=number == 0)
        for key in totals:
            totals[key] += stats[key]
        log.info("%s: %d pairs from %d queries (%d with a target)", stats["shard"], stats["pairs"],
                 stats["queries"], stats["written"])
    mining_s = time.perf_counter() - started
    return {"shards_done": len(plan.done), "shards_mined": len(plan.todo), **totals,
            "skipped": dict(features.skipped), "features_s": round(features_s, 2), "mining_s": round(mining_s, 2),
            "pairs_per_s": round(totals["pairs"] / mining_s, 1) if mining_s else None}
