"""``demind-train-triplets --config RECIPE.yaml [a.b=c ...]``: supervised training on (reference,
modification, target) triplets (a combiner over a frozen CLIP; docs/training.md).

Rerunning the same command resumes from ``<run.output_dir>/state.safetensors``; a finished run
(``combiner.safetensors`` present) is left as is. Several processes:
``accelerate launch --config_file configs/accelerate/multi_cpu.yaml -m demind.cli.train_triplets ...``
(``optim.batch_size`` is the global batch). The work happens in :mod:`demind.triplets.train`.
"""

from __future__ import annotations

import logging
import os
import sys

from demind.cli.common import config_parser, run_config_command
from demind.triplets.config import TripletTrainConfig


def build_parser():
    return config_parser(TripletTrainConfig, "demind-train-triplets",
                         "Train a combiner on labelled triplets (CIRR / FashionIQ training split or your own file), "
                         "optionally robust to noisy triplets (robust.mode).",
                         config_help="YAML recipe, e.g. the train.yaml that `python -m toyworld.cli.triplets` writes")


def train_triplets_command(cfg: TripletTrainConfig) -> int:
    """Train (or resume), print the checkpoint's path."""
    from demind.settings import resolve_device
    from demind.triplets.train import train_triplets

    cfg.run.device = resolve_device(cfg.run.device)
    # WORLD_SIZE: the processes the launcher started (a GPU launch Accelerate cannot honour is refused)
    # `accelerate launch` with a DeepSpeed config says so in ACCELERATE_USE_DEEPSPEED: DeepSpeed then
    # trains or the run is refused, never a silent fallback
    path = train_triplets(cfg, launched_processes=int(os.environ.get("WORLD_SIZE", "1") or 1),
                          deepspeed=os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")
    print(f"combiner: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    # Info logs from the main process only (RANK is set by accelerate launch / torchrun).
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    return run_config_command(TripletTrainConfig, build_parser(), train_triplets_command, argv, log_level=level)


if __name__ == "__main__":
    sys.exit(main())
