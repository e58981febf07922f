"""The ``ray`` distributor: the shards of a generation job as Ray work, one engine per actor.

Each :class:`ShardWorker` actor loads its job once (its engines: a GPU each on a GPU cluster,
``engine.tensor_parallel_size`` of them for vLLM) and turns whole shards into output shards
through the same :func:`demind.gen.runner.run_shard` the ``local`` distributor runs, so the shard
format, the ``_stats.json`` done-marker and the per-key seeds do not change: the texts are those
of a local run. Both generation jobs run here: the intent job (``IntentShardJob.load``) and the
triplet job (``TripletShardJob.load``); the job is the ``load`` function handed to the workers.
The driver loop is the one of :mod:`demind.distributed` (the index build runs it too): it hands a
shard to whichever worker is free; a shard whose worker died or raised goes back to the queue for
another worker, at most ``shard_attempts`` tries in all, then it is reported as failed. Ray
restarts a dead worker (``demind.distributed.WORKER_RESTARTS`` times).

What a kill loses: the shards in flight. A killed worker's shard is retried; a killed driver
takes its workers with it (Ray ends the actors of a dead owner) and the next run of the same
command redoes exactly the shards without a done-marker.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Any, Callable

from demind import distributed
from demind.distributed import (
    Dispatch, connect, count_workers, drive, failed_try, import_ray, start_workers, stop_workers)
from demind.gen.plan import JobPlan, ShardTask
from demind.gen.runner import JobSummary, ShardJob, ShardOutcome, run_shard

logger = logging.getLogger(__name__)

JobLoader = Callable[[Any], ShardJob]
"""``load(cfg)``: a job with its engines loaded (run once in each worker)."""


class ShardWorker:
    """One job, its engines loaded once, that turns whole shards into output shards (a Ray actor)."""

    def __init__(self, load: JobLoader, cfg: Any):
        from demind.engines import disable_loading_progress

        disable_loading_progress()  # the driver shows the one progress view
        self.job = load(cfg)

    def describe(self) -> dict[str, Any]:
        """Where this worker runs; also the driver's probe that it is up."""
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname(), "engine": getattr(self.job, "engine_name", None)}

    def run(self, task: ShardTask) -> ShardOutcome:
        return run_shard(self.job, task, show_progress=False)


@dataclass
class RayOptions(distributed.RayOptions):
    """:class:`demind.distributed.RayOptions` whose actors are named ``demind-generate-i``."""

    name_prefix: str = "demind-generate"


def worker_resources(cfg: Any, cluster: dict[str, float], address: str | None) -> dict[str, float]:
    """The Ray resources of one worker: GPUs where the cluster has them (``tensor_parallel_size``
    for vLLM, one for transformers), else ``engine.cpu_threads`` CPUs (at least one)."""
    gpus = cfg.engine.tensor_parallel_size if cfg.engine.name == "vllm" else 1
    return distributed.worker_resources(cfg.run.device, cluster, address, gpus=gpus, cpus=cfg.engine.cpu_threads)


_Dispatch = partial(Dispatch, key=attrgetter("shard_id"))  # the driver's view of a generation job


