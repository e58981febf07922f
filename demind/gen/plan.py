"""The per-shard work plan of data_gen: ``--shard`` range parsing, input shard ids, each shard's state.

The shard is the unit of work (as in img2dataset): output ``DIR/00042.tar`` is only
trusted when ``DIR/00042_stats.json`` exists, because the stats file is written last
(file naming and the done-marker: :mod:`demind.shard_format`).
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from demind.errors import DemindError
from demind.shard_format import SHARD_SUFFIX, ShardListError, ShardOutput, resolve_shards, shard_filename

_TRAILING_DIGITS = re.compile(r"(\d+)$")


class ShardSpecError(DemindError, ValueError):
    """A ``--shard`` value or an ``--input`` that does not name usable shards."""


@dataclass(frozen=True)
class ShardSelection:
    """The shard ids of a ``--shard`` value as sorted, disjoint inclusive ranges, never expanded to
    ids: ``--shard 0-99999999999`` is two numbers, not a list of 10^11 (the input's shards are finite)."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, shard_id: int) -> bool:
        at = bisect.bisect_right(self.ranges, (shard_id, math.inf)) - 1
        return at >= 0 and self.ranges[at][0] <= shard_id <= self.ranges[at][1]

    @property
    def count(self) -> int:
        return sum(end - start + 1 for start, end in self.ranges)

    def without(self, ids: list[int]) -> list[tuple[int, int]]:
        """The ranges left when the sorted, unique ``ids`` are taken out (requested shards the input lacks)."""
        left = []
        for start, end in self.ranges:
            cursor = start
            for shard_id in ids[bisect.bisect_left(ids, start):bisect.bisect_right(ids, end)]:
                if shard_id > cursor:
                    left.append((cursor, shard_id - 1))
                cursor = shard_id + 1
            if cursor <= end:
                left.append((cursor, end))
        return left


def parse_shard_range(spec: str) -> ShardSelection:
    """``"0-9,20,30-31"`` -> the selection ``(0, 9), (20, 20), (30, 31)`` (merged, sorted).

    Ranges are inclusive on both ends, like ``--shard 0-99`` meaning 100 shards.
    """
    if spec is None or not str(spec).strip():
        raise ShardSpecError("empty --shard value; use e.g. '0-99' or '0-9,20-29' or '7'")
    ranges: list[tuple[int, int]] = []
    for part in str(spec).split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match:
            raise ShardSpecError(
                f"bad --shard part {part!r} in {spec!r}; use non-negative integers and inclusive "
                "ranges such as '0-99' or '0-9,20-29'"
            )
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) is not None else start
        if end < start:
            raise ShardSpecError(f"bad --shard range {part!r}: end {end} is before start {start}")
        ranges.append((start, end))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return ShardSelection(tuple(merged))


def shard_id_from_path(path: Path) -> int:
    """``.../00042.tar`` -> 42 (the trailing digits of the file stem, img2dataset naming)."""
    stem = path.name.removesuffix(SHARD_SUFFIX) if path.name.endswith(SHARD_SUFFIX) else path.stem
    match = _TRAILING_DIGITS.search(stem)
    if not match:
        raise ShardSpecError(
            f"input shard {path} has no number at the end of its name; name shards like img2dataset "
            "does (00000.tar, 00001.tar, ...) or build them with data_gen/make_shards.py"
        )
    return int(match.group(1))


def find_input_shards(spec: str) -> dict[int, Path]:
    """Map shard id -> path for a folder of ``*.tar`` or a brace pattern ``/d/{00000..00099}.tar``.

    A shard the pattern names but the disk lacks is an error (:func:`resolve_shards`'s rule)."""
    try:
        paths = [Path(p) for p in resolve_shards(spec, setting="--input")]
    except ShardListError as e:
        raise ShardSpecError(str(e)) from None
    shards: dict[int, Path] = {}
    for path in paths:
        shard_id = shard_id_from_path(path)
        if shard_id in shards:
            raise ShardSpecError(f"input shards {shards[shard_id]} and {path} have the same number {shard_id}")
        shards[shard_id] = path
    return shards


@dataclass
class ShardTask:
    shard_id: int
    input_path: Path
    output: ShardOutput
    state: str  # "new", "redo" (stray partial files found) or "done"


@dataclass
class JobPlan:
    """What a run will do, decided before any model is loaded."""

    input_spec: str
    output_dir: Path
    tasks: list[ShardTask] = field(default_factory=list)
    missing: list[tuple[int, int]] = field(default_factory=list)  # requested id ranges with no input shard
    overwrite: bool = False

    def by_state(self, state: str) -> list[ShardTask]:
        return [t for t in self.tasks if t.state == state]

    @property
    def todo(self) -> list[ShardTask]:
        return [t for t in self.tasks if t.state != "done"]


def make_plan(input_spec: str, output_dir: Path, shard_spec: str | None, overwrite: bool,
              output_prefix: str | None = None) -> JobPlan:
    """Resolve input shards, the requested range and each shard's state in ``output_dir``. An output
    shard has its input's file name, or ``PREFIX-NNNNN.tar`` by shard id with ``output_prefix``."""
    available = find_input_shards(input_spec)
    requested = parse_shard_range(shard_spec) if shard_spec else None
    selected = [i for i in sorted(available) if requested is None or i in requested]  # the input's ids bound it
    missing = requested.without(selected) if requested is not None else []
    if not selected:
        raise ShardSpecError(
            f"none of the requested shards ({shard_spec}) exist in {input_spec}; "
            f"available ids are {_compact(sorted(available))}"
        )
    plan = JobPlan(input_spec=input_spec, output_dir=Path(output_dir), missing=missing, overwrite=overwrite)
    for shard_id in selected:
        output = (ShardOutput.of(Path(output_dir) / f"{output_prefix}-{shard_filename(shard_id)}") if output_prefix
                  else ShardOutput.for_input(available[shard_id], Path(output_dir)))
        if overwrite:
            state = "redo" if (output.is_done() or output.stray_files()) else "new"
        elif output.is_done():
            state = "done"
        else:
            state = "redo" if output.stray_files() else "new"
        plan.tasks.append(ShardTask(shard_id, available[shard_id], output, state))
    return plan


def _compact(ids: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' for short messages."""
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def format_plan(plan: JobPlan) -> str:
    """Human-readable plan printed before any work starts."""
    new, redo, done = plan.by_state("new"), plan.by_state("redo"), plan.by_state("done")
    ids = lambda tasks: _compact([t.shard_id for t in tasks])  # noqa: E731
    lines = [
        f"data_gen plan: input {plan.input_spec} -> output {plan.output_dir}",
        f"  shards selected : {len(plan.tasks):>6}  ({ids(plan.tasks)})",
        f"  already done    : {len(done):>6}  ({ids(done)})  skipped",
        f"  to do           : {len(new):>6}  ({ids(new)})",
        f"  to redo         : {len(redo):>6}  ({ids(redo)})  "
        + ("--overwrite" if plan.overwrite else "partial files of an interrupted run are removed first"),
    ]
    if plan.missing:
        count = sum(end - start + 1 for start, end in plan.missing)
        shown = ",".join(f"{a}-{b}" if b != a else f"{a}" for a, b in plan.missing[:20])
        lines.append(f"  not in input    : {count:>6}  ({shown}{',...' if len(plan.missing) > 20 else ''})  ignored")
    return "\n".join(lines)
