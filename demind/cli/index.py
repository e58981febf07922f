"""``demind-index``: encode every image under a folder into a search index.

    demind-index --images photos/ --index runs/photos-index --checkpoint runs/paper/demind.safetensors

Rerunning the same command encodes only new or changed files (by size and modification time)
and drops removed ones; a killed run resumes from its finished parts. Unreadable images are
skipped, counted and listed in ``index.json``.
"""

from __future__ import annotations

import argparse
import sys

from demind.cli.common import run_command
from demind.cli.search import add_model_arguments, load_model
from demind.search.index import build_index


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demind-index", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", required=True, help="folder of images (searched recursively)")
    p.add_argument("--index", required=True, help="index folder to create or update")
    add_model_arguments(p)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2, help="image-decoding workers")
    p.add_argument("--part-size", type=int, default=1024, help="images per saved part (what a kill can lose)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    if not args.checkpoint and not args.backbone:
        raise ValueError("give --checkpoint CKPT (the index is encoded by its frozen backbone), or --backbone NAME:TAG")
    backbone, _ = load_model(args)
    stats = build_index(args.images, args.index, backbone, args.batch_size, args.num_workers, args.part_size,
                        progress=not args.quiet)
    s = stats.as_dict()
    rate = f" at {s['encoded_per_s']} images/s" if s["encoded"] else ""
    print(f"index {args.index}: {s['indexed']} images ({s['encoded']} encoded{rate}, {s['cached']} reused, "
          f"{s['removed']} removed, {s['unreadable']} unreadable) in {s['seconds']} s")
    for name, reason in list(stats.unreadable.items())[:5]:
        print(f"  unreadable: {name}: {reason}")
    if len(stats.unreadable) > 5:
        print(f"  ... and {len(stats.unreadable) - 5} more (listed in {args.index}/index.json)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``demind-index``: build or update the index; prints its counts."""
    return run_command(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
