"""``train(cfg)``: build the modules, resume, stream the data, step, checkpoint and export."""

from __future__ import annotations

from pathlib import Path

import torch

from demind.backbone import FrozenCLIP, build_backbone
from demind.checkpoint import save_checkpoint
from demind.config import save_config
from demind.io import check_output_dir
from demind.features import ShardFeatureCache
from demind.model import DeMinds, build_model
from demind.shard_format import resolve_shards
from demind.trainkit import available_trackers, deepspeed_precision, trim_metrics, use_full_precision_weights
from demind.training.accel import micro_batch_size, prepare_model, setup, tracker_config
from demind.training.batches import build_data
from demind.training.config import TrainConfig
from demind.training.plot import plot_training
from demind.training.optim import build_optimizer, build_scheduler
from demind.training.resume import TrainState, check_resume_recipe, resume_state
from demind.training.step import train_steps


EXPORT_NAME = "demind.safetensors"


def build_modules(cfg: TrainConfig, device: torch.device) -> tuple[FrozenCLIP, DeMinds]:
    """The frozen backbone and the trainable De-MINDS model on ``device``.

    A randomly initialised backbone (pretrained: null) is drawn from ``backbone.seed`` alone,
    so it has the same weights as the one ``python -m demind.features`` cached features with
    and the one evaluation rebuilds from the checkpoint; ``run.seed`` seeds the model.
    """
    torch.manual_seed(cfg.run.seed)
    backbone = build_backbone(cfg.backbone, device=device)
    model = build_model(cfg.model, backbone)
    return backbone, model


def describe_run(cfg: TrainConfig, accelerator, model: DeMinds, cache: ShardFeatureCache | None, state: TrainState,
                 micro: int) -> None:
    """Derived quantities, printed once at start-up (``micro``: the per-process batch of one forward pass)."""
    ds_config = getattr(accelerator, "deepspeed_config", None)  # set by prepare() under DeepSpeed
    precision = (f"DeepSpeed ZeRO-{ds_config['zero_optimization'].get('stage')} {deepspeed_precision(ds_config)} weights"
                 if ds_config else f"mixed precision {accelerator.mixed_precision}")
    lines = [
        f"processes {accelerator.num_processes} ({accelerator.distributed_type}, {accelerator.device}), {precision}",
        f"global batch {cfg.optim.global_batch_size} = micro batch {micro} x {accelerator.num_processes} processes "
        f"x {cfg.optim.grad_accum_steps} accumulation; contrastive batch {micro * accelerator.num_processes}",
        f"trainable parameters {model.num_trainable_parameters():,}; backbone {model.backbone.identity}",
        f"steps {state.step} -> {cfg.optim.max_steps} ({cfg.optim.max_steps * cfg.optim.global_batch_size:,} samples)",
        f"features: {'cache ' + str(cache.directory) if cache else 'decoding images (no feature cache)'}",
    ]
    for line in lines:
        accelerator.print(line)


def train(cfg: TrainConfig, *, deepspeed: bool = False, launched_processes: int = 1) -> Path:
    """Train (or resume) the run described by ``cfg``; returns the exported checkpoint path.

    Call it in every process (``accelerate launch``); only the main process writes files.
    ``deepspeed``: the launcher asked for DeepSpeed; it then trains, or the run is refused (see
    :func:`demind.training.accel.setup`).
    """
    accelerator = setup(cfg, deepspeed=deepspeed, launched_processes=launched_processes)  # see setup
    run_dir = Path(cfg.run.output_dir)
    if accelerator.is_main_process:
        check_output_dir(run_dir)  # read-only or missing permissions: fail now, not at the first checkpoint
    accelerator.wait_for_everyone()
    # what can be refused without a model is refused before the backbone loads (minutes for ViT-L/14)
    resolve_shards(cfg.data.shards)
    check_resume_recipe(cfg)
    backbone, model = build_modules(cfg, accelerator.device)
    if accelerator.is_main_process:  # a checkpoint holds the weights and AdamW's two moments
        check_output_dir(run_dir, need_bytes=3 * sum(p.numel() * p.element_size() for p in model.parameters()
                                                     if p.requires_grad))
    # derived once here and passed on (DeepSpeed's config, the data stream, the start-up lines)
    micro = micro_batch_size(cfg.optim, accelerator.num_processes)
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.optim, optimizer)
    model, optimizer = prepare_model(accelerator, model, optimizer, cfg, micro)
    accelerator.register_for_checkpointing(scheduler)
    state = resume_state(accelerator, cfg)
    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")
        trim_metrics(run_dir, state.step)
    loader, cache = build_data(cfg, accelerator, backbone, state, micro_batch=micro)
    describe_run(cfg, accelerator, accelerator.unwrap_model(model), cache, state, micro)
    if available_trackers(cfg.run.trackers):
        accelerator.init_trackers("demind", config=tracker_config(cfg))
    train_steps(cfg, accelerator, model, optimizer, scheduler, loader, backbone, state)
    if getattr(accelerator, "deepspeed_config", None):  # bf16 weights -> DeepSpeed's float32 masters
        use_full_precision_weights(accelerator.unwrap_model(model))
    export = run_dir / EXPORT_NAME
    if accelerator.is_main_process:
        save_checkpoint(export, accelerator.unwrap_model(model))
        accelerator.print(f"exported {export} (step {state.step}, {state.samples_seen:,} samples"
                          + (f"; {dict(state.counts)}" if state.counts else "") + ")")
        plot = plot_training(run_dir / "metrics.jsonl")
        if plot is not None:
            accelerator.print(f"training curves: {plot}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return export

