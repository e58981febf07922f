"""The triplet job: one pair shard in, one triplet shard plus its stats out (run by :mod:`demind.gen.runner`).

A pair shard (``pairs-NNNNN.tar``, written by ``demind-mine-pairs``; shards/README.md) holds one
``KEY.json`` per query image: its ``targets`` (key, signals, scores) and ``hard_negatives``. Each
(query, target) is one pair; its two images are read by key from the corpus the pairs were mined
from (the command opens it: ``demind.pairs.open_corpus``), never copied. The triplet shard
``triplets-NNNNN.tar`` holds one ``KEY.json`` per pair that got its instructions (KEY =
``REFERENCE_TARGET``): :func:`triplet_record`'s fields, the schema in shards/README.md. A pair whose
image is missing or corrupt, whose description fails or whose instructions do not parse after the
retries is a counted skip, named in the stats.

``triplets_manifest.json`` (:func:`check_manifest`, written before the first shard) records what the
folder was made from: the pairs folder's manifest digest, the corpus, the recipe, the models and
the prompt files' digests. A rerun with another recipe or other pairs is refused (naming what
differs) unless ``--overwrite``: a triplet folder is never a mixture of two recipes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from demind.config import config_changes, to_dict
from demind.errors import InputError
from demind.imaging import resize_longest_side
from demind.io import write_json_atomic
from demind.logs import progress_bar
from demind.gen.plan import ShardTask
from demind.gen.reader import InputShardError
from demind.gen.triplet_config import TripletGenConfig
from demind.gen.triplet_generate import PairItem, TripletGenerator, TripletOutput
from demind.shard_format import JSON_FIELD, ShardOutput, ShardWriter

logger = logging.getLogger(__name__)

MANIFEST = "triplets_manifest.json"
FORMAT = "demind-triplets/1"
OUTPUT_PREFIX = "triplets"
# recipe keys that change how a run goes, not the triplets it writes (a rerun may change them)
FREE_KEYS = ("run.progress", "run.device", "io.log_every", "engine.chunk_size", "engine.batch_size",
             "engine.cpu_threads", "engine.prefix_store_bytes", "engine.prefix_store_fraction", "engine.kv_cache_gib",
             "engine.gpu_memory_utilization", "engine.tensor_parallel_size", "engine.enforce_eager")


@dataclass
class Pair:
    """One (query, target) pair of a pair shard."""

    reference: str
    target: str
    signals: list[str]
    scores: dict[str, float]
    hard_negatives: list[str]

    @property
    def key(self) -> str:
        return f"{self.reference}_{self.target}"


@dataclass
class TripletJobSpec:
    """What a worker needs to run the triplet job: the recipe and the corpus the pairs name."""

    recipe: TripletGenConfig
    corpus: Any  # demind.pairs.Corpus: .image(key) -> PIL image, .caption(key) -> str

    @property
    def engine(self):  # the Ray distributor sizes workers by the describer's engine
        return self.recipe.engine

    @property
    def run(self):
        return self.recipe.run


def iter_pairs(path: Path, skipped: Counter) -> Iterator[Pair]:
    """The pairs of one pair shard, in its order; an unreadable member is a counted skip, an
    unreadable tar an :class:`~demind.gen.reader.InputShardError`."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                if not (info.isfile() and info.name.endswith("." + JSON_FIELD)):
                    continue
                try:
                    sample = json.loads(tar.extractfile(info).read().decode("utf-8"))
                    reference = str(sample["reference"])
                    negatives = [str(k) for k in sample.get("hard_negatives", [])]
                    for target in sample["targets"]:
                        yield Pair(reference, str(target["key"]), list(target.get("signals", [])),
                                   dict(target.get("scores", {})), negatives)
                except (ValueError, KeyError, TypeError, AttributeError):
                    skipped["unreadable pair record"] += 1
    except (tarfile.TarError, OSError) as e:
        raise InputShardError(f"pair shard {path} cannot be read ({e}); mine it again with demind-mine-pairs") from e