def run_plan_on_ray(plan: JobPlan, cfg: Any, options: RayOptions, load: JobLoader, show_progress: bool = True,
                    unit: str = "img", rate_key: str = "images_per_s") -> JobSummary:
    """Generate every shard of the plan that is not done on Ray workers, each running the job
    ``load(cfg)`` gives (``IntentShardJob.load``, ``TripletShardJob.load``). Returns the job summary:
    per-shard stats as a local run writes them, failed shards with every try's error, and notes
    (workers, hosts, retries, ``unit``/s over all workers, scheduling overhead per shard);
    ``rate_key``: the stats' and the metrics' name of that rate."""
    ray = import_ray()
    todo = plan.todo
    summary = JobSummary(skipped_done=[t.shard_id for t in plan.by_state("done")])
    started = connect(options.address, options.workers * max(cfg.engine.cpu_threads, 1))
    workers: list = []
    try:
        start = time.perf_counter()
        cluster = ray.cluster_resources()
        resources = worker_resources(cfg, cluster, options.address)
        n = count_workers(options.workers, resources, cluster, len(todo))
        workers = start_workers(ray, ShardWorker, n, resources, options.name_prefix, load, cfg)
        size = ", ".join(f"{cluster[k]:g} {k}" for k in ("CPU", "GPU") if k in cluster)
        print(f"ray: {n} worker(s), each {resources}; the cluster has {size}", flush=True)
        state = _Dispatch(workers=workers, pending=deque(todo))
        state.probing = {w.describe.remote(): i for i, w in enumerate(workers)}
        drive(ray, state, partial(_finished, state, summary, unit, rate_key), options.shard_attempts, summary.failed, show_progress)
        _add_notes(summary, state, n, time.perf_counter() - start, unit, rate_key)
    finally:
        stop_workers(ray, workers)
        if started:
            ray.shutdown()
    summary.finished.sort(key=lambda s: s["shard"])
    return summary


def _finished(state: Dispatch, summary: JobSummary, unit: str, rate_key: str, task: ShardTask, outcome: ShardOutcome,
              worker: int, t0: float) -> int:
    """Record a shard that came back (done, or failed under the job's error rules, e.g. an
    unreadable input shard). Returns the samples it wrote."""
    summary.add(outcome)
    if outcome.stats is None:
        return 0
    state.overhead_s.append(max(time.perf_counter() - t0 - outcome.stats["elapsed_s"], 0.0))
    if len(state.errors.get(task.shard_id, [])):
        summary.notes.append(f"shard {task.shard_id} done after: " + "; ".join(state.errors[task.shard_id]))
    logger.info("shard %d done on worker %d: %d written, %.2f %s/s", task.shard_id, worker,
                outcome.stats["written"], outcome.stats[rate_key] or 0, unit)
    return outcome.stats["written"]


def _failed_try(task: ShardTask, worker: int, error: str, state: Dispatch, summary: JobSummary,
                options: RayOptions, bar) -> None:
    """Count a failed try (:func:`demind.distributed.failed_try`); a shard given up goes into the summary."""
    failed_try(state, task, worker, error, options.shard_attempts, summary.failed, bar)


def _add_notes(summary: JobSummary, state: Dispatch, workers: int, wall_s: float, unit: str = "img",
               rate_key: str = "images_per_s") -> None:
    """The numbers of the run (``summary.metrics``) and the lines under the summary table."""
    end = time.perf_counter()
    work_s = end - state.first_dispatch if state.first_dispatch is not None else 0.0
    written = sum(s["written"] for s in summary.finished)
    overhead_ms = 1000 * statistics.median(state.overhead_s) if state.overhead_s else 0.0
    summary.metrics = {"workers": workers, "wall_s": round(wall_s, 3), "work_s": round(work_s, 3),
                       "shards_per_s": round(len(summary.finished) / work_s, 4) if work_s else 0.0,
                       rate_key: round(written / work_s, 4) if work_s else 0.0,
                       "overhead_ms_per_shard": round(overhead_ms, 2)}
    # the rate once every worker is up (engine loads of later workers not counted): how Ray scales
    after = [t for t in state.done_at if state.all_up is not None and t > state.all_up]
    if len(after) >= 2:
        summary.metrics["all_up_shards_per_s"] = round(len(after) / (after[-1] - state.all_up), 4)
    retried = sorted(state.errors)
    hosts = sorted(set(state.hosts.values()))
    summary.notes.append(f"ray: {workers} worker(s) on {len(hosts)} host(s) ({', '.join(hosts)}); "
                         f"{len(retried)} shard(s) retried after a failed try"
                         + (f" ({','.join(map(str, retried))})" if retried else ""))
    summary.notes.append(f"ray: {written} samples in {work_s:.1f} s from the first shard handed out "
                         f"({wall_s:.1f} s with engine loading) = {summary.metrics[rate_key]:.2f} {unit}/s over all "
                         f"workers; scheduling overhead {overhead_ms:.1f} ms/shard (median)")
