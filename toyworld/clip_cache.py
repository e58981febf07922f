"""The trained toy CLIP, cached: trained once per recipe and reused by every later run.

``ensure_toy_backbone(cfg, cache_dir)`` takes the default recipe's shipped weights
(:mod:`toyworld.shipped`, checked bit for bit) or trains once, and caches the weights in a file keyed by
the model config and the training config; later calls reuse it. The training text is the web
mixture of :func:`toyworld.texts.web_text` (alt-texts, full descriptions and edit-form
phrasings, each true of its image) over scenes of the "web" seed stream; its own text-to-image
recall is measured on held-out "web_eval" scenes.

Files, no pickle: the weights are a plain open_clip state dict in ``<stem>.safetensors`` (open_clip
and :class:`demind.backbone.FrozenCLIP` load it by that extension), the report ``<stem>.json``; a
run killed while training leaves ``<stem>.state.safetensors`` (:mod:`demind.trainkit.state_file`) and a
rerun resumes from it. A damaged state file (truncated, corrupted) is deleted with a warning and
the toy CLIP trained again from its first step: it is this cache's own file, and training again is
what the user would be told to do. Weights pickled by versions before the shared training engine
are not read (:mod:`toyworld.cache_upgrade`): the toy CLIP is trained again, with one log line saying why.
The key is the one those versions used: the engine trains the same weights, bit for bit. (Its
warm-up lr ``lr * ((k + 1) / warmup)`` is one float64 ulp from the old ``(lr * (k + 1)) / warmup``
on 29 of the default recipe's 100 warm-up steps; AdamW's float32 update came out the same for each.)
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import open_clip
import torch
from safetensors.torch import load_file, save_file

from demind.backbone import quiet_random_init_notice
from demind.io import atomic_path, write_json_atomic
from demind.trainkit import StateFileError

from .clip import add_modality_gap, build_toy_model, gap_model_config, image_side, model_name
from toyworld.clip_config import ToyBackboneConfig, model_config_path
from .clip_eval import _add_probe_reports, evaluate_toy_clip
from .cache_upgrade import note_pickled_weights
from .clip_train import train_toy_clip
from .shipped import ShippedWeightsError, expand_shipped, shipped_path
from .world import WORLD_VERSION

logger = logging.getLogger(__name__)


# Settings of recipes measured and rejected, at the values the one recipe left always had: kept in
# the key so that weights cached before they were removed are still found.
RETIRED_SETTINGS = {"aux_attributes": [], "aux_weight": 1.0, "pretrain_anneal": False, "lock_image": True}


def cache_key(cfg: ToyBackboneConfig) -> str:
    """Hash of everything that determines the trained weights."""
    payload = {
        "model_config": json.loads(model_config_path(cfg.model_config).read_text()),
        "train": {k: v for k, v in asdict(cfg).items()
                  if k not in ("model_config", "log_every", "num_pair_probe_scenes", "shipped", "modality_gap")}
        | RETIRED_SETTINGS,
        "world": WORLD_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_paths(cfg: ToyBackboneConfig, cache_dir: str | Path) -> tuple[Path, Path]:
    """(weights .safetensors, report .json) for this config in ``cache_dir``."""
    stem = f"{Path(cfg.model_config).stem}-{cache_key(cfg)}"
    return Path(cache_dir) / f"{stem}.safetensors", Path(cache_dir) / f"{stem}.json"


def state_path_of(weights: Path) -> Path:
    """The mid-training state next to ``weights``: a rerun resumes from it."""
    return weights.with_name(weights.stem + ".state.safetensors")


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Plain open_clip state dict as safetensors, written atomically."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))


def load_weights(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """``model`` with the weights :func:`save_weights` wrote."""
    model.load_state_dict(load_file(str(path)))
    return model


def _from_shipped(cfg: ToyBackboneConfig, weights: Path) -> tuple[torch.nn.Module, dict[str, Any]] | None:
    """(model, training log) from the weights shipped for this recipe, or None (none shipped, turned
    off, or not expanding to the recorded weights: then it is trained, and a log line says why)."""
    shipped = shipped_path(weights.stem)
    if not cfg.shipped or not shipped.is_file():
        return None
    try:
        state, log = expand_shipped(shipped, cfg)
    except ShippedWeightsError as e:
        logger.warning("toy CLIP: %s; training it instead", e)
        return None
    logger.info("toy CLIP: the shipped weights of this recipe (%s, checked bit for bit)", shipped.name)
    model, _, _ = build_toy_model(cfg)
    model.load_state_dict(state)
    return model.eval(), log


def _train(cfg: ToyBackboneConfig, progress: bool, state_path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train (resuming from ``state_path`` when there); a damaged state is deleted and training restarts."""
    try:
        return train_toy_clip(cfg, progress, state_path)
    except StateFileError as e:  # raised while reading the state, before any training
        logger.warning("toy CLIP: %s -- deleting it and training from the first step", e)
        state_path.unlink(missing_ok=True)
        return train_toy_clip(cfg, progress, state_path)


