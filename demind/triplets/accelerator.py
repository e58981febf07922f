"""How ``demind-train-triplets`` runs under ``accelerate launch``: the Accelerator (one process,
several, or DeepSpeed's engine) and DeepSpeed's own state.

The pieces are the shared trainer parts (:mod:`demind.trainkit`): the refusal of a GPU launch that
Accelerate would quietly run on the CPU, each process's share of a batch (``ProcessShare``), the
DeepSpeed device check and config filling. The triplet trainer adds what its recipe differs in:
``optim.batch_size`` is the global batch (no accumulation, no clipping, float32 only), and its
resumable state is one file (:mod:`demind.trainkit.state_file`), beside which DeepSpeed's engine
keeps its sharded optimizer in ``deepspeed_state/epoch_N`` (Accelerate's ``save_state``), named by
the state file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from demind.config import ConfigError
from demind.trainkit import DEEPSPEED_LAUNCH, is_deepspeed
from demind.triplets.config import TripletTrainConfig
from demind.triplets.modes import NBL_MODES

ENGINE_STATES = "deepspeed_state"
# the settings DeepSpeed's numbers come from, named when a DeepSpeed config contradicts them
TRIPLET_SOURCES = {"train_micro_batch_size_per_gpu": "optim.batch_size / processes",
                   "gradient_accumulation_steps": "demind-train-triplets does not accumulate gradients",
                   "train_batch_size": "optim.batch_size",
                   "gradient_clipping": "demind-train-triplets does not clip gradients"}


def make_accelerator(cfg: TripletTrainConfig, launched_processes: int = 1, *, deepspeed: bool = False):
    """The Accelerator of one run: one process on ``run.device``, the launcher's processes, or
    DeepSpeed's engine (``deepspeed``: the launcher asked for it; it trains or the run is refused)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

    from demind.trainkit import deepspeed_device, refuse_cpu_fallback, refuse_without_deepspeed

    if cfg.run.device.startswith("cuda:"):
        if launched_processes > 1 or deepspeed:
            raise ConfigError(f"config key 'run.device' = {cfg.run.device!r}: the launcher places each process on "
                              f"its GPU; use run.device=cuda", key="run.device")
        torch.cuda.set_device(torch.device(cfg.run.device))  # Accelerate places one process on the current device
    # P_neg only gets a gradient in the NBL modes: the others leave it unused
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=cfg.robust.mode not in NBL_MODES)]
    if deepspeed and deepspeed_device(cfg.run.device) == "cpu":  # DeepSpeed's CPU accelerator talks over gloo
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    # cpu=True would make Accelerate drop DeepSpeed: DeepSpeed's own accelerator places it instead
    accelerator = Accelerator(cpu=cfg.run.device == "cpu" and not deepspeed, kwargs_handlers=handlers)
    refuse_cpu_fallback(accelerator, cfg.run.device, launched_processes)
    if deepspeed:
        refuse_without_deepspeed(accelerator, f"{DEEPSPEED_LAUNCH} --mixed_precision no")
    if accelerator.mixed_precision != "no":
        raise ConfigError(f"the launcher asks for mixed precision {accelerator.mixed_precision}, but "
                          f"demind-train-triplets trains in float32 (cached float32 features, a small combiner); "
                          f"launch with --mixed_precision no")
    if cfg.optim.batch_size % accelerator.num_processes:
        raise ConfigError(f"optim.batch_size={cfg.optim.batch_size} (the global batch) does not split into "
                          f"{accelerator.num_processes} processes; make it a multiple of {accelerator.num_processes}",
                          key="optim.batch_size")
    return accelerator


def prepare(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch_size: int):
    """``accelerator.prepare(model, optimizer)``; under DeepSpeed its config is filled first (micro
    batch = ``batch_size`` / processes). The schedule is not prepared: the trainer steps it once per
    step (Accelerate would step it once per process)."""
    if is_deepspeed(accelerator):
        from demind.trainkit import fill_deepspeed_config

        fill_deepspeed_config(accelerator.state.deepspeed_plugin, micro_batch=batch_size // accelerator.num_processes,
                              num_processes=accelerator.num_processes, grad_accum_steps=1, grad_clip=None,
                              sources=TRIPLET_SOURCES)
    return accelerator.prepare(model, optimizer)


def save_engine_state(accelerator, out: Path, epoch: int) -> str | None:
    """Under DeepSpeed, its engine's state after ``epoch`` into ``deepspeed_state/epoch_N`` (every
    process calls it; written to ``*.tmp``, then renamed); returns the folder relative to ``out``,
    None elsewhere (the state file then holds the optimizer)."""
    if not is_deepspeed(accelerator):
        return None
    from demind.trainkit import save_accelerator_state_atomically

    name = f"{ENGINE_STATES}/epoch_{epoch}"
    save_accelerator_state_atomically(accelerator, out / name)
    return name


def load_engine_state(accelerator, folder: Path) -> None:
    accelerator.load_state(str(folder))


def remove_engine_states(out: Path, keep: str | None = None) -> None:
    """Delete DeepSpeed's engine states in ``out`` but ``keep`` (the one the state file names)."""
    root = out / ENGINE_STATES
    for folder in root.glob("epoch_*") if root.is_dir() else []:
        if keep is None or folder != out / keep:
            shutil.rmtree(folder, ignore_errors=True)
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)


def check_same_engine(state_path: Path, extra: dict, accelerator) -> str | None:
    """The DeepSpeed engine state a resumed run continues from (None: the state file holds it all);
    a state written under DeepSpeed resumes only under it, and the other way round: one line."""
    from demind.trainkit import ResumeError

    written = extra.get("engine_state")
    running = is_deepspeed(accelerator)
    if bool(written) != running:
        raise ResumeError(f"cannot resume from {state_path}: it was written {'under' if written else 'without'} "
                          f"DeepSpeed and this run is {'' if running else 'not '}using it; launch as the run that "
                          f"wrote it, or use a new run.output_dir")
    if written and not (state_path.parent / written).is_dir():
        raise ResumeError(f"cannot resume from {state_path}: DeepSpeed's state {state_path.parent / written} is "
                          f"missing; delete {state_path} to restart the run")
    return written
