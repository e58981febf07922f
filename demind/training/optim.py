"""De-MINDS's optimizer and schedule from its ``optim`` section: AdamW (:func:`build_optimizer`) with
the gate alpha's own learning rate (``optim.gate_lr``), and the warm-up + cosine schedule
(:func:`build_scheduler`), both built on the shared pieces of :mod:`demind.trainkit`.
"""

from __future__ import annotations

import torch

from demind.config import ConfigError
from demind.trainkit import build_adamw, build_lr_scheduler, warmup_cosine
from demind.training.config import OptimConfig


GATE = "gate"  # De-MINDS's parameter name of alpha


def gate_lr_scales(optim: OptimConfig) -> dict[str, float] | None:
    """``optim.gate_lr`` as a multiplier of ``optim.lr`` for the gate alone (None: no own lr)."""
    return None if optim.gate_lr is None else {GATE: optim.gate_lr / optim.lr}


def build_optimizer(optim: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """De-MINDS's AdamW from ``optim`` over the model's trainable parameters; the gate alpha gets
    ``optim.gate_lr`` when set (its group's ``lr_scale`` = gate_lr / lr, the same schedule)."""
    # lr_scales match by name prefix: "gate" is alpha alone (no other parameter name starts with it)
    named = list(model.named_parameters())
    scales = gate_lr_scales(optim)
    if scales and not any(name == GATE for name, p in named if p.requires_grad):
        raise ConfigError("optim.gate_lr is set but the model has no trainable gate; unset optim.gate_lr",
                          key="optim.gate_lr")
    return build_adamw(named, optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas), eps=optim.eps,
                       lr_scales=scales)


def gate_lr(optimizer: torch.optim.Optimizer, gate: torch.nn.Parameter, optim: OptimConfig) -> float:
    """The lr the optimizer applies to ``gate`` now (its group's, after the scheduler). The group is
    found by holding ``gate``; under DeepSpeed, whose groups hold its own flat partitions instead,
    by the ``lr_scale`` that :func:`build_optimizer` gave the gate's group."""
    for group in optimizer.param_groups:
        if any(p is gate for p in group["params"]):
            return group["lr"]
    scale = (gate_lr_scales(optim) or {}).get(GATE, 1.0)
    return next(g["lr"] for g in optimizer.param_groups if g.get("lr_scale") == scale)


def lr_factor(step: int, optim: OptimConfig) -> float:
    """Multiplier of optim.lr at optimizer step ``step``: :func:`warmup_cosine` with ``optim``'s numbers."""
    return warmup_cosine(step, optim.warmup_steps, optim.max_steps, optim.schedule, optim.min_lr_ratio)


def build_scheduler(optim: OptimConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """De-MINDS's schedule from ``optim``."""
    return build_lr_scheduler(optimizer, optim.warmup_steps, optim.max_steps, optim.schedule, optim.min_lr_ratio,
                              key="optim.schedule")
