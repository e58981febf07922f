"""``python -m demind.cli.train_exclmm --config configs/exclmm/toy.yaml [a.b=c ...]``: train ExclMM.

Rerunning the same command resumes from ``<run.output_dir>/state.safetensors``; a finished run
(``exclmm.safetensors`` present) is left as is. The work happens in :mod:`demind.exclmm.train`.
"""

from __future__ import annotations

import argparse
import sys

from demind.cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m demind.cli.train_exclmm",
                                     description="Train ExclMM on an ExclCOCO training split (frozen CLIP).")
    parser.add_argument("--config", help="YAML recipe, e.g. configs/exclmm/toy.yaml (defaults: ViT-L-14, d=1000)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train=data/exclcoco/train run.seed=1")
    return parser


def train_exclmm_command(args: argparse.Namespace) -> int:
    """Load the recipe, train (or resume), print the export path."""
    from demind.config import load_config
    from demind.exclmm.train import ExclMMConfig, train_exclmm

    path = train_exclmm(load_config(ExclMMConfig, args.config, args.overrides))
    print(f"exclmm: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_command(build_parser(), train_exclmm_command, argv, intermixed=True)


if __name__ == "__main__":
    sys.exit(main())
