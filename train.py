"""Train De-MINDS: ``accelerate launch train.py --config configs/train/paper.yaml [a.b=c ...]``.

Also runs as ``python train.py ...`` in one process.  Rerunning the same command resumes
from the newest checkpoint in ``run.output_dir``.  The work happens in demind.training.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse ``--config`` and dotted overrides, train, print the exported checkpoint path."""
    parser = argparse.ArgumentParser(prog="train.py", description="Train De-MINDS on intent shards.")
    parser.add_argument("--config", help="YAML recipe, e.g. configs/train/smoke.yaml (defaults: the paper's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5 run.output_dir=runs/x")
    args = parser.parse_args(argv)

    from demind.logs import setup_logging
    from demind.training import load_train_config, train

    # Info logs from the main process only (RANK is set by accelerate launch / torchrun).
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    setup_logging(level)
    try:
        cfg = load_train_config(args.config, args.overrides)
    except ValueError as exn:  # ConfigError (unknown key, bad type) or a section's own check
        parser.error(str(exn))
    path = train(cfg)
    print(f"checkpoint: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
