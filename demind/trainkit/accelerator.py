"""Accelerate pieces every trainer under ``accelerate launch`` shares: the refusal of a GPU launch
that Accelerate would quietly run on the CPU, the cross-process gather with gradients, the
installed trackers and the atomic ``save_state``."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

import torch

from demind.config import ConfigError
from demind.io import temp_path
from demind.losses import Gather

logger = logging.getLogger(__name__)

CPU_LAUNCH_CONFIG = "configs/accelerate/multi_cpu.yaml"


def refuse_cpu_fallback(accelerator, device: str, launched_processes: int = 1) -> None:
    """A launch that asked for GPUs (``multi_gpu.yaml``: several processes, no ``use_cpu``) on a
    machine where torch sees none is refused. Depending on its version, Accelerate would quietly
    train the processes together on the CPU (``MULTI_CPU``) or each one alone (``NO``, one process
    each, all writing one run folder), instead of the run that was asked for. Several CPU processes
    are asked for explicitly, with ``run.device=cpu`` (``device``, :data:`CPU_LAUNCH_CONFIG`)."""
    from accelerate.utils import DistributedType

    asked_cpu = device == "cpu" or bool(getattr(accelerator.state, "_cpu", False))
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


def is_deepspeed(accelerator) -> bool:
    """Whether DeepSpeed's engine trains (Accelerate's ``DistributedType.DEEPSPEED``)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


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


def save_accelerator_state_atomically(accelerator, final: Path,
                                      before_rename: Callable[[Path], None] | None = None) -> None:
    """Accelerate's ``save_state`` into ``final.tmp``, then renamed to ``final`` (replacing an older
    ``final``, e.g. the same step saved again after a resume), so a kill never leaves a half-written
    ``final``. Every process must call it; only the main process creates, fills and renames the folder.
    ``before_rename(tmp)`` runs on the main process after the save, to add files of the caller's own.
    """
    tmp = temp_path(final)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if before_rename is not None:
            before_rename(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
    accelerator.wait_for_everyone()
