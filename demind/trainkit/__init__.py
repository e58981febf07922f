"""The pieces every trainer shares (De-MINDS, the triplet trainer, ExclMM, the toy CLIP).

Modules: ``accelerator`` (the refusal of a GPU launch Accelerate would run on the CPU, the gather
with gradients, trackers, an atomic ``save_state``), ``processes`` (each process's share of a
global batch: ``ProcessShare``), ``zero`` (DeepSpeed under ``accelerate
launch``: device check, config filling), ``optim`` (``build_adamw``, ``build_lr_scheduler``),
``finite`` (``check_finite_terms``), ``metrics_log`` (``LogWindow``, ``step_line``,
``append_metrics``) and ``state_file`` (``save_train_state`` / ``load_train_state`` /
``restore_train_state``: safetensors + JSON, no pickle; De-MINDS resumes through Accelerate's
``save_state`` instead, see :mod:`demind.training.resume`). Nothing here imports a trainer.
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.trainkit.accelerator import (
        CPU_LAUNCH_CONFIG, available_trackers, is_deepspeed, make_gather, refuse_cpu_fallback,
        save_accelerator_state_atomically)
    from demind.trainkit.processes import ONE_PROCESS, ProcessShare, process_share
    from demind.trainkit.finite import NonFiniteLossError, check_finite_terms, finite_flags, raise_non_finite
    from demind.trainkit.metrics_log import LogWindow, append_metrics, step_line, term_parts, trim_metrics
    from demind.trainkit.optim import build_adamw, build_lr_scheduler, warmup_cosine
    from demind.trainkit.state_file import (
        ResumeError, StateFileError, load_train_state, load_tree, restore_train_state, save_train_state, save_tree)
    from demind.trainkit.zero import (
        DEEPSPEED_LAUNCH, DeepSpeedError, deepspeed_device, deepspeed_precision, fill_deepspeed_config,
        hold_scalars_as_vectors, refuse_without_deepspeed, use_full_precision_weights)

# names resolved on first use: importing the face loads no torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.trainkit.accelerator": ["CPU_LAUNCH_CONFIG", "available_trackers", "is_deepspeed", "make_gather",
                                    "refuse_cpu_fallback", "save_accelerator_state_atomically"],
    "demind.trainkit.processes": ["ONE_PROCESS", "ProcessShare", "process_share"],
    "demind.trainkit.finite": ["NonFiniteLossError", "check_finite_terms", "finite_flags", "raise_non_finite"],
    "demind.trainkit.metrics_log": ["LogWindow", "append_metrics", "step_line", "term_parts", "trim_metrics"],
    "demind.trainkit.optim": ["build_adamw", "build_lr_scheduler", "warmup_cosine"],
    "demind.trainkit.state_file": ["ResumeError", "StateFileError", "load_train_state", "load_tree",
                                   "restore_train_state", "save_train_state", "save_tree"],
    "demind.trainkit.zero": ["DEEPSPEED_LAUNCH", "DeepSpeedError", "deepspeed_device", "deepspeed_precision",
                             "fill_deepspeed_config", "hold_scalars_as_vectors", "refuse_without_deepspeed",
                             "use_full_precision_weights"],
})

__all__ = ["CPU_LAUNCH_CONFIG", "available_trackers", "is_deepspeed", "make_gather", "refuse_cpu_fallback",
           "save_accelerator_state_atomically", "ONE_PROCESS", "ProcessShare", "process_share", "NonFiniteLossError",
           "check_finite_terms", "finite_flags", "raise_non_finite", "LogWindow", "append_metrics", "step_line",
           "term_parts", "trim_metrics", "build_adamw", "build_lr_scheduler", "warmup_cosine", "ResumeError",
           "StateFileError", "load_train_state", "load_tree", "restore_train_state", "save_train_state", "save_tree",
           "DEEPSPEED_LAUNCH", "DeepSpeedError", "deepspeed_device", "deepspeed_precision", "fill_deepspeed_config",
           "hold_scalars_as_vectors", "refuse_without_deepspeed", "use_full_precision_weights"]
