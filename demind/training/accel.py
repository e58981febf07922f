"""Accelerate set-up: the Accelerator, trackers, the per-process micro batch and the cross-process gather."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from demind.config import ConfigError, to_dict
from demind.losses import Gather
from demind.training.config import OptimConfig, TrainConfig

logger = logging.getLogger(__name__)


def setup(cfg: TrainConfig):
    """Create the Accelerator (precision, accumulation, trackers) and seed everything."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import ProjectConfiguration, set_seed

    if cfg.run.device.startswith("cuda:"):
        raise ConfigError(f"config key 'run.device' = {cfg.run.device!r}: training places each process on its GPU "
                          "itself; use run.device=cuda and choose the GPU with CUDA_VISIBLE_DEVICES=N or "
                          "`accelerate launch --gpu_ids N`", key="run.device")
    run_dir = Path(cfg.run.output_dir)
    accelerator = Accelerator(
        mixed_precision=cfg.run.mixed_precision,
        gradient_accumulation_steps=cfg.optim.grad_accum_steps,
        # auto / cuda: Accelerate places each process on its GPU (or the CPU when none is visible)
        cpu=cfg.run.device == "cpu",
        log_with=available_trackers(cfg.run.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "logs")),
        # The ablations that bypass the gate leave it without a gradient.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=cfg.model.fusion != "gate")],
    )
    set_seed(cfg.run.seed)
    return accelerator


def available_trackers(names: list[str]) -> list[str]:
    """The requested trackers that are installed (tensorboard, wandb, ...)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    found = []
    for name in names:
        tracker = LOGGER_TYPE_TO_CLASS.get(name)
        if tracker is None:
            raise ConfigError(f"run.trackers: unknown tracker {name!r}; choose from {sorted(LOGGER_TYPE_TO_CLASS)}")
        if _tracker_installed(name):
            found.append(name)
        else:
            logger.warning("tracker %s is not installed; skipping it", name)
    return found


def _tracker_installed(name: str) -> bool:
    from accelerate.utils import imports

    check = getattr(imports, f"is_{name}_available", None)
    return bool(check and check())


def micro_batch_size(optim: OptimConfig, num_processes: int) -> int:
    """Per-process batch of one forward pass; the global batch must split evenly."""
    per_step = num_processes * optim.grad_accum_steps
    if optim.global_batch_size % per_step:
        raise ConfigError(
            f"optim.global_batch_size={optim.global_batch_size} does not split into {num_processes} processes "
            f"x {optim.grad_accum_steps} accumulation steps; make it a multiple of {per_step}"
        )
    return optim.global_batch_size // per_step


def make_gather(accelerator) -> Gather | None:
    """Gather (B, D) features from every process with gradients -> ((P*B, D), this process's offset)."""
    if accelerator.num_processes == 1:
        return None
    import warnings

    import torch.distributed.nn

    # all_gather with autograd is deprecated in favour of a private API; keep the public one.
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated")
    rank = accelerator.process_index

    def gather(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return torch.cat(torch.distributed.nn.all_gather(x.contiguous())), rank * x.shape[0]

    return gather


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

