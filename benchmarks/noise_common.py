"""Shared set-up of the two noisy-description measurements: the toy backbone and
benchmarks of a finished quickstart workdir, noisy toy intent shards with their feature cache,
and one quickstart-style work folder per (noise group, training mode).

Used by ``benchmarks/noise_detection.py`` and ``benchmarks/noise_retrieval.py``; everything is
built from the quickstart's own pieces (:mod:`toyworld.pipeline`, :mod:`toyworld.intent_data`).
The source workdir is only read: its benchmarks are copied once into the output folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

from demind.errors import DemindError

logger = logging.getLogger(__name__)

MODES = ("none", "filter", "downweight", "conesep")
# conesep: 4 negative prompt tokens (as many as the intention queries) and L_ul after the toy
# recipe's learning-rate warm-up (40 of 400 steps); chosen before measuring, not tuned.
MODE_OVERRIDES = {
    "none": ["noise.mode=none"],
    "filter": ["noise.mode=filter"],
    "downweight": ["noise.mode=downweight"],
    "conesep": ["noise.mode=conesep", "model.negative_tokens=4", "noise.warmup_steps=40"],
}
EVAL_BENCHMARKS = ("cirr", "exclusion")
# a --tiny run: a few samples and steps, to check the script end to end on a CPU in a minute or two
TINY_TRAIN = ["optim.max_steps=3", "optim.warmup_steps=1", "optim.global_batch_size=16", "data.shuffle_buffer=16",
              "data.shards_per_group=1", "model.num_blocks=1", "model.mapping_hidden=32", "run.save_every=100"]


class NoiseBenchError(DemindError, ValueError):
    """A source workdir or option the measurement cannot use."""


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys ``cls`` no longer has (a results.json from another version)."""
    names = {f.name for f in dataclasses.fields(cls)}
    dropped = sorted(set(data) - names)
    if dropped:
        logger.warning("ignoring %s keys of the source config this version lacks: %s", cls.__name__, dropped)
    return {k: v for k, v in data.items() if k in names}


def source_config(quickstart: str | Path):
    """The QuickstartConfig a finished quickstart workdir ran with (from its results.json)."""
    from demind.config import from_dict
    from toyworld.clip_config import ToyBackboneConfig
    from toyworld.benchmarks import ToyBenchmarkConfig
    from toyworld.intent_data import ToyShardConfig
    from toyworld.pipeline import QuickstartConfig

    results = Path(quickstart) / "results.json"
    if not results.is_file():
        raise NoiseBenchError(f"{results} is missing: pass a finished quickstart workdir "
                              f"(python pipelines/quickstart.py workdir=DIR)")
    saved = dict(json.loads(results.read_text())["config"])
    # a quickstart from before the toy CLIP's modality gap ran without one
    saved["backbone"] = {"modality_gap": 0.0, **saved.get("backbone", {})}
    sections = {"shards": ToyShardConfig, "toy_benchmarks": ToyBenchmarkConfig, "backbone": ToyBackboneConfig}
    for key, cls in sections.items():
        saved[key] = from_dict(cls, _known_fields(cls, saved.get(key, {})), prefix=f"{key}.")
    saved = _known_fields(QuickstartConfig, saved)
    plain = {k: v for k, v in saved.items() if k not in sections}
    return dataclasses.replace(from_dict(QuickstartConfig, plain), **{k: saved[k] for k in sections if k in saved})


def load_backbone(quickstart: str | Path, cfg) -> tuple[Any, float]:
    """The quickstart's trained toy CLIP (FrozenCLIP) and its logit scale, as the quickstart loads it
    (:func:`toyworld.pipeline.prepare_backbone`), but never training one: the weights must be there."""
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig
    from toyworld.clip_cache import cached_paths, with_modality_gap

    folder = Path(quickstart) / "backbone"
    weights, report = cached_paths(cfg.backbone, folder)
    if not (weights.is_file() and report.is_file()):
        # another version's cache key: take the one finished toy CLIP of the workdir
        done = [p for p in folder.glob("*.safetensors")
                if not p.name.endswith(".state.safetensors") and p.with_suffix(".json").is_file()]
        if len(done) != 1:
            raise NoiseBenchError(f"{folder} holds {len(done)} finished toy CLIPs; expected the quickstart's one")
        weights = done[0]
    weights, model_config = with_modality_gap(cfg.backbone, weights)
    backbone = FrozenCLIP(BackboneConfig(name=str(model_config), pretrained=str(weights)))
    log_scale = float(backbone.model.logit_scale.detach().clamp(max=math.log(100)))
    return backbone, log_scale


