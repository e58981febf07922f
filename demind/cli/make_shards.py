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

import json
from dataclasses import dataclass

from demind.cli.common import Flag, config_parser, run_config_command
from demind.settings import setting


@dataclass
class MakeShardsConfig:
    images: str | None = setting(None, input="dir", help="folder the image paths of the caption file are relative to (required)")
    captions: str | None = setting(None, input="file", help=".csv (with header) or .jsonl caption file (required)")
    output: str | None = setting(None, output="dir", help="folder for 00000.tar, 00001.tar, ... and their _stats.json (required)")
    samples_per_shard: int = setting(10000, ge=1, help="samples per tar (img2dataset: 10000)")
    image_column: str = setting("image", free="a column name; a caption file without it is refused "
                                                       "naming the column and its header", help="column/field holding the image path")
    caption_column: str = setting("caption", free="a column name; checked as image_column is", help="column/field holding the caption")
    overwrite: bool = setting(False, help="replace the shards of an earlier build in output (its stale shards are "
                                          "removed)")

    def config_problems(self) -> list[tuple[str, str]]:
        return [(key, f"is required: give --{key}") for key in ("images", "captions", "output")
                if getattr(self, key) is None]


FLAGS = {f"--{key.replace('_', '-')}": Flag(key) for key in (
    "images", "captions", "output", "samples_per_shard", "image_column", "caption_column", "overwrite")}


def build_parser():
    return config_parser(MakeShardsConfig, "demind-make-shards", __doc__, FLAGS)


def make_shards_command(args: MakeShardsConfig) -> int:
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
    return run_config_command(MakeShardsConfig, build_parser(), make_shards_command, argv)
