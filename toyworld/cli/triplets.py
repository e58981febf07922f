"""``python -m toyworld.cli.triplets --out runs/toy-triplets``: toy training triplets, the toy CIRR test
and a ``demind-train-triplets`` recipe (:mod:`toyworld.triplets`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from toyworld.triplets import write_toy_triplets

    parser = argparse.ArgumentParser(prog="python -m toyworld.cli.triplets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--train-sets", type=int, default=2500, help="toy CIRR sets of training triplets (2 each)")
    parser.add_argument("--test-sets", type=int, default=1500, help="toy CIRR test sets (ids 0..N-1)")
    args = parser.parse_args(argv)
    record = write_toy_triplets(args.out, args.train_sets, args.test_sets)
    print(f"{record['triplets']} triplets: {Path(args.out) / record['train']}\n"
          f"test: {Path(args.out) / 'cirr'}\nrecipe: {Path(args.out) / 'train.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
