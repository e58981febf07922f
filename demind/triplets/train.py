"""Supervised training on (reference, modification, target) triplets: ``demind-train-triplets``.

A combiner (:mod:`demind.combiner`) over a frozen CLIP's cached features, InfoNCE against
the target, under one of the noise modes of :mod:`demind.triplets.modes`. Accelerate places the model
and optimizer (as in De-MINDS pretraining); the optimizer and schedule are the project's
(:mod:`demind.trainkit.optim`), the resumable state its one state file (:mod:`demind.trainkit.state_file`):
after every epoch ``state.safetensors`` holds model, optimizer, schedule, RNGs and the epoch, so a
killed run rerun with the same command continues where it stopped and ends with the same weights.

Several processes (``accelerate launch --config_file configs/accelerate/multi_cpu.yaml`` or
``multi_gpu.yaml``): every process holds all N cached features and draws the same epoch order;
``optim.batch_size`` is the global batch, each process composes its 1/P of it, and the queries are
gathered with gradients (the shared :func:`demind.trainkit.make_gather`), so the InfoNCE, GFQ, NBL
and BTU terms are those of the whole batch and the update is the one-process update (to float
rounding). Small-loss's per-sample losses are split over the processes and summed, so all get the
same N losses and the same GMM. Only the main process writes files.

Outputs in ``run.output_dir``: ``combiner.safetensors`` (a checkpoint ``demind-eval --checkpoint``
and ``demind-search`` load; method ``combiner``), ``metrics.jsonl`` (a line per epoch),
``run.json`` (config, the triplets' digest, triplet and noise counts: what the run was made from),
``detection.json`` (the mode's noise scores; AUROC against the injected noise). A finished run
(``combiner.safetensors`` present) is left as is.

Before the accelerator starts or the backbone loads, :func:`check_triplet_run` checks everything
that depends on the data and the folders: the output folder and cache folder are writable, the
triplets read, enough for one batch, hard noise has its texts, and a run folder already started or
finished was made from this recipe and these triplets (else one line naming what changed; only the
settings of :data:`FREE_KEYS` may differ on a rerun).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from demind.config import check_output_key, config_changes, to_dict, with_defaults
from demind.errors import InputError
from demind.eval import pairwise_auc
from demind.io import read_json, write_json_atomic
from demind.schema import SPEED_ONLY_KEYS
from demind.seeding import derive_seed
from demind.trainkit import (
    ProcessShare, ResumeError, append_metrics, build_adamw, build_lr_scheduler, check_finite_terms, load_train_state,
    process_share, restore_train_state, save_train_state, trim_metrics)
from demind.combiner import Combiner
from demind.triplets.config import TripletTrainConfig
from demind.triplets.features import image_features, text_features
from demind.triplets.accelerator import (
    check_same_engine, load_engine_state, make_accelerator, prepare, remove_engine_states, save_engine_state)
from demind.triplets.modes import (
    ModeInputs, batch_loss, mode_inputs, noise_scores, per_sample_losses, start_negative_offset)
from demind.robust import gmm_clean_probability
from demind.triplets.noise import image_noise_rows, inject_noise
from demind.triplets.hard_negatives import HardNegatives, hard_negative_features, hard_negative_loss
from demind.triplets.sources import read_source

log = logging.getLogger(__name__)

EXPORT = "combiner.safetensors"
STATE = "state.safetensors"
RECORD = "run.json"
FREE_KEYS = frozenset({"run.output_dir", "run.device", "run.progress", "run.log_every", "run.threads",
                       "run.detection", "data.cache_dir", "data.encode_batch_size", *SPEED_ONLY_KEYS})
"""Settings a rerun may change without changing what the run computes (where and how fast it runs,
what it logs); the data keys besides are free when the triplets' digest is compared instead."""
DATA_KEYS = ("data.source", "data.path", "data.categories", "data.limit", "data.corpus")


@dataclass
class TrainingData:
    """Row-aligned training tensors (raw frozen features, (N, D) each) and the injected noise (N,) bool."""

    reference: torch.Tensor
    text: torch.Tensor
    target: torch.Tensor
    noisy: torch.Tensor
    extras: ModeInputs | None = None  # what the robust mode's forms need (negated texts, pixel-noise pool)
    hard: HardNegatives | None = None  # generated triplets' hard negatives, in the loss beside the in-batch ones


