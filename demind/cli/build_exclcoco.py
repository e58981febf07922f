"""Build ExclCOCO from COCO-format annotations (the format is documented in :mod:`demind.exclcoco`).

    python -m demind.cli.build_exclcoco --annotations data/coco/annotations --split val2017 \\
        --images data/coco/val2017 --out data/exclcoco/val2017

Reads ``instances_{split}.json`` and ``captions_{split}.json``; writes ``OUT/exclcoco.json`` and
prints the counts. ``--query-source llm --llm-config configs/data_gen/llava-1.6-7b.yaml`` writes
the query texts with the data_gen engine named there (vLLM or transformers) and the few-shot
prompt ``demind/gen/exclusion_prompts/<--prompt-version>.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from demind.cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demind.cli.build_exclcoco", description=__doc__.split("\n")[0])
    p.add_argument("--annotations", required=True, help="folder with instances_{split}.json and captions_{split}.json")
    p.add_argument("--split", default="val2017")
    p.add_argument("--images", required=True, help="folder of the split's images (file_name is relative to it)")
    p.add_argument("--out", required=True, help="output folder (exclcoco.json)")
    p.add_argument("--caption-min-images", type=int, default=50,
                   help="a caption word becomes a label if it is in the captions of at least this many images (0: off)")
    p.add_argument("--max-per-caption", type=int, default=3, help="exclusion combinations kept per caption")
    p.add_argument("--max-ground-truth", type=int, default=0, help="drop queries with more ground truth (0: no cap)")
    p.add_argument("--max-queries", type=int, default=0, help="keep a seeded random subset of N queries (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--query-source", default="template", choices=("template", "llm"))
    p.add_argument("--llm-config", help="data_gen YAML (engine + sampling sections) for --query-source llm")
    p.add_argument("--prompt-version", default="v1")
    return p


def build_exclcoco_command(args: argparse.Namespace) -> int:
    """Build the benchmark, print the counts and the output path."""
    from demind.exclcoco import ExclCocoConfig, build_exclcoco, llm_query_writer

    ann = Path(args.annotations)
    cfg = ExclCocoConfig(caption_min_images=args.caption_min_images, max_per_caption=args.max_per_caption,
                         max_ground_truth=args.max_ground_truth, max_queries=args.max_queries, seed=args.seed,
                         query_source=args.query_source, prompt_version=args.prompt_version)
    llm = build_llm(args, cfg, llm_query_writer) if args.query_source == "llm" else None
    path, counts = build_exclcoco(ann / f"instances_{args.split}.json", ann / f"captions_{args.split}.json",
                                  args.out, args.images, cfg, llm=llm, split=args.split)
    print(counts.summary())
    print(f"exclcoco: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_command(build_parser(), build_exclcoco_command, argv)


def build_llm(args: argparse.Namespace, cfg, llm_query_writer):
    """The data_gen engine of ``--llm-config`` wrapped as the builder's ``llm``."""
    if not args.llm_config:
        raise ValueError("--query-source llm needs --llm-config (a data_gen YAML, e.g. configs/data_gen/tiny-cpu.yaml)")
    from demind.config import load_config
    from demind.gen.config import GenConfig
    from demind.gen.engines import build_engine

    gen = load_config(GenConfig, args.llm_config)
    engine = build_engine(gen.engine, gen.sampling)
    return llm_query_writer(engine, cfg.prompt_version, gen.sampling.seed, cfg.llm_max_tokens,
                            gen.io.image_max_side, gen.quality.repeat_ngram, gen.quality.max_ngram_repeats)


if __name__ == "__main__":
    sys.exit(main())
