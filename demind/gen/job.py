"""The intent job: one input shard in, one intent shard plus its stats out, shard after shard
(run by the shared runner, :mod:`demind.gen.runner`, on either distributor).

Memory stays bounded: samples stream from the input tar, ``engine.chunk_size`` decoded
samples are in flight at a time, and results stream into the output tar.
A shard is redone from its start when a run was interrupted inside it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from demind.logs import progress_bar

from demind.config import to_dict
from demind.settings import resolve_device
from demind.gen.config import GenConfig
from demind.engines import Engine
from demind.gen.fidelity_stage import FidelityScorer
from demind.gen.generate import ChunkItem, ChunkOutput, IntentGenerator
from demind.gen.prompts import PromptSet
from demind.gen.plan import JobPlan, ShardTask
from demind.gen.reader import RawSample, SkippedSample, decode_and_shrink, iter_shard
from demind.shard_format import ShardOutput, ShardWriter, encode_sample
from demind.gen.runner import Column, JobSummary, format_summary, run_plan as run_jobs

logger = logging.getLogger(__name__)


@dataclass
class ShardStats:
    """Counters of one shard; :meth:`to_dict` is the ``{shard}_stats.json`` content."""

    samples_in: int = 0
    written: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_samples: list[dict[str, str]] = field(default_factory=list)
    flagged: Counter = field(default_factory=Counter)  # "stage:flag" -> samples kept with that flag
    samples_flagged: int = 0
    retried: Counter = field(default_factory=Counter)  # stage -> samples retried
    fixed_by_retry: Counter = field(default_factory=Counter)  # stage -> retried samples kept without flags
    text_tokens: dict[str, list[int]] = field(default_factory=lambda: {"rewrite": [], "intent": []})
    engine_prompt_tokens: int = 0
    engine_output_tokens: int = 0
    engine_prefilled_tokens: int = 0  # prompt tokens computed, retries included (a prefix cache saves the rest)
    engine_requested_tokens: int = 0  # prompt tokens of every request, retries included
    stage2_requests: int = 0  # stage-2 requests (retries included), each of which could reuse stage 1's prefix
    stage2_hits: int = 0  # of those, the ones the prefix cache served in part
    cache_reported: bool = True  # False: the engine did not say what its cache served

    def skip(self, item: SkippedSample) -> None:
        self.skipped[item.reason] += 1
        self.skipped_samples.append({"key": item.key, "reason": item.reason, "detail": item.detail})

    def add_output(self, out: ChunkOutput, extra_flags: list[str] | None = None) -> list[str]:
        """Count one written sample's stages; returns its flags as 'stage:flag' (``extra_flags``,
        already in that form, from the fidelity stage, are counted with them)."""
        flags = list(extra_flags or [])
        for stage, res in (("rewrite", out.rewrite), ("intent", out.intent)):
            if res is None:
                continue
            flags += [f"{stage}:{f}" for f in res.flags]
            if res.attempts > 1:
                self.retried[stage] += 1
                self.fixed_by_retry[stage] += not res.flags
            self.engine_prompt_tokens += res.prompt_tokens
            self.engine_output_tokens += res.output_tokens
            self.engine_prefilled_tokens += res.prefilled_tokens
            self.engine_requested_tokens += res.requested_tokens
            self.cache_reported &= res.cache_reported
        if out.rewrite is not None:  # two stages: stage 2 continues stage 1's conversation
            self.stage2_requests += out.intent.attempts
            self.stage2_hits += out.intent.prefix_hits
        self.flagged.update(flags)
        self.samples_flagged += bool(flags)
        return flags

    def cache_stats(self) -> dict[str, Any]:
        """What the prefix cache served: ``cached`` prompt tokens, and the share of stage-2 requests
        that found stage 1's prefix (``stage2_hit_rate``; None in single-prompt mode or when the
        engine does not report it)."""
        known = self.cache_reported
        rate = round(self.stage2_hits / self.stage2_requests, 4) if known and self.stage2_requests else None
        return {"cached": self.engine_requested_tokens - self.engine_prefilled_tokens if known else None,
                "stage2_requests": self.stage2_requests, "stage2_hits": self.stage2_hits if known else None,
                "stage2_hit_rate": rate}

    def to_dict(self) -> dict[str, Any]:
        def summary(counts: list[int]) -> dict[str, float]:
            return {"mean": round(sum(counts) / len(counts), 2) if counts else 0.0, "total": sum(counts), "count": len(counts)}

        return {
            "samples_in": self.samples_in,
            "written": self.written,
            "skipped": dict(self.skipped),
            "skipped_total": sum(self.skipped.values()),
            "samples_flagged": self.samples_flagged,
            "flagged": dict(sorted(self.flagged.items())),
            "retried": dict(self.retried),
            "fixed_by_retry": dict(self.fixed_by_retry),
            "text_tokens": {stage: summary(v) for stage, v in self.text_tokens.items()},
            "engine_tokens": {"prompt": self.engine_prompt_tokens, "output": self.engine_output_tokens,
                              "prefilled": self.engine_prefilled_tokens,
                              "prefilled_per_sample": round(self.engine_prefilled_tokens / self.written, 1)
                              if self.written else 0.0,
                              **self.cache_stats()},
            "skipped_samples": self.skipped_samples,
        }


def expected_samples(input_path: Path) -> int | None:
    """img2dataset writes ``00000_stats.json`` beside each tar; its 'successes' sizes the progress bar."""
    stats = ShardOutput.of(input_path).load_stats() or {}
    try:
        return int(stats["successes"])
    except (KeyError, TypeError, ValueError):
        return None


def decoded_chunks(
    samples: Iterator[RawSample | SkippedSample], cfg: GenConfig, stats: ShardStats
) -> Iterator[list[tuple[RawSample, ChunkItem]]]:
    """Group readable samples into chunks of ``engine.chunk_size``; count and log every skip."""
    chunk: list[tuple[RawSample, ChunkItem]] = []
    for sample in samples:
        stats.samples_in += 1
        if isinstance(sample, RawSample):
            try:
                image = decode_and_shrink(sample.image_bytes, cfg.io.image_max_side)
            except ValueError as e:
                sample = SkippedSample(sample.key, "undecodable image", str(e))
            else:
                chunk.append((sample, ChunkItem(sample.key, sample.caption, image)))
        if isinstance(sample, SkippedSample):
            logger.warning("skipping sample %s: %s %s", sample.key, sample.reason, sample.detail)
            stats.skip(sample)
        if len(chunk) >= cfg.engine.chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


_DONE = object()


def prefetched(items: Iterable, depth: int) -> Iterator:
    """Yield from ``items``, produced up to ``depth`` items ahead by a background thread.

    Image decoding (PIL releases the GIL) then overlaps with generation. An exception in
    the producer is re-raised here; leaving the loop early stops the producer.
    """
    if depth <= 0:
        yield from items
        return
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        buffer.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            outcome: object = _DONE
        except BaseException as e:  # handed to the consumer, which re-raises it
            outcome = e
        while not stop.is_set():
            try:
                buffer.put(outcome, timeout=0.1)
                return
            except queue.Full:
                continue

    thread = threading.Thread(target=produce, name="data_gen-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def generation_record(cfg: GenConfig, engine: Engine, prompts: PromptSet, item: ChunkItem, out: ChunkOutput,
                      flags: list[str], fidelity: dict[str, float] | None = None) -> dict[str, Any]:
    """The ``generation`` entry added to each sample's json (``fidelity`` only with the fidelity stage)."""
    s = cfg.sampling
    record = {
        "engine": engine.name,
        "model": engine.model_id,
        "prompt_version": prompts.version,
        "prompt_sha": prompts.sha,
        "mode": cfg.prompts.mode,
        "sampling": {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": cfg.run.seed,  # the job seed every request seed derives from
            "rewrite_max_tokens": s.rewrite_max_tokens,
            "intent_max_tokens": s.intent_max_tokens,
        },
        "image_size_seen": list(item.image.size),
        "rewrite": out.rewrite.record() if out.rewrite is not None else None,
        "intent": out.intent.record(),
        "flags": flags,
    }
    if fidelity is not None:
        record["fidelity"] = fidelity
    return record