@dataclass
class TripletInputs:
    """The triplets of a run, their training texts (noise injected) and (N,) bool noise mask."""

    triplets: list
    texts: list[str]
    noisy: torch.Tensor


def read_training_triplets(cfg: TripletTrainConfig) -> TripletInputs:
    """The configured triplets and their noisy texts (read before any model is built: bad input,
    too few triplets or hard noise without ``hard_modification`` fail in a second)."""
    categories = tuple(c.strip() for c in cfg.data.categories.split(",") if c.strip())
    triplets = read_source(cfg.data.source, cfg.data.path, limit=cfg.data.limit, categories=categories,
                           corpus=cfg.data.corpus).triplets
    if len(triplets) < cfg.optim.batch_size:
        raise InputError(f"{cfg.data.path} gives {len(triplets)} triplets, fewer than optim.batch_size="
                         f"{cfg.optim.batch_size}; lower the batch size")
    texts, noisy = inject_noise([t.modification for t in triplets], [t.hard_modification for t in triplets],
                                cfg.noise.rate, cfg.noise.kind)
    return TripletInputs(triplets, texts, noisy)


def triplets_digest(triplets: list) -> str:
    """sha256 of what the run reads of its triplets: ids, image names and cache keys (file and
    version), texts; a rerun on other triplets (another file, an edited image) differs."""
    rows = [[t.qid, t.reference.name, t.reference.cache_key, t.modification, t.target.name, t.target.cache_key,
             t.hard_modification, [r.cache_key for r in t.hard_negatives]] for t in triplets]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode("utf-8")).hexdigest()


def check_triplet_run(cfg: TripletTrainConfig, read_data: bool = True) -> TripletInputs | None:
    """Everything a run needs checked before the accelerator starts or the backbone loads: the
    folders it writes (``run.output_dir``, ``data.cache_dir``), its triplets (``read_data``), and a
    run folder already started or finished against this recipe (:func:`check_same_recipe`)."""
    check_output_key("run.output_dir", cfg.run.output_dir)
    if cfg.data.cache_dir:
        check_output_key("data.cache_dir", cfg.data.cache_dir)
    inputs = read_training_triplets(cfg) if read_data else None
    check_same_recipe(Path(cfg.run.output_dir), made_from(cfg, inputs))
    return inputs


def made_from(cfg: TripletTrainConfig, inputs: TripletInputs | None) -> dict:
    """What a run is made from (recorded in ``run.json``): its config and its triplets' digest."""
    return {"config": to_dict(cfg), "triplets_sha256": triplets_digest(inputs.triplets) if inputs else None}


def check_same_recipe(out: Path, record: dict) -> None:
    """A started (state file) or finished (export) run in ``out`` continues, or is left as is, only
    when ``run.json`` says it was made from this config (up to :data:`FREE_KEYS`) and these
    triplets; else :class:`~demind.trainkit.ResumeError` naming the changed keys."""
    started = [p for p in (out / STATE, out / EXPORT) if p.is_file()]
    if not started:
        return
    fix = f"rerun with the settings it was made with, or use a new run.output_dir (or delete {started[0]})"
    if not (out / RECORD).is_file():
        raise ResumeError(f"cannot reuse {started[0]}: {out / RECORD}, which says what it was made from, is "
                          f"missing; {fix}")
    saved = read_json(out / RECORD, fix)
    digests = (saved.get("triplets_sha256"), record["triplets_sha256"]) if isinstance(saved, dict) else (None, None)
    free = FREE_KEYS | (set(DATA_KEYS) if all(digests) else set())
    old = with_defaults(saved.get("config", {}) if isinstance(saved, dict) else {}, to_dict(TripletTrainConfig()))
    changes = [c for c in config_changes(old, record["config"]) if c.split(" ")[0] not in free]
    if all(digests) and digests[0] != digests[1]:
        changes.append(f"the triplets read from data.path ({record['config']['data']['path']}: other files, "
                       f"texts or images)")
    if changes:
        raise ResumeError(f"cannot reuse {started[0]}: it was made with another recipe ({'; '.join(changes)}); "
                          f"{fix}")