@dataclass
class TripletStats:
    """Counters of one shard; :meth:`to_dict` is the ``triplets-NNNNN_stats.json`` content."""

    pairs_in: int = 0
    generated: int = 0  # pairs sent to the engines (their images read)
    written: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_samples: list[dict[str, str]] = field(default_factory=list)
    flagged: Counter = field(default_factory=Counter)
    retried: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    prompt_tokens: Counter = field(default_factory=Counter)
    output_tokens: Counter = field(default_factory=Counter)

    def skip(self, key: str, reason: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        self.skipped_samples.append({"key": key, "reason": reason, "detail": detail})

    def add(self, out: TripletOutput) -> None:
        self.generated += 1
        self.calls.update(out.usage.calls)
        self.prompt_tokens.update(out.usage.prompt_tokens)
        self.output_tokens.update(out.usage.output_tokens)
        self.flagged.update(f"describe:{f}" for f in out.description_flags)
        self.retried["describe"] += out.description_attempts > 1
        self.retried["instruct"] += out.instruction_retries > 0

    def to_dict(self) -> dict[str, Any]:
        pairs = max(self.generated, 1)
        return {
            "pairs_in": self.pairs_in, "generated": self.generated, "written": self.written, "skipped": dict(self.skipped),
            "skipped_total": sum(self.skipped.values()), "flagged": dict(sorted(self.flagged.items())),
            "retried": dict(self.retried), "calls": dict(self.calls),
            "tokens": {stage: {"prompt": self.prompt_tokens[stage], "output": self.output_tokens[stage]}
                       for stage in sorted(self.calls)},
            "per_pair": {"calls": round(sum(self.calls.values()) / pairs, 3),
                         "prompt_tokens": round(sum(self.prompt_tokens.values()) / pairs, 1),
                         "output_tokens": round(sum(self.output_tokens.values()) / pairs, 1)},
            "skipped_samples": self.skipped_samples,
        }


def triplet_record(pair: Pair, out: TripletOutput, captions: tuple[str, str], generation: dict[str, Any]) -> dict[str, Any]:
    """The ``KEY.json`` of one triplet (shards/README.md, "Triplet shards")."""
    return {"reference": pair.reference, "target": pair.target, "instructions": out.instructions,
            "hard_negatives": [k for k in pair.hard_negatives if k not in (pair.reference, pair.target)],
            "description": out.description, "signals": pair.signals, "scores": pair.scores,
            "captions": {"reference": captions[0], "target": captions[1]},
            "generation": {**generation, "description_flags": out.description_flags,
                           "description_attempts": out.description_attempts,
                           "instruction_attempts": out.instruction_attempts,
                           "calls": dict(out.usage.calls),
                           "tokens": {s: {"prompt": out.usage.prompt_tokens[s], "output": out.usage.output_tokens[s]}
                                      for s in sorted(out.usage.calls)}}}


class TripletShardJob:
    """The triplet job as the shared runner runs it (:class:`demind.gen.runner.ShardJob`)."""

    unit = "pair"

    def __init__(self, spec: TripletJobSpec, generator: TripletGenerator):
        self.spec, self.cfg, self.generator = spec, spec.recipe, generator

    @classmethod
    def load(cls, spec: TripletJobSpec) -> "TripletShardJob":
        """Load the describer and the writer (one engine when they are one model) and the prompts."""
        from demind.engines import build_engine
        from demind.gen.relation import load_triplet_prompts

        cfg = spec.recipe
        sampling = cfg.sampling.engine_sampling()
        describer = build_engine(cfg.engine, sampling, device=cfg.run.device, seed=cfg.run.seed)
        writer_cfg = cfg.writer_engine()
        writer = describer if writer_cfg is None else build_engine(writer_cfg, sampling, device=cfg.run.device,
                                                                   seed=cfg.run.seed)
        return cls(spec, TripletGenerator(describer, writer, load_triplet_prompts(cfg.prompts.version), cfg))

    @property
    def engine_name(self) -> str:
        return self.generator.describer.name

    def expected(self, task: ShardTask) -> int | None:
        stats = ShardOutput.of(task.input_path).load_stats() or {}
        return stats.get("pairs") if isinstance(stats.get("pairs"), int) else None

    def done_line(self, stats: dict[str, Any]) -> str:
        return (f"{stats['written']} triplets of {stats['pairs_in']} pairs, {stats['skipped_total']} skipped, "
                f"{stats['per_pair']['calls']} calls and {stats['per_pair']['prompt_tokens']} + "
                f"{stats['per_pair']['output_tokens']} tokens per pair, {stats['pairs_per_s'] or 0:.2f} pair/s")

    def process(self, task: ShardTask, show_progress: bool = True, overall: tqdm | None = None) -> dict[str, Any]:
        """Turn one pair shard into a triplet shard and its stats file. Returns the stats dict."""
        for path in task.output.remove(include_done=True):  # the plan decided this shard is (re)done
            logger.info("removed %s left by an earlier run", path)
        stats, generation = TripletStats(), self.generator.record()
        engine_s0, start = self.generator.engine_seconds, time.perf_counter()
        bar = progress_bar(total=self.expected(task), desc=f"shard {task.input_path.name}", unit="pair", leave=False,
                           disable=not show_progress)
        with bar, ShardWriter(task.output.tar) as writer:  # committed at the end, abandoned on an exception
            for chunk in self._chunks(iter_pairs(task.input_path, stats.skipped), stats):
                outs = self.generator.generate([item for _, item, _ in chunk])
                for (pair, _, captions), out in zip(chunk, outs):
                    stats.add(out)
                    if out.error is not None:
                        stats.skip(pair.key, out.error.split(" (")[0], out.error)
                        continue
                    record = triplet_record(pair, out, captions, generation)
                    writer.write({"__key__": pair.key, JSON_FIELD: json.dumps(record, ensure_ascii=False,
                                                                               sort_keys=True).encode("utf-8")})
                    stats.written += 1
                bar.update(len(chunk))
                if overall is not None:
                    overall.update(len(chunk))
        elapsed = time.perf_counter() - start
        result = {"shard": task.shard_id, "input": str(task.input_path), "output": str(task.output.tar),
                  **stats.to_dict(), "elapsed_s": round(elapsed, 3),
                  "engine_s": round(self.generator.engine_seconds - engine_s0, 3),
                  "pairs_per_s": round(stats.pairs_in / elapsed, 4) if elapsed > 0 else None,
                  **{k: generation[k] for k in ("describer", "writer", "prompt_version", "prompt_sha")},
                  "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "config": to_dict(self.cfg)}
        task.output.mark_done(result)  # last: this file marks the shard done
        return result

    def _chunks(self, pairs: Iterator[Pair], stats: TripletStats) -> Iterator[list[tuple[Pair, PairItem, tuple[str, str]]]]:
        """``engine.chunk_size`` pairs at a time with their images read from the corpus; a pair whose
        image is missing or corrupt is a counted skip."""
        chunk: list[tuple[Pair, PairItem, tuple[str, str]]] = []
        side = self.cfg.io.image_max_side
        corpus = self.spec.corpus
        for pair in pairs:
            stats.pairs_in += 1
            try:
                images = [resize_longest_side(corpus.image(k), side) for k in (pair.reference, pair.target)]
                captions = (corpus.caption(pair.reference), corpus.caption(pair.target))
            except (InputError, OSError) as e:  # an unknown key / an image that cannot be decoded
                reason = "unreadable image" if isinstance(e, OSError) else "missing image"
                logger.warning("skipping pair %s: %s (%s)", pair.key, reason, e)
                stats.skip(pair.key, reason, str(e))
                continue
            chunk.append((pair, PairItem(pair.key, images[0], images[1], *captions), captions))
            if len(chunk) >= self.cfg.engine.chunk_size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def check_multi_image(processor: Any, model: str) -> None:
    """Refuse a describer whose chat template does not put two images in one prompt (its processor's
    image placeholder must appear twice), before any model loads."""
    from demind.engines import EngineModelError, render, user_turn

    token = getattr(processor, "image_token", None)
    try:
        prompt = render(processor, [user_turn("x", with_image=2)])
    except Exception as e:  # noqa: BLE001 - a template that cannot render two images says so in its own words
        raise EngineModelError(f"engine.model={model}: its chat template cannot hold two images in one prompt "
                               f"({e}); the describer needs a model made for several images per prompt, "
                               f"e.g. Qwen/Qwen2-VL-7B-Instruct") from None
    if token and prompt.count(token) != 2:
        raise EngineModelError(f"engine.model={model}: its chat template puts {prompt.count(token)} image(s) in a "
                               f"prompt that holds 2; the describer needs a model made for several images per "
                               f"prompt, e.g. Qwen/Qwen2-VL-7B-Instruct")


def manifest_record(cfg: TripletGenConfig, pairs_manifest: dict[str, Any], pairs_folder: str,
                    prompt_sha: dict[str, str]) -> dict[str, Any]:
    """What a triplet folder is made from (``triplets_manifest.json``): the pairs manifest's digest
    and corpus, the models, the prompt files' digests, the recipe."""
    digest = hashlib.sha256(json.dumps(pairs_manifest, sort_keys=True).encode()).hexdigest()
    writer = cfg.writer_engine()
    return {"format": FORMAT, "pairs": {"folder": str(pairs_folder), "manifest_sha256": digest},
            "corpus": pairs_manifest.get("corpus"), "backbone": pairs_manifest.get("backbone"),
            "describer": {"engine": cfg.engine.name, "model": cfg.engine.model},
            "writer": {"engine": cfg.engine.name, "model": writer.model if writer else cfg.engine.model},
            "prompts": {"version": cfg.prompts.version, "sha": prompt_sha}, "recipe": to_dict(cfg)}


def check_manifest(output: Path, manifest: dict[str, Any], overwrite: bool) -> None:
    """Write ``output``'s manifest, or refuse when the one there records other pairs or another recipe
    and a shard made with it is done (unless ``overwrite``, whose plan redoes every shard); a folder
    whose run stopped before its first shard (a model that did not load) takes the new recipe."""
    path = Path(output) / MANIFEST
    if path.is_file() and not overwrite and any(Path(output).glob(f"{OUTPUT_PREFIX}-*_stats.json")):
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        fix = f"write to another --output, or add --overwrite to generate every shard of {output} again"
        if old.get("pairs", {}).get("manifest_sha256") != manifest["pairs"]["manifest_sha256"]:
            raise InputError(f"{output} holds triplets of other pairs ({old.get('pairs', {}).get('folder')!r}, "
                             f"not {manifest['pairs']['folder']!r} as it is now); {fix}")
        changed = [c for c in config_changes(old.get("recipe"), manifest["recipe"])
                   if not c.startswith(FREE_KEYS)] + config_changes(old.get("prompts"), manifest["prompts"], "prompts")
        if changed:
            raise InputError(f"{output} holds triplets made with another recipe: {', '.join(changed[:5])}; {fix}")
        return
    write_json_atomic(path, manifest, indent=1)


def check_before_loading(cfg: TripletGenConfig, prompts: Any) -> None:
    """What can be refused before a model loads: each model's folder or Hub id, a describer that cannot
    take two images a prompt, and whether the longest prompt of each role fits its context length (``engine.max_model_len``,
    ``writer.max_model_len``) with its answer's token limit."""
    from demind.engines import check_engine_model, check_prompt_fits, load_processor
    from demind.gen.relation import describe_conversation, instruct_conversation, instruct_one_conversation

    check_engine_model(cfg.engine.model)
    check_multi_image(load_processor(cfg.engine.model), cfg.engine.model)
    writer = cfg.writer_engine()
    if writer is not None:
        check_engine_model(writer.model, key="writer.model")
    s, ins = cfg.sampling, cfg.instructions
    check_prompt_fits(cfg.engine, describe_conversation(prompts, "", ""), 2, cfg.io.image_max_side,
                      s.description_max_tokens, "the describer's prompt")
    examples = sorted(prompts.examples, key=lambda e: -len(json.dumps(e)))[:cfg.prompts.examples]
    description = "word " * s.description_max_tokens  # a description as long as the describer may write
    if ins.mode == "json":
        conversation = instruct_conversation(prompts, description, ins.count, examples)
    else:
        conversation = instruct_one_conversation(prompts, description, examples, ["word " * 8] * (ins.count - 1))
    check_prompt_fits(writer or cfg.engine, conversation, 0, cfg.io.image_max_side, s.instruction_max_tokens,
                      "the writer's prompt", key="writer.max_model_len" if writer else "engine.max_model_len")


SUMMARY_COLUMNS = [
    ("shard", 7, lambda s: s["shard"]), ("pairs", 7, lambda s: s["pairs_in"]), ("written", 8, lambda s: s["written"]),
    ("skipped", 8, lambda s: s["skipped_total"]), ("calls/pair", 10, lambda s: s["per_pair"]["calls"]),
    ("prompt tok", 10, lambda s: s["per_pair"]["prompt_tokens"]), ("out tok", 8, lambda s: s["per_pair"]["output_tokens"]),
    ("pair/s", 8, lambda s: f"{s['pairs_per_s'] or 0:.3f}"),
]


def format_triplet_summary(summary: Any) -> str:
    """The table printed at the end of a triplet run (per pair: calls and tokens of both roles)."""
    from demind.gen.runner import format_summary

    return format_summary(summary, SUMMARY_COLUMNS)