def process_shard(task: ShardTask, generator: IntentGenerator, cfg: GenConfig, show_progress: bool = True,
                  overall: tqdm | None = None, scorer: FidelityScorer | None = None) -> dict[str, Any]:
    """Turn one input shard into an intent shard and its stats file. Returns the stats dict.

    ``overall`` is the job-wide progress bar (images), advanced along with the shard's own;
    ``scorer`` is the optional fidelity stage (:mod:`demind.gen.fidelity_stage`).
    """
    if scorer is not None:
        scorer.reset()
    removed = task.output.remove(include_done=True)  # the plan already decided this shard is (re)done
    for path in removed:
        logger.info("removed %s left by an earlier run", path)
    stats = ShardStats()
    engine_s0 = generator.engine_seconds
    start = time.perf_counter()
    bar = progress_bar(total=expected_samples(task.input_path), desc=f"shard {task.input_path.name}", unit="img",
               leave=False, disable=not show_progress)
    with bar, ShardWriter(task.output.tar) as writer:  # committed at the end, abandoned on an exception
        samples = iter_shard(task.input_path, cfg.io.max_caption_chars)
        for chunk in prefetched(decoded_chunks(samples, cfg, stats), cfg.io.prefetch_chunks):
            outputs = generator.generate([item for _, item in chunk])
            fidelity = score_chunk(scorer, chunk, outputs) if scorer is not None else [None] * len(chunk)
            for (raw, item), out, scores in zip(chunk, outputs, fidelity):
                write_one(writer, raw, item, out, stats, cfg, generator, scores, scorer)
            bar.update(len(chunk))
            if overall is not None:
                overall.update(len(chunk))
            _log_progress(task, stats, time.perf_counter() - start, cfg.io.log_every, len(chunk))
    result = shard_record(task, stats, generator, cfg, time.perf_counter() - start, generator.engine_seconds - engine_s0)
    task.output.mark_done(result)  # last: this file marks the shard done
    return result