def load_training_data(cfg: TripletTrainConfig, backbone, inputs: TripletInputs | None = None) -> TrainingData:
    """Look up (or encode) the features of the triplets (``inputs``: read from ``cfg`` if None)."""
    inputs = inputs if inputs is not None else read_training_triplets(cfg)
    if cfg.data.source == "generated":  # pairs mined with another CLIP: refused before any image is encoded
        from demind.embedding_cache import cache_identity
        from demind.triplets.generated import check_mined_backbone

        check_mined_backbone(cfg.data.path, cache_identity(backbone))
    cache_dir = cfg.data.cache_dir or str(Path(cfg.run.output_dir) / "feature_cache")
    images = image_features(backbone, inputs.triplets, cache_dir, cfg.data.source, cfg.data.encode_batch_size,
                            cfg.run.progress)
    text = text_features(backbone, inputs.texts, cache_dir, cfg.data.encode_batch_size)
    reference, target = images.reference, images.target
    moved = image_noise_rows(len(inputs.texts), cfg.noise.rate, cfg.noise.kind)  # TME noise moves images too
    if moved is not None:
        reference, target = reference[moved[0]], target[moved[1]]
    extras = mode_inputs(cfg.robust, backbone, inputs.texts, cache_dir, cfg.data.encode_batch_size)
    hard = hard_negative_features(backbone, inputs.triplets, cache_dir, cfg.data.source, cfg.data.hard_negatives,
                                  cfg.data.encode_batch_size, cfg.run.progress)
    return TrainingData(reference, text, target, inputs.noisy, extras, hard)


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """Area under the ROC curve of ``scores`` for the ``positive`` (bool) rows, ties counted half
    (:func:`demind.eval.metrics.pairwise_auc`); None without both classes."""
    auc = pairwise_auc(scores[positive], scores[~positive])
    return None if math.isnan(auc) else auc


def train_triplets(cfg: TripletTrainConfig, backbone=None, data: TrainingData | None = None, *,
                   launched_processes: int = 1, deepspeed: bool = False) -> Path:
    """Train (or resume, or leave a finished run as is); returns the checkpoint's path.

    Call it in every process (``accelerate launch``); only the main process writes files.
    backbone: a loaded FrozenCLIP (default: built from ``cfg.backbone``); data: features already
    loaded by :func:`load_training_data` (benchmarks share them across runs); launched_processes:
    the processes the launcher started (its ``WORLD_SIZE``, read by the command); deepspeed: the
    launcher asked for DeepSpeed (its engine trains, or the run is refused in one line)."""
    out = Path(cfg.run.output_dir)
    inputs = check_triplet_run(cfg, read_data=data is None)  # every data-dependent check, before any model
    export = out / EXPORT
    if export.is_file():
        log.info("%s exists: the run is finished (delete it to train again)", export)
        return export
    accelerator = make_accelerator(cfg, launched_processes, deepspeed=deepspeed)
    if backbone is None:
        from demind.backbone import build_backbone

        backbone = build_backbone(cfg.backbone, device=accelerator.device)
    with accelerator.main_process_first():  # the main process encodes and caches, the others read the cache
        data = data if data is not None else load_training_data(cfg, backbone, inputs)
    try:
        return _fit(cfg, backbone, data, accelerator, out, made_from(cfg, inputs))
    finally:
        if accelerator.num_processes > 1:
            accelerator.end_training()  # a gloo group left to the interpreter's teardown can abort it


@dataclass
class TripletFit:
    """What the epochs of one run share: the model (as Accelerate prepared it, and unwrapped), its
    optimizer and schedule, this process's share, the features on the device, the InfoNCE scale,
    and where the run stands (``step``, ``start_epoch``: after a resume, where it goes on)."""

    model: torch.nn.Module
    unwrapped: Combiner
    optimizer: torch.optim.Optimizer
    scheduler: Any
    share: ProcessShare
    ref: torch.Tensor
    text: torch.Tensor
    target: torch.Tensor
    scale: float
    steps_per_epoch: int
    step: int = 0
    start_epoch: int = 0


