"""The optimizer (AdamW with one no-decay rule and optional per-group lr multipliers) and the
learning-rate schedule (linear warm-up, then cosine or constant), shared by every trainer:
De-MINDS (through :mod:`demind.training.optim`, from its ``optim`` section), ExclMM, the triplet
trainer and the toy CLIP (:func:`build_adamw`, :func:`build_lr_scheduler` with their own numbers).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from demind.config import ConfigError
from demind.schema import SCHEDULES

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """The one no-decay rule: gains, biases, scalars (De-MINDS's gate and temperature, CLIP's
    logit scale) and embedding tables (token and positional embeddings), as in CLIP."""
    return param.ndim < 2 or "embedding" in name


def parameter_groups(named: NamedParameters, weight_decay: float,
                     lr_scales: dict[str, float] | None = None) -> list[dict]:
    """AdamW parameter groups of the trainable (``requires_grad``) parameters in ``named``.

    lr_scales: name prefix -> multiplier of the base lr for the parameters under it (the first
    matching prefix wins; others get 1). Groups come in a fixed order, (scale 1, then the scales in
    ``lr_scales`` order) x (decay, no decay), empty ones left out; each carries its ``lr_scale``.
    """
    scales = {1.0: None, **{s: None for s in (lr_scales or {}).values()}}
    buckets: dict[tuple[float, bool], list[torch.nn.Parameter]] = {(s, nd): [] for s in scales for nd in (False, True)}
    for name, param in named:
        if not param.requires_grad:
            continue
        scale = next((s for prefix, s in (lr_scales or {}).items() if name.startswith(prefix)), 1.0)
        buckets[(scale, no_weight_decay(name, param))].append(param)
    return [dict(params=params, weight_decay=0.0 if nd else weight_decay, lr_scale=scale)
            for (scale, nd), params in buckets.items() if params]


def build_adamw(named: NamedParameters, lr: float, *, weight_decay: float = 0.0,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                lr_scales: dict[str, float] | None = None, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over ``named`` (any subset of a model's named parameters, or several modules' chained),
    grouped by :func:`parameter_groups`; a group's lr is ``lr * lr_scale``. With ``weight_decay=0``
    this is Adam."""
    groups = parameter_groups(named, weight_decay, lr_scales)
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, schedule: str = "cosine",
                  min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based): ``(step + 1) / warmup_steps``
    during the warm-up, then 1 (``constant``) or a cosine from 1 down to ``min_lr_ratio`` at
    ``total_steps`` (and that value after it)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ConfigError(f"the schedule must be 'cosine' or 'constant', got {schedule!r}")
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                       schedule: str = "cosine", min_lr_ratio: float = 0.0, *,
                       key: str = "the schedule") -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR of :func:`warmup_cosine`; call ``scheduler.step()`` once per optimizer step.
    Its ``state_dict`` is plain numbers (no function), so it goes into a state file. ``key`` names
    the setting in the error for an unknown ``schedule`` (a config built in code skips load_config's check)."""
    if schedule not in SCHEDULES:  # fail now, not after the warm-up
        raise ConfigError(f"{key} must be one of {SCHEDULES}, got {schedule!r}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps, schedule, min_lr_ratio))