def shard_record(task: ShardTask, stats: ShardStats, generator: IntentGenerator, cfg: GenConfig,
                 elapsed: float, engine_s: float) -> dict[str, Any]:
    """The content of ``{shard}_stats.json``."""
    return {
        "shard": task.shard_id,
        "input": str(task.input_path),
        "output": str(task.output.tar),
        **stats.to_dict(),
        "elapsed_s": round(elapsed, 3),
        "engine_s": round(engine_s, 3),
        "images_per_s": round(stats.written / elapsed, 4) if elapsed > 0 else None,
        "overhead_ms_per_sample": round(1000 * (elapsed - engine_s) / stats.samples_in, 3) if stats.samples_in else None,
        "engine": generator.engine.name,
        "model": generator.engine.model_id,
        "prompt_version": generator.prompts.version,
        "prompt_sha": generator.prompts.sha,
        "mode": cfg.prompts.mode,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": to_dict(cfg),
    }


def score_chunk(scorer: FidelityScorer, chunk: list, outputs: list[ChunkOutput]) -> list[dict[str, float]]:
    """GFQ fidelity of each sample's generated texts against its image: stage -> F."""
    texts = {"intent": [out.intent.text for out in outputs]}
    if all(out.rewrite is not None for out in outputs):  # not in single-prompt mode
        texts["rewrite"] = [out.rewrite.text for out in outputs]
    return scorer.score([item.image for _, item in chunk], texts)


def write_one(writer: ShardWriter, raw: RawSample, item: ChunkItem, out: ChunkOutput, stats: ShardStats,
              cfg: GenConfig, generator: IntentGenerator, fidelity: dict[str, float] | None = None,
              scorer: FidelityScorer | None = None) -> None:
    flags = stats.add_output(out, scorer.flags(fidelity) if scorer is not None and fidelity is not None else None)
    meta = dict(raw.meta)
    meta["generation"] = generation_record(cfg, generator.engine, generator.prompts, item, out, flags, fidelity)
    rewritten = out.rewrite.text if out.rewrite is not None else ""
    writer.write(encode_sample(raw.key, raw.image_ext, raw.image_bytes, raw.caption, rewritten, out.intent.text, meta))
    stats.written += 1
    count_text_tokens(generator.engine, out, stats)


def count_text_tokens(engine: Engine, out: ChunkOutput, stats: ShardStats) -> None:
    """Length of the cleaned texts in model tokens (the paper reports ~65 for T_rew, ~27 for T_int)."""
    if out.rewrite is not None:
        stats.text_tokens["rewrite"] += engine.count_tokens([out.rewrite.text])
    stats.text_tokens["intent"] += engine.count_tokens([out.intent.text])


