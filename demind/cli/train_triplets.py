"""``demind-train-triplets --config RECIPE.yaml [a.b=c ...]``: supervised training on (reference,
modification, target) triplets (a combiner over a frozen CLIP; docs/training.md).

Rerunning the same command resumes from ``<run.output_dir>/state.safetensors``; a finished run
(``combiner.safetensors`` present) is left as is. Several processes:
``accelerate launch --config_file configs/accelerate/multi_cpu.yaml -m demind.cli.train_triplets ...``
(``optim.batch_size`` is the global batch). The work happens in :mod:`demind.triplets.train`.
"""

from __future__ import annotations

import sys

from demind.cli.common import (config_parser, deepspeed_launch, launched_log_level, launched_processes,
                               run_config_command)
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
    path = train_triplets(cfg, launched_processes=launched_processes(), deepspeed=deepspeed_launch())
    print(f"combiner: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(TripletTrainConfig, build_parser(), train_triplets_command, argv,
                              log_level=launched_log_level())


if __name__ == "__main__":
    sys.exit(main())
