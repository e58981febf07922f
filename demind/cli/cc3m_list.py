"""``demind-cc3m-list``: CC3M's url list for img2dataset, from the Hub's Conceptual Captions table.

    demind-cc3m-list --out cc3m.tsv                      # 3,318,333 rows of the train split
    demind-cc3m-list --out cc3m-val.parquet --split validation
    demind-cc3m-list --source my_copy.parquet --out cc3m.tsv --limit 1000

Reads ``google-research-datasets/conceptual_captions`` (config ``unlabeled``) with ``datasets``, or a
local parquet file or folder in its schema (``image_url``, ``caption``), and writes ``url`` and
``caption`` as the TSV or parquet img2dataset reads; then prints the img2dataset command.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from demind.cli.common import Flag, config_parser, run_config_command
from demind.settings import setting
from demind.gen.cc3m import CC3M_CONFIG, CC3M_REPO


@dataclass
class Cc3mListConfig:
    out: str | None = setting(None, output="file", help="file to write: .tsv or .parquet (required)")
    source: str = setting(CC3M_REPO, free="a Hub dataset id or a local parquet file/folder; a missing local "
                                                     "table is refused naming it before anything is written", help="Hub dataset id, or a local .parquet file/folder in its schema")
    subset: str | None = setting(CC3M_CONFIG, free="the Hub dataset's own config name (a local table refuses "
                                                               "another)", help="the Hub dataset's config (subset); a local parquet has none")
    split: str = setting("train", choices=("train", "validation"), help="train or validation (a local parquet is one table: train)")
    limit: int | None = setting(None, ge=1, help="keep the first N rows (a trial download)")
    output_folder: str = setting("data/cc3m", free="only printed, in the img2dataset command to run next; "
                                                        "this command writes nothing there", help="the shard folder the printed img2dataset command writes")

    def config_problems(self) -> list[tuple[str, str]]:
        return [("out", "is required: give --out cc3m.tsv (or .parquet)")] if self.out is None else []


FLAGS = {f"--{key.replace('_', '-')}": Flag(key) for key in ("out", "source", "subset", "split", "limit",
                                                           "output_folder")}


def build_parser():
    return config_parser(Cc3mListConfig, "demind-cc3m-list", __doc__.split("\n\n")[0], FLAGS,
                         config_help="YAML file of the keys below")


def cc3m_list_command(cfg: Cc3mListConfig) -> int:
    """Write the url list; print its size and the img2dataset command to run next."""
    from demind.gen.cc3m import load_caption_table, write_url_list
    from demind.io import check_output_file

    check_output_file(cfg.out)  # before a download that can take hours
    report = write_url_list(load_caption_table(cfg.source, cfg.split, cfg.subset), cfg.out, cfg.limit, cfg.source)
    print(f"wrote {report.rows} rows to {report.out}; download the images with:\n"
          f"  {report.img2dataset_command(cfg.output_folder)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``demind-cc3m-list``: see the module docstring; returns the exit status (2: bad input)."""
    return run_config_command(Cc3mListConfig, build_parser(), cc3m_list_command, argv)


if __name__ == "__main__":
    sys.exit(main())