def _log_progress(task: ShardTask, stats: ShardStats, elapsed: float, every: int, last_chunk: int) -> None:
    """One readable line each time the count of samples read crosses a multiple of ``every``."""
    if every <= 0 or (stats.samples_in // every) == ((stats.samples_in - last_chunk) // every):
        return
    logger.info(
        "shard %d: %d read, %d written, %d skipped, %d flagged, %.2f img/s",
        task.shard_id, stats.samples_in, stats.written, sum(stats.skipped.values()), stats.samples_flagged,
        stats.written / max(elapsed, 1e-9),
    )


def build_generator(cfg: GenConfig, engine: Engine, prompts: PromptSet) -> tuple[IntentGenerator, FidelityScorer | None]:
    """The per-engine state a worker keeps across shards: the generator and the optional fidelity stage."""
    generator = IntentGenerator(engine, cfg, prompts)
    scorer = None
    if cfg.quality.fidelity_clip:
        scorer = FidelityScorer.from_config(cfg.quality, cfg.run.seed, resolve_device(cfg.run.device))
    return generator, scorer


class IntentShardJob:
    """The intent job as the shared runner runs it (:class:`demind.gen.runner.ShardJob`): input
    shards -> intent shards, with this process's generator and optional fidelity stage."""

    unit = "img"

    def __init__(self, cfg: GenConfig, engine: Engine, prompts: PromptSet):
        self.cfg = cfg
        self.generator, self.scorer = build_generator(cfg, engine, prompts)

    @classmethod
    def load(cls, cfg: GenConfig) -> "IntentShardJob":
        """Load the engine and prompts of ``cfg`` (a Ray worker's start)."""
        from demind.engines import build_engine
        from demind.gen.prompts import load_prompts

        engine = build_engine(cfg.engine, cfg.sampling, device=cfg.run.device, seed=cfg.run.seed)
        return cls(cfg, engine, load_prompts(cfg.prompts.version))

    @property
    def engine_name(self) -> str:
        return self.generator.engine.name

    def expected(self, task: ShardTask) -> int | None:
        return expected_samples(task.input_path)

    def process(self, task: ShardTask, show_progress: bool = True, overall: tqdm | None = None) -> dict[str, Any]:
        return process_shard(task, self.generator, self.cfg, show_progress, overall, self.scorer)

    def done_line(self, stats: dict[str, Any]) -> str:
        eng = stats["engine_tokens"]
        rate = eng["stage2_hit_rate"]
        return (f"{stats['written']} written, {stats['skipped_total']} skipped, {stats['samples_flagged']} flagged, "
                f"{stats['images_per_s'] or 0:.2f} img/s, {eng['prefilled_per_sample']} prompt tokens prefilled per "
                f"sample, stage-2 prefix hits {'n/a' if rate is None else f'{100 * rate:.0f}%'}")


def run_plan(plan: JobPlan, cfg: GenConfig, engine: Engine, prompts: PromptSet, show_progress: bool = True) -> JobSummary:
    """The intent job on the ``local`` distributor (:func:`demind.gen.runner.run_plan`)."""
    return run_jobs(plan, IntentShardJob(cfg, engine, prompts), show_progress)


def _hit_rate(stats: dict[str, Any]) -> str:
    rate = stats["engine_tokens"].get("stage2_hit_rate")
    return "-" if rate is None else f"{100 * rate:.0f}"


SUMMARY_COLUMNS: list[Column] = [
    ("shard", 7, lambda s: s["shard"]), ("in", 7, lambda s: s["samples_in"]), ("written", 8, lambda s: s["written"]),
    ("skipped", 8, lambda s: s["skipped_total"]), ("flagged", 8, lambda s: s["samples_flagged"]),
    ("retried", 8, lambda s: sum(s["retried"].values())),
    ("T_rew tok", 10, lambda s: s["text_tokens"]["rewrite"]["mean"]),
    ("T_int tok", 10, lambda s: s["text_tokens"]["intent"]["mean"]),
    ("prefill/img", 11, lambda s: s["engine_tokens"]["prefilled_per_sample"]), ("hit %", 6, _hit_rate),
    ("img/s", 8, lambda s: f"{s['images_per_s'] or 0:.3f}"),
]


def format_job_summary(summary: JobSummary) -> str:
    """The table printed at the end of an intent run."""
    return format_summary(summary, SUMMARY_COLUMNS)
