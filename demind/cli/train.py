"""``demind-train`` / ``accelerate launch train.py --config configs/train/paper.yaml [a.b=c ...]``.

Also runs in one process (``python train.py ...``).  Rerunning the same command resumes
from the newest checkpoint in ``run.output_dir``.  The work happens in :mod:`demind.training`.
"""

from __future__ import annotations

import logging
import os

from demind.cli.common import config_parser, run_config_command
from demind.training.config import TrainConfig


def build_parser():
    return config_parser(TrainConfig, "demind-train", "Train De-MINDS on intent shards.",
                         config_help="YAML recipe, e.g. configs/train/smoke.yaml (defaults: the paper's)")


def train_command(cfg: TrainConfig) -> int:
    """Train, print the exported checkpoint path."""
    from demind.training import train

    # `accelerate launch` with a DeepSpeed config (or --use_deepspeed) says so in this variable;
    # the trainer then uses DeepSpeed or refuses, never falls back.
    # WORLD_SIZE: the processes the launcher started (a GPU launch Accelerate cannot honour is refused)
    path = train(cfg, deepspeed=os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true",
                 launched_processes=int(os.environ.get("WORLD_SIZE", "1") or 1))
    print(f"checkpoint: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    # Info logs from the main process only (RANK is set by accelerate launch / torchrun).
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    return run_config_command(TrainConfig, build_parser(), train_command, argv, log_level=level)
