"""``demind-train`` / ``accelerate launch train.py --config configs/train/paper.yaml [a.b=c ...]``.

Also runs in one process (``python train.py ...``).  Rerunning the same command resumes
from the newest checkpoint in ``run.output_dir``.  The work happens in :mod:`demind.training`.
"""

from __future__ import annotations

import argparse
import logging
import os

from demind.cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demind-train", description="Train De-MINDS on intent shards.")
    parser.add_argument("--config", help="YAML recipe, e.g. configs/train/smoke.yaml (defaults: the paper's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5 run.output_dir=runs/x")
    return parser


def train_command(args: argparse.Namespace) -> int:
    """Load the recipe, train, print the exported checkpoint path."""
    from demind.training import load_train_config, train

    path = train(load_train_config(args.config, args.overrides))
    print(f"checkpoint: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    # Info logs from the main process only (RANK is set by accelerate launch / torchrun).
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    return run_command(build_parser(), train_command, argv, log_level=level)