def build_fit(cfg: TripletTrainConfig, backbone, data: TrainingData, accelerator) -> TripletFit:
    """The model (seeded by ``run.seed``), optimizer and schedule, prepared by Accelerate."""
    device, share = accelerator.device, process_share(accelerator)
    torch.manual_seed(cfg.run.seed)
    model = Combiner(replace(cfg.model), backbone)  # a copy: the model fills in embed_dim
    start_negative_offset(model, cfg.robust)
    n, bs = data.reference.shape[0], cfg.optim.batch_size
    steps_per_epoch = n // bs  # the last partial batch is dropped: a contrastive batch needs its size
    optimizer = build_adamw(model.named_parameters(), cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    scheduler = build_lr_scheduler(optimizer, 0, cfg.optim.epochs * steps_per_epoch)
    model, optimizer = prepare(accelerator, model, optimizer, bs)
    ref, text, target = (t.to(device) for t in (data.reference, data.text, data.target))
    return TripletFit(model, accelerator.unwrap_model(model), optimizer, scheduler, share, ref, text, target,
                      1.0 / cfg.optim.temperature, steps_per_epoch)


def resume_fit(cfg: TripletTrainConfig, fit: TripletFit, accelerator, out: Path) -> None:
    """Restore the state file of a killed run into ``fit`` (its metrics lines after it dropped), or
    start the metrics afresh."""
    state_path, main = out / STATE, accelerator.is_main_process
    if state_path.is_file():
        state = load_train_state(state_path)
        engine_state = check_same_engine(state_path, state["extra"], accelerator)
        # under DeepSpeed its engine holds the optimizer (sharded): restored from its own folder
        fit.step = restore_train_state(state, modules={"model": fit.unwrapped}, scheduler=fit.scheduler,
                                       optimizer=None if engine_state else fit.optimizer)
        if engine_state:
            load_engine_state(accelerator, out / engine_state)
        fit.start_epoch = int(state["extra"]["epoch"])
        if main:
            trim_metrics(out, fit.step)
        log.info("resuming %s at epoch %d of %d", out, fit.start_epoch, cfg.optim.epochs)
    elif main:
        (out / "metrics.jsonl").unlink(missing_ok=True)


def write_run_record(out: Path, record: dict, data: TrainingData, fit: TripletFit) -> None:
    """``run.json``: what the run was made from, its size and processes."""
    write_json_atomic(out / RECORD, {**record, "triplets": data.reference.shape[0], "noisy": int(data.noisy.sum()),
                                     "steps_per_epoch": fit.steps_per_epoch, "processes": fit.share.count}, indent=1)


def epoch_clean_prior(cfg: TripletTrainConfig, fit: TripletFit, order: torch.Tensor,
                      after_warmup: bool) -> torch.Tensor | None:
    """Small-loss's (N,) P(clean) >= threshold of the epoch (the GMM on every triplet's loss), else None."""
    if not (after_warmup and cfg.robust.mode == "small-loss"):
        return None
    losses = per_sample_losses(fit.unwrapped, fit.ref, fit.text, fit.target, fit.scale, cfg.optim.batch_size,
                               order, fit.share)
    return (gmm_clean_probability(losses, cfg.run.seed) >= cfg.robust.gmm_threshold).to(fit.ref.device)


def batch_terms(cfg: TripletTrainConfig, fit: TripletFit, data: TrainingData, rows: torch.Tensor,
                after_warmup: bool, clean: torch.Tensor | None, generator: torch.Generator) -> dict:
    """The loss terms of the global batch ``rows`` (the hard-negative loss, or the noise mode's)."""
    ref, text, target = fit.ref[rows], fit.text[rows], fit.target[rows]
    if data.hard is not None:  # robust.mode=none with hard negatives (MegaPairs's loss)
        return hard_negative_loss(fit.model, ref, text, target, *data.hard.batch(rows, ref.device), fit.scale,
                                  fit.share)
    return batch_loss(fit.unwrapped, ref, text, target, cfg.robust, fit.scale,
                      after_warmup=after_warmup, clean_prior=clean[rows] if clean is not None else None,
                      generator=generator, forward=fit.model, share=fit.share,
                      **(data.extras or ModeInputs()).for_batch(rows, generator, ref.device))


def train_epoch(cfg: TripletTrainConfig, fit: TripletFit, data: TrainingData, accelerator, epoch: int) -> dict:
    """One epoch's optimizer steps; returns its record (mean terms, lr, seconds)."""
    started, bs = time.perf_counter(), cfg.optim.batch_size
    generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, "triplet-epoch", epoch))
    order = torch.randperm(data.reference.shape[0], generator=generator)
    if fit.share.index > 0:  # dropout masks of the other processes' rows: their own stream, resumable per epoch
        torch.manual_seed(derive_seed(cfg.run.seed, "triplet-dropout", fit.share.index, epoch))
    after_warmup = epoch >= cfg.optim.warmup_epochs
    clean = epoch_clean_prior(cfg, fit, order, after_warmup)
    sums: dict[str, float] = {}
    for b in range(fit.steps_per_epoch):
        rows = order[b * bs : (b + 1) * bs].to(fit.ref.device)
        terms = batch_terms(cfg, fit, data, rows, after_warmup, clean, generator)
        check_finite_terms({k: v for k, v in terms.items() if k != "kept"}, fit.step, where="triplet training")
        fit.optimizer.zero_grad(set_to_none=True)
        accelerator.backward(terms["loss"])
        fit.optimizer.step()
        fit.scheduler.step()
        fit.step += 1
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach())
    return {"step": fit.step, "epoch": epoch + 1, **{k: round(v / fit.steps_per_epoch, 5) for k, v in sums.items()},
            "lr": fit.scheduler.get_last_lr()[0], "seconds": round(time.perf_counter() - started, 3)}


