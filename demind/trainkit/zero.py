"""DeepSpeed (ZeRO) under ``accelerate launch``: refuse where it cannot run, fill its config from the train config.

``accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml train.py ...`` asks for
DeepSpeed; the command passes that request to its trainer (:func:`demind.training.train` or the
triplet trainer). Either DeepSpeed's engine then trains (the start-up line says
``DistributedType.DEEPSPEED``) or the run stops with one :class:`DeepSpeedError` /
:class:`~demind.errors.MissingDependencyError` line: it never falls back to plain data parallelism
while the launcher's DeepSpeed settings are ignored.

The train config is the one source of truth for the numbers DeepSpeed also holds: the micro batch,
the accumulation steps, the gradient clipping (null -> 0, DeepSpeed's "no clipping") and the mixed
precision (Accelerate passes it to DeepSpeed's ``bf16`` / ``fp16`` sections); each trainer names the
settings they come from (De-MINDS's: ``DEMINDS_SOURCES`` in :mod:`demind.training.accel`). Keys the
launcher's config leaves out or sets to ``auto`` are filled from it; a number set there that differs
is refused, naming both.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from demind.errors import DemindError, MissingDependencyError
from demind.trainkit.accelerator import is_deepspeed

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[train,deepspeed]'"
DEEPSPEED_LAUNCH = "accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml"
OTHER_LAUNCHERS = "or launch without DeepSpeed (configs/accelerate/single_gpu.yaml or multi_gpu.yaml)"


class DeepSpeedError(DemindError):
    """DeepSpeed was asked for but cannot run as asked: another device than ``run.device``, or a
    DeepSpeed config whose numbers contradict the train config."""


def deepspeed_device(device: str) -> str:
    """Check, before any process group exists, that DeepSpeed can run here on ``device`` (``run.device``).

    Returns the device type DeepSpeed's accelerator trains on (``"cpu"``, ``"cuda"``, ...). Raises
    :class:`MissingDependencyError` when DeepSpeed cannot be imported, :class:`DeepSpeedError` when
    its accelerator is not the device ``device`` names (DeepSpeed picks CUDA when it sees a GPU,
    else its CPU accelerator; ``DS_ACCELERATOR=cpu`` forces the CPU).
    """
    try:
        import deepspeed  # noqa: F401 - the import is the check
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        raise MissingDependencyError(f"the launcher asked for DeepSpeed (a DeepSpeed --config_file) but it cannot be "
                                     f"imported ({e}); install it with {INSTALL_HINT}, {OTHER_LAUNCHERS}") from None
    wanted = device
    device = get_accelerator().device_name()
    if wanted in ("cpu", "cuda") and device != wanted:
        fix = ("set DS_ACCELERATOR=cpu to train on the CPU" if wanted == "cpu" else
               "run it where a CUDA GPU is visible")
        raise DeepSpeedError(f"config key 'run.device' = {wanted!r}, but DeepSpeed's accelerator here is {device!r}; "
                             f"{fix}, or set run.device=auto")
    if device == "cpu" and torch.cuda.is_available():
        raise DeepSpeedError("DeepSpeed's accelerator is the CPU (DS_ACCELERATOR=cpu) while a CUDA GPU is visible: "
                             "hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU, or unset DS_ACCELERATOR")
    return device


def refuse_without_deepspeed(accelerator, launch: str = DEEPSPEED_LAUNCH) -> None:
    """The launcher asked for DeepSpeed: refuse, naming the ``launch`` that gives it, when Accelerate set up
    another engine (it would train without the launcher's DeepSpeed settings)."""
    if not is_deepspeed(accelerator):
        raise DeepSpeedError(f"the launcher asked for DeepSpeed but Accelerate set up {accelerator.distributed_type}; "
                             f"launch with `{launch}`")


def fill_deepspeed_config(plugin, *, micro_batch: int, num_processes: int, grad_accum_steps: int,
                          grad_clip: float | None, sources: dict[str, str]) -> dict[str, Any]:
    """Fill the DeepSpeed config of Accelerate's ``plugin`` (before ``accelerator.prepare``).

    Sets ``train_micro_batch_size_per_gpu`` (Accelerate can only infer it from a DataLoader, and the
    trainers prepare none), ``train_batch_size``, ``gradient_accumulation_steps`` and
    ``gradient_clipping`` where the launcher's config leaves them out or ``auto``; raises
    :class:`DeepSpeedError` naming both values where it sets one that differs, and ``sources``, the
    setting each comes from. Returns the config.
    """
    config = plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch * num_processes * grad_accum_steps,
        # null: no clipping, which DeepSpeed spells 0 (Accelerate would otherwise fill "auto" with 1.0)
        "gradient_clipping": float(grad_clip or 0.0),
    }
    for key, value in wanted.items():
        source = sources[key]
        given = config.get(key, "auto")
        if given == "auto":
            config[key] = value
        elif float(given) != float(value):
            raise DeepSpeedError(f"the DeepSpeed config sets {key}: {given}, but the train config gives {value} "
                                 f"({source}); remove {key} from the DeepSpeed config (the train config fills it) "
                                 f"or make the two equal")
    zero = config.get("zero_optimization", {}).get("stage")
    logger.info("DeepSpeed ZeRO stage %s: micro batch %d, accumulation %d, gradient clipping %s, %s",
                zero, micro_batch, grad_accum_steps, grad_clip or "off", deepspeed_precision(config))
    return config


def deepspeed_precision(config: dict[str, Any]) -> str:
    """The weight precision a DeepSpeed config trains in: ``bf16``, ``fp16`` or ``fp32``."""
    for name in ("bf16", "fp16"):
        if config.get(name, {}).get("enabled") is True:
            return name
    return "fp32"


def hold_scalars_as_vectors(model: torch.nn.Module) -> None:
    """Hold ``model``'s 0-dim parameters (De-MINDS's gate and temperature) as shape (1,), before
    DeepSpeed builds its engine.

    DeepSpeed 0.19 broadcasts every parameter at start-up as bytes (``p.data.view(torch.uint8)``),
    which fails on a 0-dim tensor. They stay (1,) for the run (autograd and ZeRO's buffers keep the
    shape they saw); :class:`demind.model.DeMinds` saves and loads them 0-dim, so checkpoints and
    exports are the same as without DeepSpeed.
    """
    for p in model.parameters():
        if p.dim() == 0:
            p.data = p.data.reshape(1)


def use_full_precision_weights(model: torch.nn.Module) -> int:
    """Put DeepSpeed's float32 master weights into ``model``'s (bf16/fp16) parameters, for the export.

    Under DeepSpeed's bf16 the module holds rounded copies while the optimizer updates float32
    masters; the export (and every command reading it) should get the masters. Call it in every
    process after the last step (ZeRO gathers each master from its shards). Returns how many
    parameters it replaced (0 when the engine trains in float32).
    """
    from deepspeed.utils import safe_get_full_fp32_param

    replaced = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            master = safe_get_full_fp32_param(param)
            if master is not None:
                param.data = master.reshape(param.shape).to(param.device)
                replaced += 1
    return replaced
