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

from demind.errors import DemindError
from demind.imaging import decode_image
from demind.io import check_output_dir
from demind.shard_format import (CAPTION_FIELD, JSON_FIELD, ShardOutput, ShardWriter, sample_key, shard_files_in,
                                 stats_path)

logger = logging.getLogger(__name__)

class CaptionFileError(DemindError, ValueError):
    """A caption file or output folder that cannot be used as given."""


_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}


@dataclass
class CaptionRow:
    line: int  # 1-based line (JSONL) or row (CSV, header is line 1)
    image: str
    caption: str
    extra: dict[str, Any]


@dataclass
class IngestReport:
    """What a build did. ``rows_read`` = ``written`` + every skipped row (the counts add up)."""

    shards: list[Path] = field(default_factory=list)
    written: int = 0
    rows_read: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_rows: list[dict[str, Any]] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)  # stale shard files of an earlier build (--overwrite)
    source: str = ""

    def skip(self, line: int, reason: str, detail: str = "") -> None:
        logger.warning("%s:%d skipped: %s %s", self.source or "captions", line, reason, detail)
        self.skipped[reason] += 1
        self.skipped_rows.append({"file": self.source, "line": line, "reason": reason, "detail": detail})


def _physical_lines(path: Path) -> Iterator[tuple[int, str | None, str]]:
    """(1-based line number, text, "") per line; (number, None, why) for a line that is not UTF-8,
    so that one bad byte costs its row, not the whole build."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, None, f"byte {offset + e.start} of the file (0x{raw[e.start]:02x}); save it as UTF-8"
            else:
                yield number, text.removeprefix("\ufeff") if number == 1 else text, ""
            offset += len(raw)


def _parse_csv_line(text: str) -> list[str]:
    """One CSV record from one physical line; csv.Error for an unterminated quote and the like.

    Records are read one line at a time on purpose: an unterminated quote then costs its own
    row only, instead of swallowing the rows after it into one caption (CSV's multi-line
    quoted fields are therefore not supported; use JSONL for captions with line breaks)."""
    rows = list(csv.reader([text.rstrip("\r\n")], strict=True))
    return rows[0] if rows else []


def read_caption_rows(path: Path, image_column: str, caption_column: str, report: IngestReport) -> Iterator[CaptionRow]:
    """Rows of a ``.csv`` (header row, one record per line) or ``.jsonl`` (one object per line).

    Every bad row (not UTF-8, unterminated quote, wrong number of columns, malformed JSON) is
    skipped with its file, line and reason; ``report.rows_read`` counts every non-blank row."""
    report.source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".json"):
        raise CaptionFileError(f"caption file {path} must end in .csv or .jsonl")
    lines = _physical_lines(path)
    if suffix == ".csv":
        header = _csv_header(path, lines, image_column, caption_column)
    for number, text, why in lines:
        if text is not None and not text.strip():
            continue
        report.rows_read += 1
        if text is None:
            report.skip(number, "not UTF-8", why)
        elif suffix == ".csv":
            try:
                fields = _parse_csv_line(text)
            except csv.Error as e:
                report.skip(number, "malformed CSV row", f"{e} (an unterminated quote?)")
                continue
            if len(fields) != len(header):
                report.skip(number, "wrong number of columns",
                            f"{len(fields)} fields, the header has {len(header)} ({', '.join(header)}); quote "
                            "fields that contain commas")
                continue
            yield _row(number, dict(zip(header, fields)), image_column, caption_column)
        else:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                report.skip(number, "malformed json line", str(e))
                continue
            if not isinstance(obj, dict) or image_column not in obj:
                report.skip(number, "malformed json line", f"needs an object with {image_column!r}")
                continue
            yield _row(number, obj, image_column, caption_column)


def _csv_header(path: Path, lines: Iterator[tuple[int, str | None, str]], image_column: str,
                caption_column: str) -> list[str]:
    for number, text, why in lines:
        if text is None:
            raise CaptionFileError(f"caption file {path}: the header (line {number}) is not UTF-8: {why}")
        if text.strip():
            try:
                header = [h.strip() for h in _parse_csv_line(text)]
            except csv.Error as e:
                raise CaptionFileError(f"caption file {path}: the header row is not valid CSV ({e})") from None
            break
    else:
        raise CaptionFileError(f"caption file {path} is empty; it needs a header row such as 'image,caption'")
    missing = {image_column, caption_column} - set(header)
    if missing:
        raise CaptionFileError(
            f"caption file {path} has no column(s) {sorted(missing)}; its header is {header}; "
            "name the columns with --image-column / --caption-column"
        )
    if len(set(header)) != len(header):
        raise CaptionFileError(f"caption file {path}: the header names a column twice: {header}")
    return header


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
    # full decode: a truncated file fails here, not later on the GPU node; the size is the
    # upright one, as the reader will decode it (EXIF orientation applied)
    size = decode_image(data, orient=True).size
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
                 image_column: str = "image", caption_column: str = "caption",
                 overwrite: bool = False) -> IngestReport:
    """Write shards of ``samples_per_shard`` samples; image paths in the caption file are relative to ``images_dir``.

    An ``output_dir`` that already holds shards is refused unless ``overwrite``; then the files
    of the earlier build that this one does not rewrite (a build with fewer rows) are removed
    at the end, so no stale shard is left beside the new ones."""
    if samples_per_shard < 1:
        raise CaptionFileError(f"--samples-per-shard must be >= 1, got {samples_per_shard}")
    images_dir, captions, output_dir = Path(images_dir), Path(captions), Path(output_dir)
    if not captions.is_file():
        raise CaptionFileError(f"caption file {captions} does not exist" + (" (it is a folder)" if captions.is_dir() else ""))
    if not images_dir.is_dir():
        raise CaptionFileError(f"image folder {images_dir} does not exist or is not a folder; give --images, the "
                               f"folder the image paths of {captions.name} are relative to")
    earlier = shard_files_in(output_dir)
    if earlier and not overwrite:
        raise CaptionFileError(
            f"{output_dir} already holds {len(earlier)} shard file(s) of an earlier build ({earlier[0].name}, ...); "
            "pass --overwrite to replace them (stale ones are removed), or choose an empty folder")
    check_output_dir(output_dir)
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
    kept = {p.name for tar in report.shards for p in (tar, stats_path(tar))}
    for path in shard_files_in(output_dir):
        if path.name not in kept:
            path.unlink()
            report.removed.append(path)
            logger.info("removed %s left by an earlier build", path)
    return report