def ensure_toy_backbone(cfg: ToyBackboneConfig | None = None, cache_dir: str | Path = "cache/toy",
                        progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Path of the trained toy CLIP weights (training it if absent) and its report.

    The report (same stem, ``.json``) holds the configs, training time and held-out
    text-to-image recall; it is written after the weights, so a report means done.
    """
    cfg = cfg or ToyBackboneConfig()
    weights, report_path = cached_paths(cfg, cache_dir)
    if weights.is_file() and report_path.is_file():
        logger.info("reusing toy CLIP %s", weights)
        report = json.loads(report_path.read_text())
        if report.get("pair_probe_scenes") != cfg.num_pair_probe_scenes:  # an older report, or another count
            model, tokenizer, _ = build_toy_model(cfg)
            report = _add_probe_reports(report, load_weights(model, weights).eval(), tokenizer, cfg)
            write_json_atomic(report_path, report, indent=2)
        return weights, report
    weights.parent.mkdir(parents=True, exist_ok=True)
    state_path = state_path_of(weights)
    shipped = _from_shipped(cfg, weights)
    if shipped is not None:
        model, log = shipped
    else:
        logger.info("training toy CLIP (%s: %d image pre-training steps, then %d contrastive steps with the "
                    "image tower locked, batch %d) -> %s", cfg.model_config, cfg.pretrain_steps, cfg.steps,
                    cfg.batch_size, weights)
        note_pickled_weights(weights.parent, Path(cfg.model_config).stem)
        model, log = _train(cfg, progress, state_path)
    save_weights(model, weights)
    state_path.unlink(missing_ok=True)
    tokenizer = open_clip.get_tokenizer(model_name(cfg.model_config))
    recall = evaluate_toy_clip(model, tokenizer, image_side(model), cfg.num_eval_scenes, progress)
    report = {"weights": str(weights), "cache_key": cache_key(cfg), "world_version": WORLD_VERSION,
              # as read back (tuples become lists); without the modality gap, which these weights do not hold
              "config": {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k != "modality_gap"},
              "model_config": json.loads(model_config_path(cfg.model_config).read_text()),
              **log, "heldout_text_to_image": recall}
    report = _add_probe_reports(report, model, tokenizer, cfg)
    write_json_atomic(report_path, report, indent=2)
    logger.info("toy CLIP held-out text->image recall: %s", json.dumps(recall))
    return weights, report



def with_modality_gap(cfg: ToyBackboneConfig, weights: Path) -> tuple[Path, Path]:
    """(weights, model config) of the toy CLIP that ``ensure_toy_backbone`` returned, with
    ``cfg.modality_gap`` applied (:func:`toyworld.clip.add_modality_gap`): as trained when the gap is
    0; else ``<stem>-gap<c>.safetensors`` and its model config ``<stem>-gap<c>-model.json`` next to
    the trained weights, written once (atomically; the state is checked by loading it strictly into
    that config) and reused."""
    if not cfg.modality_gap:
        return weights, model_config_path(cfg.model_config)
    stem = f"{weights.stem}-gap{cfg.modality_gap:g}"
    out, config = weights.with_name(f"{stem}.safetensors"), weights.with_name(f"{stem}-model.json")
    if not (out.is_file() and config.is_file()):
        base = json.loads(model_config_path(cfg.model_config).read_text())
        write_json_atomic(config, gap_model_config(base), indent=2)
        state = add_modality_gap(load_file(str(weights)), cfg.modality_gap)
        with quiet_random_init_notice():
            open_clip.create_model(model_name(config), pretrained=None).load_state_dict(state)  # strict
        with atomic_path(out) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        logger.info("toy CLIP with modality gap %g: %s", cfg.modality_gap, out)
    return out, config
