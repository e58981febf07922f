"""``demind-train`` / ``accelerate launch train.py --config configs/train/paper.yaml [a.b=c ...]``.

Also runs in one process (``python train.py ...``).  Rerunning the same command resumes
from the newest checkpoint in ``run.output_dir``.  The work happens in :mod:`demind.training`.
"""

from __future__ import annotations

from demind.cli.common import (config_parser, deepspeed_launch, launched_log_level, launched_processes,
                               run_config_command)
from demind.training.config import TrainConfig


def build_parser():
    return config_parser(TrainConfig, "demind-train", "Train De-MINDS on intent shards.",
                         config_help="YAML recipe, e.g. configs/train/smoke.yaml (defaults: the paper's)")


def train_command(cfg: TrainConfig) -> int:
    """Train, print the exported checkpoint path."""
    from demind.training import train

    path = train(cfg, deepspeed=deepspeed_launch(), launched_processes=launched_processes())
    print(f"checkpoint: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(TrainConfig, build_parser(), train_command, argv, log_level=launched_log_level())