def copy_benchmarks(quickstart: str | Path, out: Path, which: tuple[str, ...] = EVAL_BENCHMARKS) -> Path:
    """Copy the toy benchmarks the measurement evaluates on into ``out/benchmarks`` (once; again when the
    quickstart's benchmark was rewritten since: its done-marker, which holds the whole config, differs)."""
    root = out / "benchmarks"
    for name in which:
        source, target = Path(quickstart) / "benchmarks" / name, root / name
        if not (source / "toy_benchmark.json").is_file():
            raise NoiseBenchError(f"{source} is not a finished toy benchmark; rerun the quickstart there")
        marker = (source / "toy_benchmark.json").read_bytes()
        if not ((target / "toy_benchmark.json").is_file() and (target / "toy_benchmark.json").read_bytes() == marker):
            shutil.rmtree(target, ignore_errors=True)
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp)
            tmp.rename(target)  # whole folder or nothing
    return root


def group_name(kind: str, rate: float) -> str:
    """Shard group of a noise setting: ``clean`` at rate 0 (any kind), else e.g. ``hard-0.50``."""
    return "clean" if rate == 0 or kind == "none" else f"{kind}-{rate:.2f}"


def noisy_shards(out: Path, cfg, kind: str, rate: float, num_samples: int | None = None) -> list[Path]:
    """Toy intent shards with ``kind`` noise at ``rate`` (written once, resumable) in ``out/shards/<group>``."""
    from toyworld.intent_data import write_toy_shards

    shard_cfg = dataclasses.replace(cfg.shards, noise_kind="none" if rate == 0 else kind,
                                    noise_rate=0.0 if kind == "none" else rate,
                                    **({"num_samples": num_samples} if num_samples else {}))
    if shard_cfg.samples_per_shard > shard_cfg.num_samples:
        shard_cfg = dataclasses.replace(shard_cfg, samples_per_shard=shard_cfg.num_samples)
    return write_toy_shards(out / "shards" / group_name(kind, rate), shard_cfg, show_progress=cfg.progress)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.resolve() == target.resolve():
            return
        raise NoiseBenchError(f"{link} exists and is not a link to {target}; use a fresh --out folder")
    link.symlink_to(target.resolve(), target_is_directory=True)


def cell_config(out: Path, cfg, group: str, mode: str, extra_overrides: list[str], folder: str | None = None):
    """A QuickstartConfig whose work folder ``out/cells/<group>/<folder or mode>`` links the group's shards,
    the copied benchmarks and one shared evaluation image cache, so the quickstart's ``train_variant`` and
    ``evaluate_run`` train on the noisy shards and evaluate on the copied benchmarks."""
    workdir = out / "cells" / group / (folder or mode)
    _link(workdir / "shards", out / "shards" / group)
    _link(workdir / "benchmarks", out / "benchmarks")
    (out / "eval_cache").mkdir(parents=True, exist_ok=True)
    _link(workdir / "eval" / "feature_cache", out / "eval_cache")
    return dataclasses.replace(cfg, workdir=str(workdir), benchmarks=list(EVAL_BENCHMARKS),
                               train_overrides=[*cfg.train_overrides, *MODE_OVERRIDES[mode], *extra_overrides])


def parse_floats(text: str, name: str) -> list[float]:
    """'0,0.2,0.5' -> [0.0, 0.2, 0.5], each in [0, 1]; a percentage such as 20 is read as 0.2."""
    values = []
    for item in text.split(","):
        value = float(item)
        value = value / 100 if value > 1 else value
        if not 0 <= value <= 1:
            raise NoiseBenchError(f"--{name}: {item} is not a rate in [0, 1] (or a percentage)")
        values.append(value)
    return values


def parse_choices(text: str, name: str, allowed: tuple[str, ...]) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise NoiseBenchError(f"--{name}: {bad or text!r} not in {allowed}")
    return values


def add_common_arguments(parser: argparse.ArgumentParser, tiny_help: str) -> None:
    """The options both noise benchmarks take: the source quickstart, the output, the noise kinds,
    the sample count, extra training overrides and the smoke-run switch."""
    parser.add_argument("--quickstart", required=True,
                        help="finished quickstart workdir (toy CLIP, benchmarks; read only)")
    parser.add_argument("--out", required=True, help="output folder (resumable)")
    parser.add_argument("--kinds", default="hard,easy", help="noise kinds: hard,easy")
    parser.add_argument("--num-samples", type=int, default=None,
                        help="intent samples per shard group (default: the quickstart's)")
    parser.add_argument("--train-override", action="append", default=[],
                        help="extra training override, e.g. run.device=auto (repeatable)")
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
