r"""Save a tiny random LLaVA-NeXT (model + processor) for CPU smoke runs of the generation job.

    python data_gen/make_tiny_model.py --output shards/tiny-llava-next
    python data_gen/run.py --input shards/mine --output shards/mine-intent \
        --config configs/data_gen/tiny-cpu.yaml engine.model=shards/tiny-llava-next

Its text is random words: it exercises the whole pipeline, not the quality of the data.
"""

from __future__ import annotations

import argparse
import sys

from demind.testing import build_tiny_llava_next


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="data_gen/make_tiny_model.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="shards/tiny-llava-next", help="folder to save the model and processor")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    path = build_tiny_llava_next(args.output, seed=args.seed)
    print(f"saved tiny LLaVA-NeXT to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
