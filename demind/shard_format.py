"""The shard format, in one place: field names, file naming, shard lists, the writer, the done-marker.

Every producer (``data_gen/run.py``, ``data_gen/make_shards.py``, the toy world) and every
consumer (the trainer's reader ``demind.data``, the feature cache ``demind.features``,
data_gen's input reader) takes the schema from here; ``shards/README.md`` describes it.

* A shard is an uncompressed WebDataset tar ``NNNNN.tar``; a sample is the members sharing a
  key: ``KEY.jpg`` (or another of :data:`IMAGE_FIELDS`), ``KEY.txt`` (T_ori), ``KEY.rew.txt``
  (T_rew), ``KEY.int.txt`` (T_int), ``KEY.json`` (metadata).  Input shards have no
  ``rew.txt``/``int.txt``.
* A shard is written under ``NNNNN.tar.tmp`` and renamed when complete (:class:`ShardWriter`,
  on :mod:`demind.io`); ``NNNNN_stats.json`` is written after the rename and marks the shard
  done (img2dataset's convention), so a rerun skips finished shards and redoes the others.
* A list of shards is a folder of ``*.tar`` or a brace pattern (:func:`resolve_shards`); a
  shard the pattern names but the disk lacks is an error, for every reader.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demind.errors import DemindError
from demind.io import atomic_path, temp_path, write_text_atomic

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
"""Image members a sample may have, in the order readers look for them."""
CAPTION_FIELD = "txt"
REWRITTEN_FIELD = "rew.txt"
INTENT_FIELD = "int.txt"
JSON_FIELD = "json"

SHARD_SUFFIX = ".tar"
STATS_SUFFIX = "_stats.json"
SHARD_ID_DIGITS = 5
HUB_SHARD_FILES = ["*" + SHARD_SUFFIX, "*" + STATS_SUFFIX, "README.md"]
"""What is fetched of a shard repository on the Hub (not a feature cache uploaded beside it)."""

INTENT_MEMBERS = (
    ("KEY.jpg", "the image, encoded bytes (or `.jpeg`, `.png`, `.webp`), unchanged from the input shard"),
    ("KEY.txt", "T_ori, the original caption (UTF-8)"),
    ("KEY.rew.txt", "T_rew, the rewritten caption (one line; empty in the single-prompt ablation)"),
    ("KEY.int.txt", "T_int, the pseudo-manipulation description (one line)"),
    ("KEY.json", "the input metadata object plus a `generation` record (engine, model, prompt version, "
                 "sampling, flags)"),
)
"""The members of an intent-shard sample and what they hold (shards/README.md's table; dataset cards)."""


class ShardListError(DemindError, FileNotFoundError):
    """A shard folder or pattern that names no shard, or names shards that do not exist."""


# --------------------------------------------------------------------------- naming


def shard_filename(shard_id: int) -> str:
    """42 -> ``00042.tar`` (img2dataset naming)."""
    return f"{shard_id:0{SHARD_ID_DIGITS}d}{SHARD_SUFFIX}"


def shard_name(shard: str | Path) -> str:
    """``shards/cc3m/00012.tar`` -> ``00012`` (names cache files and messages)."""
    return Path(shard).name.removesuffix(SHARD_SUFFIX)


def stats_path(shard: str | Path) -> Path:
    """``shards/cc3m/00012.tar`` -> ``shards/cc3m/00012_stats.json``, the shard's done-marker."""
    shard = Path(shard)
    return shard.with_name(shard_name(shard) + STATS_SUFFIX)


def shard_files_in(directory: str | Path) -> list[Path]:
    """The ``NNNNN.tar`` / ``NNNNN_stats.json`` files (and their ``.tmp``) in ``directory``, sorted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    pattern = re.compile(rf"^\d{{{SHARD_ID_DIGITS}}}({re.escape(SHARD_SUFFIX)}|{re.escape(STATS_SUFFIX)})(\.tmp)?$")
    return sorted(p for p in directory.iterdir() if pattern.match(p.name))


def sample_key(shard_id: int, index: int, digits: int) -> str:
    """img2dataset's key: the shard number then the index in the shard, ``(42, 17, 4) -> '000420017'``.

    Keys hold no dot: WebDataset splits a member name at its first dot."""
    return f"{shard_id:0{SHARD_ID_DIGITS}d}{index:0{digits}d}"


# --------------------------------------------------------------------------- shard lists


MAX_PATTERN_SHARDS = 1_000_000
"""The most shards a brace pattern may name (CC3M is 332, LAION-400M 41 k): more is a typo (an extra
digit), refused before the pattern is expanded into a list of paths that would not fit in memory."""

_BRACE_GROUP = re.compile(r"\{([^{}]*)\}")


def pattern_size(spec: str) -> int:
    """How many paths a brace pattern expands to (``a/{00000..00331}.tar::b/{0,1}.tar`` -> 334),
    counted without expanding it."""
    total = 0
    for pattern in spec.split("::"):
        size = 1
        for group in _BRACE_GROUP.findall(pattern):
            numbers = re.fullmatch(r"\s*(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\s*", group)
            if numbers:
                start, end, step = int(numbers[1]), int(numbers[2]), abs(int(numbers[3] or 1)) or 1
                size *= abs(end - start) // step + 1
            else:
                size *= group.count(",") + 1
        total += size
    return total


def resolve_shards(spec: str, setting: str = "data.shards") -> list[str]:
    """Expand a folder or brace pattern (several joined by ``::``) into the sorted shard paths.

    A folder gives its ``*.tar`` files (``*.tar.tmp`` files of unfinished writes do not
    match); ``hf-hub:ORG/NAME[/SUBFOLDER][@REVISION]`` is a dataset repository of shards, read
    through the Hugging Face cache (:func:`demind.hubref.resolve_hub_folder`) as that folder.
    Raises :class:`ShardListError` naming ``setting``, the spec and the first missing path when
    a local shard of the pattern does not exist, or when nothing matches.
    URLs (``scheme://``) are passed through unchecked.
    """
    from webdataset.shardlists import expand_urls

    from demind.hubref import is_hub_ref, resolve_hub_folder

    if not spec:
        raise ShardListError(f"{setting} is empty; set it to a folder of .tar shards or a brace pattern")
    path = Path(spec)
    if is_hub_ref(spec):
        path = resolve_hub_folder(spec, "dataset", setting, allow_patterns=HUB_SHARD_FILES)
    if path.is_dir():
        shards = sorted(str(p) for p in path.glob("*" + SHARD_SUFFIX))
    else:
        if pattern_size(spec) > MAX_PATTERN_SHARDS:
            raise ShardListError(f"{setting}={spec!r} names {pattern_size(spec):,} shards, more than "
                                 f"{MAX_PATTERN_SHARDS:,}; check the numbers of its {{first..last}} range")
        shards = expand_urls(spec)
        missing = [s for s in shards if "://" not in s and not Path(s).is_file()]
        if missing:
            raise ShardListError(
                f"{len(missing)} of {len(shards)} shards from {setting}={spec!r} do not exist, "
                f"e.g. {missing[0]}; check the pattern"
            )
    if not shards:
        raise ShardListError(f"no .tar shards found at {setting}={spec!r}")
    return shards


# --------------------------------------------------------------------------- files of one shard


@dataclass
class ShardOutput:
    """The files of one written shard: the tar and its stats file (the done-marker)."""

    tar: Path
    stats: Path

    @classmethod
    def of(cls, tar: str | Path) -> "ShardOutput":
        """The tar and the stats file beside it."""
        return cls(tar=Path(tar), stats=stats_path(tar))

    @classmethod
    def for_id(cls, directory: str | Path, shard_id: int) -> "ShardOutput":
        return cls.of(Path(directory) / shard_filename(shard_id))

    @classmethod
    def for_input(cls, input_path: Path, output_dir: Path) -> "ShardOutput":
        """The output shard of ``input_path``: same file name, in ``output_dir``."""
        return cls.of(Path(output_dir) / Path(input_path).name)

    @property
    def tmp_tar(self) -> Path:
        return temp_path(self.tar)

    @property
    def tmp_stats(self) -> Path:
        return temp_path(self.stats)

    def is_done(self) -> bool:
        """The stats file exists: it is written last, so the tar is complete."""
        return self.stats.is_file()

    def mark_done(self, stats: dict[str, Any]) -> None:
        """Write the stats JSON atomically; it marks the shard done, so call it after the tar's commit."""
        write_text_atomic(self.stats, json.dumps(stats, indent=2, ensure_ascii=False) + "\n")

    def load_stats(self) -> dict[str, Any] | None:
        """The stats JSON, or None when it is absent or unreadable (the shard then counts as not done)."""
        try:
            stats = json.loads(self.stats.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return stats if isinstance(stats, dict) else None

    def stray_files(self) -> list[Path]:
        """Files a killed run may have left: a tmp tar/stats, or a renamed tar without its stats."""
        stray = [p for p in (self.tmp_tar, self.tmp_stats) if p.exists()]
        if self.tar.exists() and not self.stats.exists():
            stray.append(self.tar)
        return stray

    def remove(self, include_done: bool) -> list[Path]:
        """Delete stray files (and, with ``include_done``, the finished tar and stats). Returns them."""
        targets = self.stray_files()
        if include_done:
            targets += [p for p in (self.tar, self.stats) if p.exists() and p not in targets]
        for path in targets:
            path.unlink()
        return targets


# --------------------------------------------------------------------------- writing


def encode_sample(key: str, image_ext: str, image_bytes: bytes, caption: str, rewritten: str, intent: str,
                  meta: dict[str, Any]) -> dict[str, Any]:
    """One intent-shard sample (schema in shards/README.md) as a :class:`ShardWriter` record of bytes."""
    if image_ext not in IMAGE_FIELDS:
        raise ValueError(f"sample {key!r}: image extension {image_ext!r} is not one of {IMAGE_FIELDS}")
    return {
        "__key__": key,
        image_ext: image_bytes,
        CAPTION_FIELD: caption.encode("utf-8"),
        REWRITTEN_FIELD: rewritten.encode("utf-8"),
        INTENT_FIELD: intent.encode("utf-8"),
        JSON_FIELD: json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8"),
    }


class ShardWriter:
    """Write one shard: records go to ``path.tmp``; :meth:`commit` renames it to ``path``.

    Use as a context manager (commit on success, abandon on an exception) or call
    :meth:`commit` / :meth:`abandon` yourself.  An abandoned write removes its ``.tmp``; a
    killed process leaves only the ``.tmp``, which no reader takes for a shard
    (:func:`resolve_shards` globs ``*.tar``; :meth:`ShardOutput.stray_files` finds it).
    A writer garbage-collected without a commit counts as abandoned (its ``.tmp`` goes).
    Records are WebDataset samples: ``__key__`` plus field -> bytes (see :func:`encode_sample`).
    """

    def __init__(self, path: str | Path):
        import webdataset as wds

        self.path = Path(path)
        self.count = 0
        self._stack = ExitStack()
        tmp = self._stack.enter_context(atomic_path(self.path))  # renames on close, removes on error
        self._file = self._stack.enter_context(open(tmp, "wb"))
        self._tar = wds.TarWriter(self._file, encoder=False, mode=0o644)

    def write(self, record: dict[str, Any]) -> None:
        self._tar.write(record)
        self.count += 1

    def commit(self) -> Path:
        """Finish the tar, flush it to disk and rename it into place. Returns ``path``."""
        self._tar.close()  # writes tarfile's end blocks (it leaves our file object open)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._stack.close()
        return self.path

    def abandon(self) -> None:
        """Stop after a failure: close the file and remove the ``.tmp``; nothing is left behind."""
        if self._file.closed:
            return
        try:
            self._tar.close()  # flush tarfile's buffer now, not in a destructor after the file is gone
        finally:
            abandoned = RuntimeError(f"shard write of {self.path} abandoned")
            self._stack.__exit__(type(abandoned), abandoned, None)  # atomic_path removes the tmp

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abandon()
