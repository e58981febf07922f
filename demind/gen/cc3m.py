"""CC3M in: the Hub's Conceptual Captions table -> the url list img2dataset reads.

Google's original TSVs sit behind a form; the same table is on the Hub as
``google-research-datasets/conceptual_captions`` (config ``unlabeled``: columns ``image_url``,
``caption``; splits ``train`` = 3,318,333 rows and ``validation`` = 15,840). This module reads it
with ``datasets`` (or any parquet file in that schema) and writes ``url`` + ``caption`` as a TSV
or parquet file, the input of::

    img2dataset --url_list cc3m.tsv --input_format tsv --url_col url --caption_col caption \\
        --output_format webdataset --output_folder data/cc3m ...
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from demind.errors import DemindError, MissingDependencyError
from demind.hubref import INSTALL_HINT
from demind.io import atomic_path

logger = logging.getLogger(__name__)

CC3M_REPO = "google-research-datasets/conceptual_captions"
CC3M_CONFIG = "unlabeled"
SOURCE_URL, SOURCE_CAPTION = "image_url", "caption"
"""The Hub table's columns."""
URL_COLUMN, CAPTION_COLUMN = "url", "caption"
"""The columns written: what img2dataset's ``--url_col url --caption_col caption`` read."""
FORMATS = {".tsv": "tsv", ".parquet": "parquet"}


class CaptionTableError(DemindError, ValueError):
    """A caption table that cannot become img2dataset's input (missing columns, bad output name)."""


@dataclass
class UrlListReport:
    """What :func:`write_url_list` wrote: rows, the file, its img2dataset ``--input_format``."""

    rows: int
    out: Path
    input_format: str

    def img2dataset_command(self, output_folder: str = "data/cc3m") -> str:
        """The img2dataset command that downloads the images into webdataset shards (README's flags)."""
        return (f"img2dataset --url_list {self.out} --input_format {self.input_format} --url_col {URL_COLUMN} "
                f"--caption_col {CAPTION_COLUMN} --output_format webdataset --output_folder {output_folder} "
                "--image_size 672 --resize_mode keep_ratio --resize_only_if_bigger True")


def load_caption_table(source: str = CC3M_REPO, split: str = "train", config: str | None = CC3M_CONFIG):
    """The caption table as a ``pyarrow.Table``: a local ``.parquet`` file or folder of them (the Hub
    table's schema; one table, so ``split``/``config`` stay at their defaults), else a Hub dataset id
    read with ``datasets.load_dataset`` (its cache, offline mode and tokens)."""
    path = Path(source)
    if not path.exists() and (source.endswith(".parquet") or path.is_absolute() or source.startswith(".")):
        raise CaptionTableError(f"caption table {source} does not exist; give a parquet file or folder of them, "
                                f"or a Hub dataset id such as {CC3M_REPO}")
    if path.exists():
        import pyarrow as pa
        import pyarrow.parquet as pq

        if split != "train" or config not in (CC3M_CONFIG, None):
            raise CaptionTableError(f"{source} is a local parquet table: it has no split or config to choose; "
                                    f"leave split and subset at their defaults (train, {CC3M_CONFIG})")
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise CaptionTableError(f"{source} holds no .parquet files; give a parquet file or folder of them")
        tables = []
        for f in files:
            try:
                tables.append(pq.read_table(f))
            except (pa.ArrowException, OSError) as e:
                raise CaptionTableError(f"{f} cannot be read as a parquet table ({str(e).splitlines()[0]}); "
                                        "give a parquet file in the Conceptual Captions schema") from None
        return pa.concat_tables(tables)
    try:
        import datasets
    except ImportError as e:
        raise MissingDependencyError(f"reading the Conceptual Captions table needs datasets: {INSTALL_HINT} ({e})") from e
    try:
        return datasets.load_dataset(source, config, split=split).data.table
    except (ConnectionError, FileNotFoundError) as e:  # datasets' "not found" and "cannot reach the Hub"
        raise CaptionTableError(f"the Hub dataset {source} ({config}, {split}) cannot be read: "
                                f"{str(e).splitlines()[0]}; check the id, the network, or HF_HUB_OFFLINE and the "
                                "cache") from None


def write_url_list(table, out: str | Path, limit: int | None = None, source: str = CC3M_REPO) -> UrlListReport:
    """Write ``table``'s ``image_url`` and ``caption`` (a ``pyarrow.Table``) as ``url`` and ``caption``
    to ``out`` (``.tsv`` or ``.parquet``, atomically); ``limit`` keeps the first N rows (a trial)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    out = Path(out)
    fmt = FORMATS.get(out.suffix)
    if fmt is None:
        raise CaptionTableError(f"--out {out} must end in .tsv or .parquet (the formats img2dataset reads)")
    missing = [c for c in (SOURCE_URL, SOURCE_CAPTION) if c not in table.column_names]
    if missing:
        raise CaptionTableError(f"{source} has no column(s) {missing} (it has {table.column_names}); give the "
                                f"Conceptual Captions table ({CC3M_REPO}, config {CC3M_CONFIG}) or a parquet in its schema")
    if limit is not None:
        table = table.slice(0, limit)
    captions = table[SOURCE_CAPTION]
    with atomic_path(out) as tmp:
        if fmt == "tsv":
            # one row a line: whitespace runs (tabs, newlines) become one space, as in the TSVs Google shipped
            captions = pc.utf8_trim_whitespace(pc.replace_substring_regex(captions, r"\s+", " "))
            pacsv.write_csv(pa.table({URL_COLUMN: table[SOURCE_URL], CAPTION_COLUMN: captions}), tmp,
                            pacsv.WriteOptions(delimiter="\t"))
        else:
            pq.write_table(pa.table({URL_COLUMN: table[SOURCE_URL], CAPTION_COLUMN: captions}), tmp)
    logger.info("wrote %d rows of %s to %s", table.num_rows, source, out)
    return UrlListReport(rows=table.num_rows, out=out, input_format=fmt)
