"""The optimizer (AdamW, no decay on gains, biases, gate and temperature) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from demind.config import ConfigError
from demind.training.config import SCHEDULES, OptimConfig


def build_optimizer(optim: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW; as in CLIP/open_clip, gains, biases, the gate and the temperature get no weight decay."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [dict(params=decay, weight_decay=optim.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


def lr_factor(step: int, optim: OptimConfig) -> float:
    """Multiplier of optim.lr at optimizer step ``step``: linear warm-up, then cosine or constant."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    if optim.schedule != "cosine":
        raise ConfigError(f"optim.schedule must be 'cosine' or 'constant', got {optim.schedule!r}")
    span = max(optim.max_steps - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optim: OptimConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    if optim.schedule not in SCHEDULES:  # a config built in code skips load_config's check: fail now, not after warm-up
        raise ConfigError(f"optim.schedule must be one of {SCHEDULES}, got {optim.schedule!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim))

