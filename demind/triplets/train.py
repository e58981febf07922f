"""Supervised training on (reference, modification, target) triplets: ``demind-train-triplets``.

A combiner (:mod:`demind.combiner`) over a frozen CLIP's cached features, InfoNCE against
the target, under one of the noise modes of :mod:`demind.triplets.modes`. Accelerate places the model
and optimizer (as in De-MINDS pretraining); the optimizer and schedule are the project's
(:mod:`demind.training.optim`), the resumable state its one state file (:mod:`demind.training.state_file`):
after every epoch ``state.safetensors`` holds model, optimizer, schedule, RNGs and the epoch, so a
killed run rerun with the same command continues where it stopped and ends with the same weights.

Several processes (``accelerate launch --config_file configs/accelerate/multi_cpu.yaml`` or
``multi_gpu.yaml``): every process holds all N cached features and draws the same epoch order;
``optim.batch_size`` is the global batch, each process composes its 1/P of it, and the queries are
gathered with gradients (De-MINDS's :func:`demind.training.make_gather`), so the InfoNCE, GFQ, NBL
and BTU terms are those of the whole batch and the update is the one-process update (to float
rounding). Small-loss's per-sample losses are split over the processes and summed, so all get the
same N losses and the same GMM. Only the main process writes files.

Outputs in ``run.output_dir``: ``combiner.safetensors`` (a checkpoint ``demind-eval --checkpoint``
and ``demind-search`` load; method ``combiner``), ``metrics.jsonl`` (a line per epoch),
``run.json`` (config, triplet and noise counts), ``detection.json`` (the mode's noise scores; AUROC
against the injected noise). A finished run (``combiner.safetensors`` present) is left as is.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from demind.config import to_dict
from demind.errors import InputError
from demind.eval import pairwise_auc
from demind.io import check_output_dir, write_json_atomic
from demind.seeding import derive_seed
from demind.training import (
    append_metrics, build_adamw, build_lr_scheduler, check_finite_terms, load_train_state, restore_train_state,
    save_train_state, trim_metrics)
from demind.combiner import Combiner
from demind.triplets.config import TripletTrainConfig
from demind.triplets.features import image_features, text_features
from demind.triplets.launch import (
    check_same_engine, load_engine_state, make_accelerator, prepare, process_share, remove_engine_states,
    save_engine_state)
from demind.triplets.modes import batch_loss, noise_scores, per_sample_losses
from demind.robust import gmm_clean_probability
from demind.triplets.noise import inject_noise
from demind.triplets.readers import read_triplets

log = logging.getLogger(__name__)

EXPORT = "combiner.safetensors"
STATE = "state.safetensors"


@dataclass
class TrainingData:
    """Row-aligned training tensors (raw frozen features, (N, D) each) and the injected noise (N,) bool."""

    reference: torch.Tensor
    text: torch.Tensor
    target: torch.Tensor
    noisy: torch.Tensor


def read_training_triplets(cfg: TripletTrainConfig) -> list:
    """The configured triplets (read before any model is built: bad input fails in a second)."""
    categories = tuple(c.strip() for c in cfg.data.categories.split(",") if c.strip())
    triplets = read_triplets(cfg.data.source, cfg.data.path, limit=cfg.data.limit, categories=categories).triplets
    if len(triplets) < cfg.optim.batch_size:
        raise InputError(f"{cfg.data.path} gives {len(triplets)} triplets, fewer than optim.batch_size="
                         f"{cfg.optim.batch_size}; lower the batch size")
    return triplets


def load_training_data(cfg: TripletTrainConfig, backbone, triplets: list | None = None) -> TrainingData:
    """Inject the configured noise into the triplets' texts and look up (or encode) their features."""
    triplets = triplets if triplets is not None else read_training_triplets(cfg)
    texts, noisy = inject_noise([t.modification for t in triplets], [t.hard_modification for t in triplets],
                                cfg.noise.rate, cfg.noise.kind)
    cache_dir = cfg.data.cache_dir or str(Path(cfg.run.output_dir) / "feature_cache")
    images = image_features(backbone, triplets, cache_dir, cfg.data.source, cfg.data.encode_batch_size,
                            cfg.run.progress)
    text = text_features(backbone, texts, cache_dir, cfg.data.encode_batch_size)
    return TrainingData(images.reference, text, images.target, noisy)


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
    export = out / EXPORT
    if export.is_file():
        log.info("%s exists: the run is finished (delete it to train again)", export)
        return export
    triplets = read_training_triplets(cfg) if data is None else None
    accelerator = make_accelerator(cfg, launched_processes, deepspeed=deepspeed)
    if accelerator.is_main_process:
        check_output_dir(out)
    accelerator.wait_for_everyone()
    if backbone is None:
        from demind.backbone import build_backbone

        backbone = build_backbone(cfg.backbone, device=accelerator.device)
    with accelerator.main_process_first():  # the main process encodes and caches, the others read the cache
        data = data if data is not None else load_training_data(cfg, backbone, triplets)
    try:
        return _fit(cfg, backbone, data, accelerator, out)
    finally:
        if accelerator.num_processes > 1:
            accelerator.end_training()  # a gloo group left to the interpreter's teardown can abort it


