"""``python -m demind.cli.train_exclmm --config configs/exclmm/toy.yaml [a.b=c ...]``: train ExclMM.

Rerunning the same command resumes from ``<run.output_dir>/state.safetensors``; a finished run
(``exclmm.safetensors`` present) is left as is. The work happens in :mod:`demind.exclmm.train`.
"""

from __future__ import annotations

import sys

from demind.cli.common import config_parser, run_config_command
from demind.exclmm.config import ExclMMConfig


def build_parser():
    return config_parser(ExclMMConfig, "demind-train-exclmm",
                         "Train ExclMM on an ExclCOCO training split (frozen CLIP).",
                         config_help="YAML recipe, e.g. configs/exclmm/toy.yaml (defaults: ViT-L-14, d=1000)")


def train_exclmm_command(cfg: ExclMMConfig) -> int:
    """Train (or resume), print the export path."""
    from demind.settings import resolve_device
    from demind.exclmm.train import train_exclmm

    cfg.run.device = resolve_device(cfg.run.device)
    path = train_exclmm(cfg)
    print(f"exclmm: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(ExclMMConfig, build_parser(), train_exclmm_command, argv)


if __name__ == "__main__":
    sys.exit(main())
