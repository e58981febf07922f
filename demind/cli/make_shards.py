r"""``demind-make-shards`` / ``python data_gen/make_shards.py``: build img2dataset-style input shards
from a folder of images and a CSV/JSONL of captions.

    demind-make-shards --images photos/ --captions captions.csv --output shards/mine
    demind-make-shards --images photos/ --captions captions.jsonl --output shards/mine \
        --image-column file --caption-column text --samples-per-shard 1000

CSV needs a header row; JSONL needs one object per line. Image paths are relative to --images.
Other columns are kept in each sample's json. Skipped rows are listed with their file, line and
reason (rows read = written + skipped). CSV is read one record per line (an unterminated quote
costs only its own row); a line that is not UTF-8 is skipped naming its byte offset.
An --output that already holds shards is refused unless --overwrite (which removes stale ones).
"""

from __future__ import annotations

import argparse
import json

from demind.cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demind-make-shards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", required=True, help="folder the image paths in --captions are relative to")
    parser.add_argument("--captions", required=True, help=".csv (with header) or .jsonl caption file")
    parser.add_argument("--output", required=True, help="folder for 00000.tar, 00001.tar, ... and their _stats.json")
    parser.add_argument("--samples-per-shard", type=int, default=10000, help="samples per tar (img2dataset: 10000)")
    parser.add_argument("--image-column", default="image", help="column/field holding the image path")
    parser.add_argument("--caption-column", default="caption", help="column/field holding the caption")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the shards of an earlier build in --output (its stale shards are removed)")
    return parser


def make_shards_command(args: argparse.Namespace) -> int:
    """Build the shards; print what was written and the first 20 skipped rows with their reasons."""
    from demind.gen.ingest import build_shards

    report = build_shards(args.images, args.captions, args.output, args.samples_per_shard,
                          args.image_column, args.caption_column, overwrite=args.overwrite)
    print(f"read {report.rows_read} rows from {args.captions}: wrote {report.written} samples into "
          f"{len(report.shards)} shard(s) in {args.output}; skipped {sum(report.skipped.values())}: "
          f"{json.dumps(dict(report.skipped))}")
    if report.removed:
        print(f"removed {len(report.removed)} stale file(s) of an earlier build: "
              + ", ".join(p.name for p in report.removed))
    for row in report.skipped_rows[:20]:
        print(f"  {row['file']} line {row['line']}: {row['reason']} {row['detail']}")
    if len(report.skipped_rows) > 20:
        print(f"  ... and {len(report.skipped_rows) - 20} more")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_command(build_parser(), make_shards_command, argv)
