r"""``python data_gen/make_tiny_model.py``: save a tiny random LLaVA-NeXT (model + processor) for CPU
smoke runs of the generation job.

    python data_gen/make_tiny_model.py --output shards/tiny-llava-next
    demind-generate --input shards/mine --output shards/mine-intent \
        --config configs/data_gen/tiny-cpu.yaml engine.model=shards/tiny-llava-next

Its text is random words: it exercises the whole pipeline, not the quality of the data.
"""

from __future__ import annotations

import argparse

from demind.cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="data_gen/make_tiny_model.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="shards/tiny-llava-next", help="folder to save the model and processor")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    return parser


def make_tiny_model_command(args: argparse.Namespace) -> int:
    """Build and save the tiny model; print where."""
    from demind.gen.tiny_llava import build_tiny_llava_next

    path = build_tiny_llava_next(args.output, seed=args.seed)
    print(f"saved tiny LLaVA-NeXT to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_command(build_parser(), make_tiny_model_command, argv)
