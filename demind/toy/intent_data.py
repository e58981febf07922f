"""Toy intent shards: the stand-in for intent-CC3M, in exactly data_gen's sample schema.

Each WebDataset sample is ``KEY.jpg``, ``KEY.txt`` (T_ori), ``KEY.rew.txt`` (T_rew),
``KEY.int.txt`` (T_int) and ``KEY.json`` (input metadata plus a ``generation`` record),
written with the project's one shard writer (``demind.shard_format``), as data_gen's are,
so the trainer cannot tell toy shards from generated ones. Like data_gen, ``NNNNN_stats.json``
is written last and marks a shard done; a rerun skips finished shards and redoes unfinished ones.
"""

from __future__ import annotations

import io
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from demind.config import setting
from demind.shard_format import ShardOutput, ShardWriter, encode_sample, sample_key

from .parallel import parallel_map
from .render import render_image
from .texts import alt_text, full_description, hypothetical_source, pseudo_manipulation
from .world import WORLDS, derive_seed, scene_from_seed, stream_seed, world_version

logger = logging.getLogger(__name__)


@dataclass
class ToyShardConfig:
    """How many toy intent samples to write and how."""

    num_samples: int = 12000
    samples_per_shard: int = 1000
    stream: str = "cc3m"  # seed stream (world.SEED_STREAMS); disjoint from the benchmarks'
    image_size: int = 64
    jpeg_quality: int = 90
    world: str = setting("v1", choices=WORLDS)  # README "World v2"; the quickstart sets it from its `world`


@dataclass
class ToySample:
    """One intent sample before encoding."""

    key: str
    image_jpeg: bytes
    caption: str
    rewritten: str
    intent: str
    meta: dict[str, Any]


def make_toy_sample(index: int, cfg: ToyShardConfig, key: str) -> ToySample:
    """Sample ``index`` of the stream: scene, image, the three texts and the metadata."""
    scene = scene_from_seed(stream_seed(cfg.stream, index), world=cfg.world)
    version = world_version(cfg.world)
    image = render_image(scene, derive_seed(cfg.stream, "nuisance", index), cfg.image_size)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=cfg.jpeg_quality)
    rng = random.Random(derive_seed(cfg.stream, "text", index))
    caption = alt_text(scene, rng)
    rewritten = full_description(scene, rng)
    source = hypothetical_source(scene, rng)
    intent = pseudo_manipulation(source, scene, rng)
    meta = {
        # img2dataset-like input metadata
        "key": key,
        "caption": caption,
        "url": f"toy://{cfg.stream}/{index}",
        "width": cfg.image_size,
        "height": cfg.image_size,
        "status": "success",
        # ground truth, for analysis only (the trainer never reads it)
        "toy": {"world_version": version, "index": index, "scene": scene.to_dict(),
                "intent_source_scene": source.to_dict()},
        "generation": {
            "engine": "toy-world",
            "model": f"demind.toy.texts@{version}",
            "prompt_version": version,
            "mode": "cot",
            "sampling": {"seed": derive_seed(cfg.stream, "text", index)},
            "flags": [],
        },
    }
    return ToySample(key, buf.getvalue(), caption, rewritten, intent, meta)


def write_toy_shard(out_dir: Path, shard_id: int, cfg: ToyShardConfig) -> dict[str, Any]:
    """Write one shard atomically (tar renamed into place, then its stats). Returns the stats."""
    output = ShardOutput.for_id(out_dir, shard_id)
    output.remove(include_done=True)
    start = time.perf_counter()
    first = shard_id * cfg.samples_per_shard
    count = min(cfg.samples_per_shard, cfg.num_samples - first)
    with ShardWriter(output.tar) as writer:
        for i in range(count):
            s = make_toy_sample(first + i, cfg, key=sample_key(shard_id, i, 4))
            writer.write(encode_sample(s.key, "jpg", s.image_jpeg, s.caption, s.rewritten, s.intent, s.meta))
    elapsed = time.perf_counter() - start
    stats = {
        "shard": shard_id, "output": str(output.tar), "samples_in": count, "written": count,
        "skipped": {}, "flagged": {}, "elapsed_s": round(elapsed, 3),
        "images_per_s": round(count / elapsed, 2) if elapsed > 0 else None,
        "engine": "toy-world", "world_version": world_version(cfg.world), "config": asdict(cfg),
    }
    output.mark_done(stats)  # last: marks the shard done
    return stats


def _write_shard_job(job: tuple[Path, int, ToyShardConfig]) -> dict[str, Any]:
    return write_toy_shard(*job)


def write_toy_shards(out_dir: str | Path, cfg: ToyShardConfig | None = None, show_progress: bool = True,
                     workers: int | None = None) -> list[Path]:
    """Write all shards of ``cfg`` into ``out_dir``, skipping finished ones. Returns the tar paths.

    Shards are written by ``workers`` processes (default: every core); each is written
    atomically and only from its own seeds, so the files do not depend on the split.

    A shard written by another world version or config is redone (its stats say which).
    """
    cfg = cfg or ToyShardConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_shards = -(-cfg.num_samples // cfg.samples_per_shard)
    todo = [i for i in range(num_shards) if not _is_current(ShardOutput.for_id(out_dir, i), cfg)]
    if todo:
        logger.info("toy shards: %d to write, %d already done in %s", len(todo), num_shards - len(todo), out_dir)
    jobs = [(out_dir, shard_id, cfg) for shard_id in todo]
    for _ in parallel_map(_write_shard_job, jobs, workers, desc="toy shards", progress=show_progress, unit="shard"):
        pass
    return [ShardOutput.for_id(out_dir, i).tar for i in range(num_shards)]


def _is_current(output: ShardOutput, cfg: ToyShardConfig) -> bool:
    stats = output.load_stats() if output.tar.is_file() else None
    return (stats is not None and stats.get("world_version") == world_version(cfg.world)
            and stats.get("config") == asdict(cfg))
