"""The training recipe's schema: TrainConfig and its sections, loaded from YAML plus overrides.

This module imports no training code, so the feature-cache builder and the command line can
read a train config without pulling in the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from demind.config import load_config
from demind.settings import RunSection, setting, threads_setting
# the sections without their torch-bound modules: --help and config checks load no torch
from demind.schema import SCHEDULES, BackboneConfig, DataConfig, ModelConfig, NoiseConfig, heads_problem


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (per optimizer step)."""

    lr: float = setting(1e-6, gt=0)
    # peak lr of the gate alpha alone (same warm-up and schedule); null = lr. Adam moves a scalar by
    # about its lr per step, so tanh(alpha) <= tanh(sum of the gate's lr over the schedule): with the
    # paper's lr 1e-6 that cap is 0.015 (docs/training.md)
    gate_lr: float | None = setting(None, gt=0)
    weight_decay: float = setting(0.1, ge=0)
    betas: tuple[float, float] = setting((0.9, 0.98), ge=0, lt=1)  # open_clip's ViT defaults; the paper does not say
    eps: float = setting(1e-6, gt=0)
    warmup_steps: int = setting(10_000, ge=0)
    max_steps: int = setting(30_000, ge=1)
    schedule: str = setting("cosine", choices=SCHEDULES)  # after warm-up
    min_lr_ratio: float = setting(0.0, ge=0, le=1)
    grad_clip: float | None = setting(None, gt=0)  # max global grad norm; null = no clipping
    grad_accum_steps: int = setting(1, ge=1)
    global_batch_size: int = setting(1024, ge=1)  # samples per optimizer step, over all processes

    def config_problems(self) -> list[tuple[str, str]]:
        if self.global_batch_size >= 1 and self.grad_accum_steps >= 1 and self.global_batch_size % self.grad_accum_steps:
            return [("global_batch_size", f"= {self.global_batch_size} must be a multiple of optim.grad_accum_steps "
                                          f"= {self.grad_accum_steps}")]
        return []


@dataclass
class LossConfig:
    distil: bool = True  # false: the "w/o distillation" ablation (L = L_align)


@dataclass
class TrainRunConfig(RunSection):
    """demind-train's ``run`` section (also read by demind-features). Its ``device`` (RunSection's): cpu
    forces the CPU; auto and cuda let Accelerate give each process its GPU. Training on one chosen GPU goes
    through CUDA_VISIBLE_DEVICES or `accelerate launch --gpu_ids` (Accelerate picks the device per
    process); cuda:N serves demind-features, which reads this section too."""

    output_dir: str = setting("runs/demind", output="dir")
    seed: int = setting(0, ge=0)
    mixed_precision: str = setting("no", choices=("no", "bf16", "fp16"))
    log_every: int = setting(50, ge=1)
    save_every: int = setting(1000, ge=1)
    keep_checkpoints: int = setting(2, ge=0)  # 0 keeps every checkpoint
    resume: bool = True
    trackers: list[str] = setting(default_factory=lambda: ["tensorboard"], refuses=["no-such-tracker"],
                                  help="Accelerate trackers (tensorboard, wandb, ...); one not installed is skipped")
    progress: bool = setting(True, help="tqdm bar (the log line every run.log_every steps is printed either way)")
    threads: int = threads_setting()  # per process under accelerate launch

    def config_problems(self) -> list[tuple[str, str]]:
        """An unknown tracker name is refused with the config (Accelerate's names; it refused it only
        after the model was built)."""
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        unknown = [name for name in self.trackers if name not in LOGGER_TYPE_TO_CLASS]
        if unknown:
            return [("trackers", f"= {self.trackers!r}: unknown tracker(s) {unknown}; choose from "
                                 f"{sorted(LOGGER_TYPE_TO_CLASS)}")]
        return []


@dataclass
class TrainConfig:
    """A training recipe (configs/train/*.yaml): the frozen backbone, the model, and how to train it."""

    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)  # noisy MLLM descriptions (demind.robust)
    run: TrainRunConfig = field(default_factory=TrainRunConfig)

    def config_problems(self) -> list[tuple[str, str]]:
        """The model's attention heads must split the backbone's text width (read from its model config)."""
        problems = []
        from demind.backbone import text_width  # open_clip's model configs (imports torch)

        width = text_width(self.backbone)
        heads_wrong = heads_problem(self.model.num_heads, width) if width is not None else None
        if heads_wrong and self.model.num_heads >= 1:  # below 1 the declared rule already says so
            problems.append(("model.num_heads", f"{heads_wrong} ({self.backbone.name})"))
        if self.noise.mode == "conesep" and self.model.negative_tokens < 1:
            problems.append(("model.negative_tokens", "= 0, but noise.mode=conesep needs ConeSep's negative prompt; "
                                                      "set model.negative_tokens (e.g. 4)"))
        if self.noise.mode != "conesep" and self.model.negative_tokens > 0:
            # an unused parameter would also stop multi-process (DDP) training at its second step
            problems.append(("model.negative_tokens", f"= {self.model.negative_tokens} is only used by "
                                                      f"noise.mode=conesep (here {self.noise.mode!r}); set it to 0"))
        if self.optim.gate_lr is not None and self.model.fusion != "gate":
            problems.append(("optim.gate_lr", f"= {self.optim.gate_lr} sets the gate's lr, but model.fusion="
                                              f"{self.model.fusion} has no gate; unset optim.gate_lr"))
        return problems


def load_train_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """TrainConfig from a YAML recipe plus dotted overrides (see demind.config.load_config)."""
    return load_config(TrainConfig, path, overrides)

