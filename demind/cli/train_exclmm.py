"""Train ExclMM: ``python -m demind.cli.train_exclmm --config configs/exclmm/toy.yaml [a.b=c ...]``.

Rerunning the same command resumes from ``<run.output_dir>/state.pt``; a finished run
(``exclmm.safetensors`` present) is left as is. The work happens in :mod:`demind.exclmm.train`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demind.cli.train_exclmm",
                                     description="Train ExclMM on an ExclCOCO training split (frozen CLIP).")
    parser.add_argument("--config", help="YAML recipe, e.g. configs/exclmm/toy.yaml (defaults: ViT-L-14, d=1000)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train=data/exclcoco/train run.seed=1")
    parser.add_argument("--debug", action="store_true", help="full tracebacks")
    args = parser.parse_args(argv)

    from demind.config import ConfigError, load_config
    from demind.exclmm.train import ExclMMConfig, train_exclmm
    from demind.logs import setup_logging

    setup_logging(logging.INFO)
    try:
        cfg = load_config(ExclMMConfig, args.config, args.overrides)
    except ConfigError as exn:
        parser.error(str(exn))
    try:
        path = train_exclmm(cfg)
    except (ValueError, FileNotFoundError) as exn:
        if args.debug or os.environ.get("DEMIND_DEBUG") == "1":
            raise
        print(f"error: {exn}", file=sys.stderr)
        return 2
    print(f"exclmm: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
