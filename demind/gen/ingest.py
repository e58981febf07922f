"""Build img2dataset-style shards from a folder of images and a CSV or JSONL of captions.

For users with their own data: the output is what ``data_gen/run.py`` reads
(``NNNNN.tar`` holding ``KEY.jpg|png|webp``, ``KEY.txt``, ``KEY.json``, plus ``NNNNN_stats.json``).
Rows with a missing or unreadable image, an empty caption or a malformed line are skipped,
logged and counted.
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from demind.shard_format import CAPTION_FIELD, JSON_FIELD, ShardOutput, ShardWriter, sample_key

logger = logging.getLogger(__name__)

_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}


@dataclass
class CaptionRow:
    line: int  # 1-based line (JSONL) or row (CSV, header is line 1)
    image: str
    caption: str
    extra: dict[str, Any]


@dataclass
class IngestReport:
    shards: list[Path] = field(default_factory=list)
    written: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_rows: list[dict[str, Any]] = field(default_factory=list)

    def skip(self, line: int, reason: str, detail: str = "") -> None:
        logger.warning("captions line %d skipped: %s %s", line, reason, detail)
        self.skipped[reason] += 1
        self.skipped_rows.append({"line": line, "reason": reason, "detail": detail})


def read_caption_rows(path: Path, image_column: str, caption_column: str, report: IngestReport) -> Iterator[CaptionRow]:
    """Rows of a ``.csv`` (header row) or ``.jsonl`` (one object per line) caption file."""
    if path.suffix.lower() == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = {image_column, caption_column} - set(reader.fieldnames or [])
            if missing:
                raise ValueError(
                    f"caption file {path} has no column(s) {sorted(missing)}; its header is {reader.fieldnames}; "
                    "name the columns with --image-column / --caption-column"
                )
            for line, row in enumerate(reader, start=2):
                yield _row(line, dict(row), image_column, caption_column)
    elif path.suffix.lower() in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    report.skip(line, "malformed json line", str(e))
                    continue
                if not isinstance(obj, dict) or image_column not in obj:
                    report.skip(line, "malformed json line", f"needs an object with {image_column!r}")
                    continue
                yield _row(line, obj, image_column, caption_column)
    else:
        raise ValueError(f"caption file {path} must end in .csv or .jsonl")


def _row(line: int, data: dict[str, Any], image_column: str, caption_column: str) -> CaptionRow:
    image = str(data.pop(image_column, "") or "")
    caption = str(data.pop(caption_column, "") or "").strip()
    return CaptionRow(line=line, image=image, caption=caption, extra=data)


def load_image_bytes(path: Path) -> tuple[bytes, str, tuple[int, int]]:
    """(bytes, extension, (width, height)); raises ValueError when it is not a readable image."""
    ext = _EXTENSIONS.get(path.suffix.lower())
    if ext is None:
        raise ValueError(f"unsupported image type {path.suffix!r} (use {', '.join(sorted(_EXTENSIONS))})")
    data = path.read_bytes()
    try:
        with Image.open(path) as img:
            img.load()  # full decode: a truncated file fails here, not later on the GPU node
            size = img.size
    except Exception as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    return data, ext, size


class _ShardSink:
    """Splits a stream of samples into shards of ``per_shard`` samples (``shard_format.ShardWriter`` each)."""

    def __init__(self, output_dir: Path, per_shard: int, report: IngestReport):
        self.output_dir, self.per_shard, self.report = output_dir, per_shard, report
        self.sample_digits = len(str(per_shard - 1))
        self.shard_id, self.in_shard = 0, 0
        self.output: ShardOutput | None = None
        self.writer: ShardWriter | None = None

    def key(self) -> str:
        return sample_key(self.shard_id, self.in_shard, self.sample_digits)

    def write(self, sample: dict[str, Any]) -> None:
        if self.writer is None:
            self.output = ShardOutput.for_id(self.output_dir, self.shard_id)
            self.writer = ShardWriter(self.output.tar)
        self.writer.write(sample)
        self.in_shard += 1
        if self.in_shard == self.per_shard:
            self.close()

    def close(self) -> None:
        """Commit the open shard and write its img2dataset-style stats (the done-marker)."""
        if self.writer is None:
            return
        self.writer.commit()
        self.output.mark_done({"successes": self.in_shard, "count": self.in_shard})
        self.report.shards.append(self.output.tar)
        self.shard_id, self.in_shard, self.writer = self.shard_id + 1, 0, None

    def __enter__(self) -> "_ShardSink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self.writer is not None:
            self.writer.abandon()  # the open shard's tmp goes; finished shards stay


def build_shards(images_dir: Path, captions: Path, output_dir: Path, samples_per_shard: int = 10000,
                 image_column: str = "image", caption_column: str = "caption") -> IngestReport:
    """Write shards of ``samples_per_shard`` samples; image paths in the caption file are relative to ``images_dir``."""
    if samples_per_shard < 1:
        raise ValueError("samples_per_shard must be >= 1")
    images_dir, captions, output_dir = Path(images_dir), Path(captions), Path(output_dir)
    if not captions.is_file():
        raise FileNotFoundError(f"caption file {captions} does not exist")
    output_dir.mkdir(parents=True, exist_ok=True)
    report = IngestReport()
    with _ShardSink(output_dir, samples_per_shard, report) as sink:
        for row in read_caption_rows(captions, image_column, caption_column, report):
            if not row.caption:
                report.skip(row.line, "missing caption")
                continue
            image_path = images_dir / row.image
            if not row.image or not image_path.is_file():
                report.skip(row.line, "missing image", str(image_path))
                continue
            try:
                data, ext, (width, height) = load_image_bytes(image_path)
            except ValueError as e:
                report.skip(row.line, "unreadable image", f"{image_path}: {e}")
                continue
            key = sink.key()
            meta = {"key": key, "caption": row.caption, "image_path": row.image, "width": width, "height": height,
                    **row.extra}
            sink.write({"__key__": key, ext: data, CAPTION_FIELD: row.caption.encode("utf-8"),
                        JSON_FIELD: json.dumps(meta, ensure_ascii=False).encode("utf-8")})
            report.written += 1
    return report
