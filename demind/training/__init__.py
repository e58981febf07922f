"""Training De-MINDS on intent shards with Accelerate (one process, DDP or DeepSpeed).

    cfg = load_train_config("configs/train/smoke.yaml", ["optim.max_steps=50"])
    checkpoint = train(cfg)          # -> <run.output_dir>/demind.safetensors

The run folder ``run.output_dir`` holds ``config.yaml`` (resolved config),
``checkpoints/step_XXXXXXXX/`` (see :mod:`demind.training.resume`), ``metrics.jsonl``
(one JSON line per log step), ``logs/`` (trackers) and, at the end,
``demind.safetensors`` in the core checkpoint format.  Rerunning the same command resumes
from the newest checkpoint and continues the data stream where it stopped.

Batch sizes: ``optim.global_batch_size`` samples per optimizer step =
micro batch x processes x ``optim.grad_accum_steps``.  The contrastive negatives are
gathered over processes (all_gather with gradients), so each loss sees
micro batch x processes samples; accumulation steps do not share negatives.

Modules: ``config`` (the recipe's schema), ``accel`` (Accelerate set-up), ``optim``
(optimizer and schedule), ``batches`` (data glue), ``step`` (losses and one step),
``resume`` (Accelerate checkpoints and resume), ``step_log`` (log lines), ``plot`` (the curves),
``loop`` (``train``). The pieces every trainer shares live in :mod:`demind.trainkit`.
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.schema import DataConfig
    from demind.training.accel import micro_batch_size, setup
    from demind.training.batches import batch_embeddings, build_data, find_feature_cache
    from demind.training.config import LossConfig, OptimConfig, TrainConfig, TrainRunConfig, load_train_config
    from demind.training.loop import EXPORT_NAME, build_modules, train
    from demind.training.step_log import LOSS_TERMS
    from demind.training.plot import PLOT_NAME, plot_training
    from demind.training.optim import build_optimizer, build_scheduler, lr_factor
    from demind.training.resume import TrainState, latest_checkpoint
    from demind.training.step import check_finite, compute_losses

# names resolved on first use: importing demind.training.config (the schema) loads no trainer or torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.schema": ["DataConfig"],
    "demind.training.accel": ["micro_batch_size", "setup"],
    "demind.training.batches": ["batch_embeddings", "build_data", "find_feature_cache"],
    "demind.training.config": ["LossConfig", "OptimConfig", "TrainConfig", "TrainRunConfig", "load_train_config"],
    "demind.training.loop": ["EXPORT_NAME", "build_modules", "train"],
    "demind.training.step_log": ["LOSS_TERMS"],
    "demind.training.plot": ["PLOT_NAME", "plot_training"],
    "demind.training.optim": ["build_optimizer", "build_scheduler", "lr_factor"],
    "demind.training.resume": ["TrainState", "latest_checkpoint"],
    "demind.training.step": ["check_finite", "compute_losses"],
})

__all__ = ["TrainConfig", "OptimConfig", "LossConfig", "TrainRunConfig", "DataConfig", "TrainState", "train",
           "load_train_config", "build_modules", "build_data", "find_feature_cache", "batch_embeddings",
           "build_optimizer", "build_scheduler", "lr_factor", "setup", "micro_batch_size",
           "compute_losses", "check_finite", "latest_checkpoint", "EXPORT_NAME", "LOSS_TERMS",
           "PLOT_NAME", "plot_training"]
