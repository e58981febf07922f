r"""``demind-mine-pairs``: pairs of related images mined from a captioned corpus (MegaPairs-style),
the first step of generated triplets (docs/triplets.md).

    demind-mine-pairs --input shards/mine --output shards/mine-pairs --config configs/pairs/tiny-cpu.yaml

Neighbours by the frozen CLIP's image features, its caption features and, where enabled, a second
visual encoder (DINOv2); a pair is kept when its similarity lies in the signal's window. One pair
shard per input shard; rerunning the same command skips finished shards. Schema: shards/README.md.
"""

from __future__ import annotations

import json
import sys

from demind.cli.common import Flag, config_parser, run_config_command
from demind.pairs.config import MinePairsConfig

FLAGS = {"--input": Flag("input"), "--output": Flag("output"), "--overwrite": Flag("overwrite"),
         "--dry-run": Flag("dry_run")}


def build_parser():
    return config_parser(MinePairsConfig, "demind-mine-pairs", __doc__, FLAGS,
                         config_help="YAML recipe, e.g. configs/pairs/tiny-cpu.yaml or configs/pairs/megapairs.yaml")


def mine_pairs_command(cfg: MinePairsConfig) -> int:
    from demind.pairs.corpus import corpus_record
    from demind.pairs.job import format_plan, make_plan, mine_pairs
    from demind.settings import resolve_device

    plan = make_plan(corpus_record(cfg.input, "--input")["shards"], cfg.output, cfg.overwrite)
    print(format_plan(plan, cfg), flush=True)
    if cfg.dry_run:
        print("dry run: stopping before loading a model")
        return 0
    cfg.run.device = resolve_device(cfg.run.device)
    summary = mine_pairs(cfg)
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(MinePairsConfig, build_parser(), mine_pairs_command, argv)


if __name__ == "__main__":
    sys.exit(main())
