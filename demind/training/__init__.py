"""Training De-MINDS on intent shards with Accelerate (one process, DDP or DeepSpeed).

    cfg = load_train_config("configs/train/smoke.yaml", ["optim.max_steps=50"])
    checkpoint = train(cfg)          # -> <run.output_dir>/demind.safetensors

The run folder ``run.output_dir`` holds ``config.yaml`` (resolved config),
``checkpoints/step_XXXXXXXX/`` (see :mod:`demind.training.checkpoints`), ``metrics.jsonl``
(one JSON line per log step), ``logs/`` (trackers) and, at the end,
``demind.safetensors`` in the core checkpoint format.  Rerunning the same command resumes
from the newest checkpoint and continues the data stream where it stopped.

Batch sizes: ``optim.global_batch_size`` samples per optimizer step =
micro batch x processes x ``optim.grad_accum_steps``.  The contrastive negatives are
gathered over processes (all_gather with gradients), so each loss sees
micro batch x processes samples; accumulation steps do not share negatives.

Modules: ``config`` (the recipe's schema), ``accel`` (Accelerate set-up), ``optim``
(optimizer and schedule), ``batches`` (data glue), ``step`` (losses and one step),
``checkpoints`` (Accelerate checkpoints and resume), ``metrics_log`` (log lines), ``loop`` (``train``).

The engine pieces every trainer shares (De-MINDS, ExclMM, the toy CLIP): ``optim``
(``build_adamw``, ``build_lr_scheduler``), ``finite`` (``check_finite_terms``),
``metrics_log`` (``LogWindow``, ``step_line``, ``append_metrics``) and ``state_file``
(``save_train_state`` / ``load_train_state`` / ``restore_train_state``: safetensors + JSON,
no pickle; De-MINDS resumes through Accelerate's ``save_state`` instead, see ``checkpoints``).
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.schema import DataConfig
    from demind.training.accel import make_gather, micro_batch_size, refuse_cpu_fallback, setup
    from demind.training.batches import batch_embeddings, build_data, find_feature_cache
    from demind.training.config import LossConfig, OptimConfig, RunConfig, TrainConfig, load_train_config
    from demind.training.loop import EXPORT_NAME, build_modules, train
    from demind.training.metrics_log import LOSS_TERMS, LogWindow, append_metrics, step_line, term_parts, trim_metrics
    from demind.training.finite import NonFiniteLossError, check_finite_terms
    from demind.training.plot import PLOT_NAME, plot_training
    from demind.training.optim import (
        build_adamw, build_lr_scheduler, build_optimizer, build_scheduler, lr_factor, warmup_cosine)
    from demind.training.checkpoints import (
        SPEED_ONLY_KEYS, ResumeError, TrainState, latest_checkpoint, save_accelerator_state_atomically)
    from demind.training.step import check_finite, compute_losses
    from demind.training.zero import DeepSpeedError, deepspeed_device, fill_deepspeed_config
    from demind.training.state_file import (
        StateFileError, load_train_state, load_tree, restore_train_state, save_train_state, save_tree)

# names resolved on first use: importing demind.training.config (the schema) loads no trainer or torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.schema": ["DataConfig"],
    "demind.training.accel": ["make_gather", "micro_batch_size", "refuse_cpu_fallback", "setup"],
    "demind.training.batches": ["batch_embeddings", "build_data", "find_feature_cache"],
    "demind.training.config": ["LossConfig", "OptimConfig", "RunConfig", "TrainConfig", "load_train_config"],
    "demind.training.loop": ["EXPORT_NAME", "build_modules", "train"],
    "demind.training.metrics_log": ["LOSS_TERMS", "LogWindow", "append_metrics", "step_line",
                                     "term_parts", "trim_metrics"],
    "demind.training.finite": ["NonFiniteLossError", "check_finite_terms"],
    "demind.training.plot": ["PLOT_NAME", "plot_training"],
    "demind.training.optim": ["build_adamw", "build_lr_scheduler", "build_optimizer", "build_scheduler",
                               "lr_factor", "warmup_cosine"],
    "demind.training.checkpoints": ["SPEED_ONLY_KEYS", "ResumeError", "TrainState", "latest_checkpoint",
                                    "save_accelerator_state_atomically"],
    "demind.training.step": ["check_finite", "compute_losses"],
    "demind.training.zero": ["DeepSpeedError", "deepspeed_device", "fill_deepspeed_config"],
    "demind.training.state_file": ["StateFileError", "load_train_state", "load_tree", "restore_train_state",
                                    "save_train_state", "save_tree"],
})

__all__ = ["TrainConfig", "OptimConfig", "LossConfig", "RunConfig", "DataConfig", "TrainState", "train",
           "load_train_config", "build_modules", "build_data", "find_feature_cache", "batch_embeddings",
           "build_optimizer", "build_scheduler", "lr_factor", "setup", "micro_batch_size", "make_gather",
           "compute_losses", "check_finite", "latest_checkpoint", "EXPORT_NAME", "LOSS_TERMS",
           "NonFiniteLossError", "ResumeError", "build_adamw", "build_lr_scheduler", "warmup_cosine",
           "check_finite_terms", "save_train_state", "load_train_state", "restore_train_state", "StateFileError",
           "LogWindow", "append_metrics", "step_line", "term_parts", "trim_metrics", "load_tree", "save_tree",
           "PLOT_NAME", "plot_training", "refuse_cpu_fallback", "save_accelerator_state_atomically",
           "DeepSpeedError", "deepspeed_device", "fill_deepspeed_config", "SPEED_ONLY_KEYS"]
