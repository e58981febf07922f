"""The shard-job runner both generation jobs share: one shard after another, under one set of error rules.

A generation job is a :class:`ShardJob`: something that loads its engine(s) once and turns one
input shard (:class:`~demind.gen.plan.ShardTask`, planned by :mod:`demind.gen.plan`) into one output
shard and its ``_stats.json`` done-marker. The intent job (:mod:`demind.gen.job`) and the triplet
job (:mod:`demind.gen.triplet_job`) are two such jobs; this module runs either the same way:

* :func:`run_shard` -- one shard under the job's error rules: an unreadable input shard is an
  outcome (no stats file, so the next run retries it) and the job goes on; a full disk or a
  read-only output is one :class:`~demind.errors.OutputLocationError` naming the path (every later
  shard would fail the same way); anything else is a bug and keeps its traceback;
* :func:`run_plan` -- the ``local`` distributor: every shard of the plan that is not done, on this
  process's engine; the ``ray`` distributor (:mod:`demind.gen.ray_job`) runs :func:`run_shard` in
  its actors, so the shards a job writes do not depend on the distributor;
* :class:`JobSummary` and :func:`format_summary` -- what a run did, printed at its end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from tqdm.auto import tqdm

from demind.gen.plan import JobPlan, ShardTask
from demind.gen.reader import InputShardError
from demind.io import output_error
from demind.logs import progress_bar

logger = logging.getLogger(__name__)


class ShardJob(Protocol):
    """One kind of generation work, its engines loaded once, run shard after shard."""

    unit: str  # what a shard holds, for progress bars and rates ("img", "pair")

    def expected(self, task: ShardTask) -> int | None:
        """Items the input shard holds, when its stats say so (sizes the progress bars)."""
        ...

    def process(self, task: ShardTask, show_progress: bool, overall: tqdm | None) -> dict[str, Any]:
        """Write the shard and, last, its stats file (the done-marker); returns the stats.
        Raises :class:`~demind.gen.reader.InputShardError` when the input shard cannot be read."""
        ...

    def done_line(self, stats: dict[str, Any]) -> str:
        """The log line of a finished shard (after ``shard N done: ``)."""
        ...


@dataclass
class ShardOutcome:
    """One shard's result: its stats when it was written, else why its input could not be read."""

    shard_id: int
    stats: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class JobSummary:
    """What a run did: the stats of each shard it finished, and the shards it could not do.

    ``notes``: lines a distributor adds under the table (workers, retries, overall rate);
    ``metrics``: its numbers (``demind.gen.ray_job``: workers, wall and work time, shards/s, overhead)."""

    finished: list[dict[str, Any]] = field(default_factory=list)
    skipped_done: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, outcome: ShardOutcome) -> None:
        if outcome.stats is not None:
            self.finished.append(outcome.stats)
        else:
            self.failed[outcome.shard_id] = outcome.error or "unknown error"


def run_shard(job: ShardJob, task: ShardTask, show_progress: bool = True, overall: tqdm | None = None) -> ShardOutcome:
    """``job.process(task)`` under the job's error rules, the same for every job and distributor (see
    the module docstring)."""
    try:
        stats = job.process(task, show_progress, overall)
    except InputShardError as e:
        logger.error("%s", e)
        return ShardOutcome(task.shard_id, error=str(e))
    except (OSError, RuntimeError) as e:
        error = output_error(task.output.tar, e)
        if error is None:
            raise
        raise error from e
    logger.info("shard %d done: %s", task.shard_id, job.done_line(stats))
    return ShardOutcome(task.shard_id, stats=stats)


def run_plan(plan: JobPlan, job: ShardJob, show_progress: bool = True) -> JobSummary:
    """The ``local`` distributor: every shard of the plan that is not done, one after the other, on
    this process's job. Unreadable input shards are recorded as failed and the others go on."""
    summary = JobSummary(skipped_done=[t.shard_id for t in plan.by_state("done")])
    todo = plan.todo
    expected = [job.expected(t) for t in todo]
    total = sum(expected) if None not in expected else None  # known when stats files sit beside the tars
    with progress_bar(total=total, desc=f"all {len(todo)} shard(s)", unit=job.unit, disable=not show_progress) as overall:
        for task in todo:
            summary.add(run_shard(job, task, show_progress, overall))
    return summary


Column = tuple[str, int, Callable[[dict[str, Any]], Any]]
"""A column of the summary table: header, width, the value of one shard's stats."""


def format_summary(summary: JobSummary, columns: list[Column]) -> str:
    """The table printed at the end of a run: one row per finished shard, then the counts, the
    failed shards with their errors, and the distributor's notes."""
    lines = [" ".join(f"{name:>{width}}" for name, width, _ in columns)]
    for stats in summary.finished:
        lines.append(" ".join(f"{value(stats):>{width}}" for _, width, value in columns))
    lines.append(f"finished {len(summary.finished)} shard(s); {len(summary.skipped_done)} already done; "
                 f"{len(summary.failed)} failed")
    for shard_id, err in sorted(summary.failed.items()):
        lines.append(f"  shard {shard_id} FAILED: {err}")
    lines += summary.notes
    return "\n".join(lines)
