"""Toy intent shards: the stand-in for intent-CC3M, in exactly data_gen's sample schema.

Each WebDataset sample is ``KEY.jpg``, ``KEY.txt`` (T_ori), ``KEY.rew.txt`` (T_rew),
``KEY.int.txt`` (T_int) and ``KEY.json`` (input metadata plus a ``generation`` record),
written with the project's one shard writer (``demind.shard_format``), as data_gen's are,
so the trainer cannot tell toy shards from generated ones. Like data_gen, ``NNNNN_stats.json``
is written last and marks a shard done; a rerun skips finished shards and redoes unfinished ones.

Controlled noise stands in for an MLLM that hallucinates: with ``noise_kind`` hard
or easy, a ``noise_rate`` share of the samples get a wrong T_rew and T_int while the image and
T_ori (the web alt-text) stay true.

* **hard**: T_rew and T_int are written for a look-alike scene, the sample's scene with ONE
  attribute edited (:func:`toyworld.world.apply_edit`: colour, shape, size, position,
  background or style), so the description is wrong while everything else looks right;
* **easy**: T_rew and T_int are those of a random other sample of the stream.

Which samples are noisy depends only on (stream, index) and the rate (a sample is noisy when
its own uniform draw is below the rate), so the 20 % set lies inside the 50 % set and hard and
easy noise corrupt the same samples. Ground truth is in each sample's json (``"noise":
{"kind": "hard", "edit": "colour"}``, ``{"kind": "easy", "donor": 17}`` or ``null``) and the
shard stats count it. The noise settings are part of the shard config that the done-marker
records, so a clean and a noisy shard are never mistaken for each other.
"""

from __future__ import annotations

import io
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from demind.config import ConfigError, config_problems
from demind.settings import setting
from demind.shard_format import ShardOutput, ShardWriter, encode_sample, sample_key

from .cache_upgrade import current_shard_config
from .parallel import parallel_map
from .render import render_image
from .texts import alt_text, full_description, hypothetical_source, pseudo_manipulation
from .world import SEED_STREAMS, WORLD_VERSION, Scene, apply_edit, edit_is_possible, scene_from_seed, stream_seed
from demind.seeding import derive_seed

logger = logging.getLogger(__name__)

NOISE_KINDS = ("none", "hard", "easy")
# One attribute of a look-alike scene; add/remove change the object count, not an attribute.
HARD_NOISE_EDITS = ("colour", "shape", "size", "position", "background", "style")


@dataclass
class ToyShardConfig:
    """How many toy intent samples to write and how."""

    num_samples: int = setting(12000, ge=1)
    samples_per_shard: int = setting(1000, ge=1)
    stream: str = setting("cc3m", choices=tuple(SEED_STREAMS))  # seed stream; disjoint from the benchmarks'
    image_size: int = setting(64, ge=1)
    jpeg_quality: int = setting(90, ge=1, le=100)  # PIL's JPEG scale
    noise_kind: str = setting("none", choices=NOISE_KINDS)  # see the module docstring
    noise_rate: float = setting(0.0, ge=0, le=1)  # share of samples whose T_rew and T_int are wrong

    def __post_init__(self) -> None:
        # checked here too: benchmarks build this config in code, not through load_config
        problems = config_problems(self)
        if problems:
            key, message = problems[0]
            raise ConfigError(f"toy shard config: {message}", key=key)


@dataclass
class ToySample:
    """One intent sample before encoding."""

    key: str
    image_jpeg: bytes
    caption: str
    rewritten: str
    intent: str
    meta: dict[str, Any]


def is_noisy(stream: str, index: int, rate: float) -> bool:
    """Whether sample ``index`` is corrupted at ``rate``: its own draw, independent of the noise kind,
    so a lower rate's noisy set lies inside a higher rate's."""
    return random.Random(derive_seed(stream, "noise-pick", index)).random() < rate