def _fit(cfg: TripletTrainConfig, backbone, data: TrainingData, accelerator, out: Path) -> Path:
    device, main, share = accelerator.device, accelerator.is_main_process, process_share(accelerator)
    torch.manual_seed(cfg.run.seed)
    model = Combiner(replace(cfg.model), backbone)  # a copy: the model fills in embed_dim
    n, bs = data.reference.shape[0], cfg.optim.batch_size
    steps_per_epoch = n // bs  # the last partial batch is dropped: a contrastive batch needs its size
    optimizer = build_adamw(model.named_parameters(), cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    scheduler = build_lr_scheduler(optimizer, 0, cfg.optim.epochs * steps_per_epoch)
    model, optimizer = prepare(accelerator, model, optimizer, bs)
    unwrapped = accelerator.unwrap_model(model)
    ref, text, target = (t.to(device) for t in (data.reference, data.text, data.target))
    scale = 1.0 / cfg.optim.temperature
    state_path, start_epoch, step = out / STATE, 0, 0
    if state_path.is_file():
        state = load_train_state(state_path)
        engine_state = check_same_engine(state_path, state["extra"], accelerator)
        # under DeepSpeed its engine holds the optimizer (sharded): restored from its own folder
        step = restore_train_state(state, modules={"model": unwrapped}, scheduler=scheduler,
                                   optimizer=None if engine_state else optimizer)
        if engine_state:
            load_engine_state(accelerator, out / engine_state)
        start_epoch = int(state["extra"]["epoch"])
        if main:
            trim_metrics(out, step)
        log.info("resuming %s at epoch %d of %d", out, start_epoch, cfg.optim.epochs)
    elif main:
        (out / "metrics.jsonl").unlink(missing_ok=True)
    if main:
        write_json_atomic(out / "run.json", {"config": to_dict(cfg), "triplets": n, "noisy": int(data.noisy.sum()),
                                             "steps_per_epoch": steps_per_epoch, "processes": share.count}, indent=1)
    model.train()
    for epoch in range(start_epoch, cfg.optim.epochs):
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, "triplet-epoch", epoch))
        order = torch.randperm(n, generator=generator)
        if share.index > 0:  # dropout masks of the other processes' rows: their own stream, resumable per epoch
            torch.manual_seed(derive_seed(cfg.run.seed, "triplet-dropout", share.index, epoch))
        after_warmup = epoch >= cfg.optim.warmup_epochs
        clean = None
        if after_warmup and cfg.robust.mode == "small-loss":
            losses = per_sample_losses(unwrapped, ref, text, target, scale, bs, order, share)
            clean = (gmm_clean_probability(losses, cfg.run.seed) >= cfg.robust.gmm_threshold).to(device)
        sums: dict[str, float] = {}
        for b in range(steps_per_epoch):
            rows = order[b * bs : (b + 1) * bs].to(device)
            terms = batch_loss(unwrapped, ref[rows], text[rows], target[rows], cfg.robust, scale,
                               after_warmup=after_warmup, clean_prior=clean[rows] if clean is not None else None,
                               generator=generator, forward=model, share=share)
            check_finite_terms({k: v for k, v in terms.items() if k != "kept"}, step, where="triplet training")
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(terms["loss"])
            optimizer.step()
            scheduler.step()
            step += 1
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
        record = {"step": step, "epoch": epoch + 1, **{k: round(v / steps_per_epoch, 5) for k, v in sums.items()},
                  "lr": scheduler.get_last_lr()[0], "seconds": round(time.perf_counter() - started, 3)}
        engine_state = save_engine_state(accelerator, out, epoch + 1)  # every process, under DeepSpeed
        if main:
            append_metrics(out / "metrics.jsonl", record)
            if (epoch + 1) % cfg.run.log_every == 0 or epoch + 1 == cfg.optim.epochs:
                log.info("epoch %d/%d  loss %.4f  nce %.4f  kept %.3f  (%.1fs)", epoch + 1, cfg.optim.epochs,
                         record["loss"], record["nce"], record["kept"], record["seconds"])
            save_train_state(state_path, step=step, modules={"model": unwrapped},
                             optimizer=None if engine_state else optimizer, scheduler=scheduler,
                             extra={"epoch": epoch + 1, "engine_state": engine_state})
            remove_engine_states(out, keep=engine_state)  # the states before it
        accelerator.wait_for_everyone()  # no process runs ahead of a state a kill could resume from
    unwrapped.eval()
    path = out / EXPORT
    if main:
        if cfg.run.detection:
            write_detection(out, unwrapped, ref, text, target, data.noisy, cfg, scale)
        from demind.checkpoint import save_checkpoint

        save_checkpoint(path, unwrapped)
        state_path.unlink(missing_ok=True)  # the export is the finished run's record
        remove_engine_states(out)
    accelerator.wait_for_everyone()
    return path


def write_detection(out: Path, model, ref, text, target, noisy: torch.Tensor, cfg: TripletTrainConfig,
                    scale: float) -> dict:
    """``detection.json``: the mode's noise score of every triplet and its AUROC against ``noisy``."""
    scores = noise_scores(model, ref, text, target, cfg.robust, scale, cfg.optim.batch_size, cfg.run.seed)
    result = {"mode": cfg.robust.mode, "detector": {"none": "per-sample loss", "small-loss": "1 - GMM P(clean)"}
              .get(cfg.robust.mode, "1 - GFQ fidelity"), "noisy": int(noisy.sum()), "triplets": len(noisy),
              "auroc": auroc(scores, noisy.cpu()), "scores": [round(float(s), 5) for s in scores]}
    write_json_atomic(out / "detection.json", result)
    return result
