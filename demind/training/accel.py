"""Accelerate set-up: the Accelerator, trackers, the per-process micro batch and the cross-process gather."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from demind.config import ConfigError, to_dict
from demind.losses import Gather
from demind.training.config import OptimConfig, TrainConfig
from demind.training.zero import DeepSpeedError, configure_deepspeed, deepspeed_device, hold_scalars_as_vectors

logger = logging.getLogger(__name__)


def setup(cfg: TrainConfig, *, deepspeed: bool = False, launched_processes: int = 1):
    """Create the Accelerator (precision, accumulation, trackers) and seed everything.

    ``deepspeed``: the launcher asked for DeepSpeed (``accelerate launch`` with a DeepSpeed
    config; the command reads that request). DeepSpeed's engine then trains, with its config
    filled from ``cfg`` (:mod:`demind.training.zero`), or a one-line error says why it cannot.
    ``launched_processes``: how many processes the launcher started (its ``WORLD_SIZE``, read by
    the command); a GPU launch that Accelerate cannot give GPUs is refused
    (:func:`refuse_cpu_fallback`).
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs
    from accelerate.utils import DistributedType, ProjectConfiguration, set_seed

    if cfg.run.device.startswith("cuda:"):
        raise ConfigError(f"config key 'run.device' = {cfg.run.device!r}: training places each process on its GPU "
                          "itself; use run.device=cuda and choose the GPU with CUDA_VISIBLE_DEVICES=N or "
                          "`accelerate launch --gpu_ids N`", key="run.device")
    run_dir = Path(cfg.run.output_dir)
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=cfg.model.fusion != "gate")]
    ds_device = deepspeed_device(cfg) if deepspeed else None
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
    refuse_cpu_fallback(accelerator, cfg, launched_processes)
    if deepspeed and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise DeepSpeedError(f"the launcher asked for DeepSpeed but Accelerate set up {accelerator.distributed_type}; "
                             f"launch with `accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml`")
    set_seed(cfg.run.seed)
    return accelerator


CPU_LAUNCH_CONFIG = "configs/accelerate/multi_cpu.yaml"


def refuse_cpu_fallback(accelerator, cfg: TrainConfig, launched_processes: int = 1) -> None:
    """A launch that asked for GPUs (``multi_gpu.yaml``: several processes, no ``use_cpu``) on a
    machine where torch sees none is refused. Depending on its version, Accelerate would quietly
    train the processes together on the CPU (``MULTI_CPU``) or each one alone (``NO``, one process
    each, all writing one run folder), instead of the run that was asked for. Several CPU processes
    are asked for explicitly, with ``run.device=cpu`` (:data:`CPU_LAUNCH_CONFIG`)."""
    from accelerate.utils import DistributedType

    asked_cpu = cfg.run.device == "cpu" or bool(getattr(accelerator.state, "_cpu", False))
    fell_back = (accelerator.distributed_type == DistributedType.MULTI_CPU
                 or (launched_processes > 1 and accelerator.num_processes != launched_processes))
    if fell_back and not asked_cpu:
        started = max(launched_processes, accelerator.num_processes)
        raise ConfigError(
            f"the launcher started {started} processes for GPUs, but torch sees no GPU on this machine (CUDA "
            f"available: {torch.cuda.is_available()}), so Accelerate would train them on the CPU instead "
            f"({accelerator.distributed_type}, {accelerator.num_processes} process(es) each); on a GPU machine "
            f"check the driver and CUDA_VISIBLE_DEVICES, or to train CPU processes on purpose launch with "
            f"`accelerate launch --config_file {CPU_LAUNCH_CONFIG} train.py ... run.device=cpu`", key="run.device")


def prepare_model(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                  micro_batch: int):
    """``accelerator.prepare(model, optimizer)``; under DeepSpeed its config is filled from ``cfg`` and
    ``micro_batch`` (the start-up's one :func:`micro_batch_size`) and the scalar parameters are held as
    (1,) first (:func:`demind.training.zero.hold_scalars_as_vectors`)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        configure_deepspeed(accelerator.state.deepspeed_plugin, cfg, accelerator.num_processes, micro_batch)
        hold_scalars_as_vectors(model)
    return accelerator.prepare(model, optimizer)


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