def _true_texts(scene: Scene, rng: random.Random) -> tuple[str, str, Scene, str]:
    """(T_ori, T_rew, hypothetical source, T_int) of ``scene``, drawn in this order from ``rng``."""
    caption = alt_text(scene, rng)
    rewritten = full_description(scene, rng)
    source = hypothetical_source(scene, rng)
    return caption, rewritten, source, pseudo_manipulation(source, scene, rng)


def noisy_texts(index: int, scene: Scene, cfg: ToyShardConfig) -> tuple[str, str, dict[str, Any]] | None:
    """(T_rew, T_int, ground-truth record) replacing sample ``index``'s true ones, or None if it stays clean.

    Hard: both texts describe ``scene`` with one attribute edited. Easy: both are another sample's.
    """
    if cfg.noise_kind == "none" or not is_noisy(cfg.stream, index, cfg.noise_rate):
        return None
    rng = random.Random(derive_seed(cfg.stream, "noise", cfg.noise_kind, index))
    if cfg.noise_kind == "hard":
        edit = rng.choice([k for k in HARD_NOISE_EDITS if edit_is_possible(scene, k)])
        lookalike = apply_edit(scene, edit, rng)
        rewritten = full_description(lookalike, rng)
        intent = pseudo_manipulation(hypothetical_source(lookalike, rng), lookalike, rng)
        return rewritten, intent, {"kind": "hard", "edit": edit, "scene": lookalike.to_dict()}
    donor = rng.randrange(cfg.num_samples - 1) if cfg.num_samples > 1 else 0
    donor += donor >= index  # any sample but this one
    donor_scene = scene_from_seed(stream_seed(cfg.stream, donor))
    _, rewritten, _, intent = _true_texts(donor_scene, random.Random(derive_seed(cfg.stream, "text", donor)))
    return rewritten, intent, {"kind": "easy", "donor": donor}


def make_toy_sample(index: int, cfg: ToyShardConfig, key: str) -> ToySample:
    """Sample ``index`` of the stream: scene, image, the three texts and the metadata."""
    scene = scene_from_seed(stream_seed(cfg.stream, index))
    version = WORLD_VERSION
    image = render_image(scene, derive_seed(cfg.stream, "nuisance", index), cfg.image_size)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=cfg.jpeg_quality)
    caption, rewritten, source, intent = _true_texts(scene, random.Random(derive_seed(cfg.stream, "text", index)))
    noise = noisy_texts(index, scene, cfg)
    if noise is not None:
        rewritten, intent, noise_record = noise
    else:
        noise_record = None
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
        # ground truth of the controlled noise (None: T_rew and T_int are true of the image)
        "noise": noise_record,
        "generation": {
            "engine": "toy-world",
            "model": f"toyworld.texts@{version}",
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
    noise_counts: Counter[str] = Counter()
    with ShardWriter(output.tar) as writer:
        for i in range(count):
            s = make_toy_sample(first + i, cfg, key=sample_key(shard_id, i, 4))
            writer.write(encode_sample(s.key, "jpg", s.image_jpeg, s.caption, s.rewritten, s.intent, s.meta))
            if s.meta["noise"] is not None:
                noise_counts["noisy"] += 1
                noise_counts[s.meta["noise"].get("edit", s.meta["noise"]["kind"])] += 1
    elapsed = time.perf_counter() - start
    stats = {
        "shard": shard_id, "output": str(output.tar), "samples_in": count, "written": count,
        "skipped": {}, "flagged": {}, "elapsed_s": round(elapsed, 3),
        "images_per_s": round(count / elapsed, 2) if elapsed > 0 else None,
        "engine": "toy-world", "world_version": WORLD_VERSION, "config": asdict(cfg),
        # noisy samples in all and per hard-noise edit (or "easy")
        "noise": {"kind": cfg.noise_kind, "rate": cfg.noise_rate, "noisy": noise_counts.pop("noisy", 0),
                  "by_edit": dict(sorted(noise_counts.items()))},
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
    if stats is None or stats.get("world_version") != WORLD_VERSION or not isinstance(stats.get("config"), dict):
        return False
    return current_shard_config(stats["config"]) == asdict(cfg)  # an earlier marker: toyworld.cache_upgrade
