"""The training recipe's schema: TrainConfig and its sections, loaded from YAML plus overrides.

This module imports no training code, so the feature-cache builder and the command line can
read a train config without pulling in the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from demind.backbone import BackboneConfig
from demind.config import load_config
from demind.data import DataConfig
from demind.model import ModelConfig


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (per optimizer step)."""

    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)  # open_clip's ViT defaults; the paper does not say
    eps: float = 1e-6
    warmup_steps: int = 10_000
    max_steps: int = 30_000
    schedule: str = "cosine"  # "cosine" | "constant" (after warm-up)
    min_lr_ratio: float = 0.0
    grad_clip: float | None = None  # max global grad norm; null = no clipping
    grad_accum_steps: int = 1
    global_batch_size: int = 1024


@dataclass
class LossConfig:
    distil: bool = True  # false: the "w/o distillation" ablation (L = L_align)


@dataclass
class RunConfig:
    output_dir: str = "runs/demind"
    seed: int = 0
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16"
    cpu: bool = False  # force CPU even when a GPU is visible
    log_every: int = 50
    save_every: int = 1000
    keep_checkpoints: int = 2
    resume: bool = True
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # used when installed
    progress: bool = True  # tqdm bar (the log line every log_every steps is printed either way)


@dataclass
class TrainConfig:
    """A training recipe (configs/train/*.yaml): the frozen backbone, the model, and how to train it."""

    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    run: RunConfig = field(default_factory=RunConfig)


def load_train_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """TrainConfig from a YAML recipe plus dotted overrides (see demind.config.load_config)."""
    return load_config(TrainConfig, path, overrides)

