"""De-MINDS's Accelerate set-up: the Accelerator, the per-process micro batch, DeepSpeed's config
from the ``optim`` section, and the tracker table (the shared pieces: :mod:`demind.trainkit`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from demind.config import ConfigError, to_dict
from demind.trainkit import (available_trackers, deepspeed_device, fill_deepspeed_config, hold_scalars_as_vectors,
                             is_deepspeed, refuse_cpu_fallback, refuse_without_deepspeed)
from demind.training.config import OptimConfig, TrainConfig


def setup(cfg: TrainConfig, *, deepspeed: bool = False, launched_processes: int = 1):
    """Create the Accelerator (precision, accumulation, trackers) and seed everything.

    ``deepspeed``: the launcher asked for DeepSpeed (``accelerate launch`` with a DeepSpeed
    config; the command reads that request). DeepSpeed's engine then trains, with its config
    filled from ``cfg`` (:func:`configure_deepspeed`), or a one-line error says why it cannot.
    ``launched_processes``: how many processes the launcher started (its ``WORLD_SIZE``, read by
    the command); a GPU launch that Accelerate cannot give GPUs is refused
    (:func:`demind.trainkit.refuse_cpu_fallback`).
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs
    from accelerate.utils import ProjectConfiguration, set_seed

    if cfg.run.device.startswith("cuda:"):
        raise ConfigError(f"config key 'run.device' = {cfg.run.device!r}: training places each process on its GPU "
                          "itself; use run.device=cuda and choose the GPU with CUDA_VISIBLE_DEVICES=N or "
                          "`accelerate launch --gpu_ids N`", key="run.device")
    run_dir = Path(cfg.run.output_dir)
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=cfg.model.fusion != "gate")]
    ds_device = deepspeed_device(cfg.run.device) if deepspeed else None
    if ds_device == "cpu":  # DeepSpeed's CPU accelerator talks over gloo (Accelerate would assume none)
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    accelerator = Accelerator(
        mixed_precision=cfg.run.mixed_precision,
        gradient_accumulation_steps=cfg.optim.grad_accum_steps,
        # auto / cuda: Accelerate places each process on its GPU (or the CPU when none is visible).
        # cpu=True would make Accelerate drop DeepSpeed for MULTI_CPU: DeepSpeed's own CPU accelerator
        # (checked against run.device above) places it instead.
        cpu=cfg.run.device == "cpu" and not deepspeed,
        log_with=available_trackers(cfg.run.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "logs")),
        # The ablations that bypass the gate leave it without a gradient.
        kwargs_handlers=handlers,
    )
    refuse_cpu_fallback(accelerator, cfg.run.device, launched_processes)
    if deepspeed:
        refuse_without_deepspeed(accelerator)
    set_seed(cfg.run.seed)
    return accelerator


def prepare_model(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                  micro_batch: int):
    """``accelerator.prepare(model, optimizer)``; under DeepSpeed its config is filled from ``cfg`` and
    ``micro_batch`` (the start-up's one :func:`micro_batch_size`) and the scalar parameters are held as
    (1,) first (:func:`demind.trainkit.hold_scalars_as_vectors`)."""
    if is_deepspeed(accelerator):
        configure_deepspeed(accelerator.state.deepspeed_plugin, cfg, accelerator.num_processes, micro_batch)
        hold_scalars_as_vectors(model)
    return accelerator.prepare(model, optimizer)


def micro_batch_size(optim: OptimConfig, num_processes: int) -> int:
    """Per-process batch of one forward pass; the global batch must split evenly."""
    per_step = num_processes * optim.grad_accum_steps
    if optim.global_batch_size % per_step:
        raise ConfigError(
            f"optim.global_batch_size={optim.global_batch_size} does not split into {num_processes} processes "
            f"x {optim.grad_accum_steps} accumulation steps; make it a multiple of {per_step}"
        )
    return optim.global_batch_size // per_step


def tracker_config(cfg: TrainConfig) -> dict[str, Any]:
    """Flat scalar config for tracker hyper-parameter tables."""
    flat: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk(to_dict(cfg), "")
    return flat


DEMINDS_SOURCES = {"train_micro_batch_size_per_gpu": "optim.global_batch_size / processes / optim.grad_accum_steps",
                   "gradient_accumulation_steps": "optim.grad_accum_steps",
                   "train_batch_size": "optim.global_batch_size", "gradient_clipping": "optim.grad_clip"}


def configure_deepspeed(plugin, cfg: TrainConfig, num_processes: int, micro_batch: int) -> dict[str, Any]:
    """Fill the DeepSpeed config of Accelerate's ``plugin`` from ``cfg`` (before ``accelerator.prepare``).

    Sets ``train_micro_batch_size_per_gpu`` (Accelerate can only infer it from a DataLoader, and the
    trainer prepares none), ``train_batch_size``, ``gradient_accumulation_steps`` and
    ``gradient_clipping`` where the launcher's config leaves them out or ``auto``; raises
    :class:`~demind.trainkit.DeepSpeedError` naming both values where it sets one that differs.
    Returns the config.
    """
    return fill_deepspeed_config(plugin, micro_batch=micro_batch, num_processes=num_processes,
                                 grad_accum_steps=cfg.optim.grad_accum_steps, grad_clip=cfg.optim.grad_clip,
                                 sources=DEMINDS_SOURCES)