def end_epoch(cfg: TripletTrainConfig, fit: TripletFit, accelerator, out: Path, epoch: int, record: dict) -> None:
    """After an epoch: its metrics line and log line, and the state a kill resumes from (every process
    waits for it)."""
    engine_state = save_engine_state(accelerator, out, epoch + 1)  # every process, under DeepSpeed
    if accelerator.is_main_process:
        append_metrics(out / "metrics.jsonl", record)
        if (epoch + 1) % cfg.run.log_every == 0 or epoch + 1 == cfg.optim.epochs:
            log.info("epoch %d/%d  loss %.4f  nce %.4f  kept %.3f  (%.1fs)", epoch + 1, cfg.optim.epochs,
                     record["loss"], record["nce"], record["kept"], record["seconds"])
        save_train_state(out / STATE, step=fit.step, modules={"model": fit.unwrapped},
                         optimizer=None if engine_state else fit.optimizer, scheduler=fit.scheduler,
                         extra={"epoch": epoch + 1, "engine_state": engine_state})
        remove_engine_states(out, keep=engine_state)  # the states before it
    accelerator.wait_for_everyone()  # no process runs ahead of a state a kill could resume from


def export_fit(cfg: TripletTrainConfig, fit: TripletFit, data: TrainingData, accelerator, out: Path) -> Path:
    """The finished run's export (and ``detection.json`` when asked); the state file goes."""
    fit.unwrapped.eval()
    path = out / EXPORT
    if accelerator.is_main_process:
        if cfg.run.detection:
            write_detection(out, fit.unwrapped, fit.ref, fit.text, fit.target, data.noisy, cfg, fit.scale,
                            data.extras)
        from demind.checkpoint import save_checkpoint

        save_checkpoint(path, fit.unwrapped)
        (out / STATE).unlink(missing_ok=True)  # the export is the finished run's record
        remove_engine_states(out)
    accelerator.wait_for_everyone()
    return path


def _fit(cfg: TripletTrainConfig, backbone, data: TrainingData, accelerator, out: Path, record: dict) -> Path:
    fit = build_fit(cfg, backbone, data, accelerator)
    resume_fit(cfg, fit, accelerator, out)
    if accelerator.is_main_process:
        write_run_record(out, record, data, fit)
    fit.model.train()
    for epoch in range(fit.start_epoch, cfg.optim.epochs):
        end_epoch(cfg, fit, accelerator, out, epoch, train_epoch(cfg, fit, data, accelerator, epoch))
    return export_fit(cfg, fit, data, accelerator, out)


def write_detection(out: Path, model, ref, text, target, noisy: torch.Tensor, cfg: TripletTrainConfig,
                    scale: float, extras: ModeInputs | None = None) -> dict:
    """``detection.json``: the mode's noise score of every triplet and its AUROC against ``noisy``."""
    pool = extras.noise_images.to(ref.device) if extras is not None and extras.noise_images is not None else None
    scores = noise_scores(model, ref, text, target, cfg.robust, scale, cfg.optim.batch_size, cfg.run.seed, pool)
    result = {"mode": cfg.robust.mode, "detector": {"none": "per-sample loss", "rcl": "per-sample loss", "small-loss": "1 - GMM P(clean)",
                                                    "conesep-nogfq": "-similarity"}
              .get(cfg.robust.mode, "1 - GFQ fidelity"), "noisy": int(noisy.sum()), "triplets": len(noisy),
              "auroc": auroc(scores, noisy.cpu()), "scores": [round(float(s), 5) for s in scores]}
    write_json_atomic(out / "detection.json", result)
    return result
