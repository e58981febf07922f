"""The ``ray`` distributor: the shards of a generation job as Ray work, one engine per actor.

Each :class:`ShardWorker` actor loads the engine once (a GPU each on a GPU cluster,
``engine.tensor_parallel_size`` of them for vLLM) and turns whole shards into intent shards
through the same :func:`demind.gen.job.run_shard` the ``local`` distributor runs, so the shard
format, the ``_stats.json`` done-marker and the per-key seeds do not change: the texts are those
of a local run. The driver hands a shard to whichever worker is free; a shard whose worker died
or raised goes back to the queue for another worker, at most ``shard_attempts`` tries in all,
then it is reported as failed. Ray restarts a dead worker (``WORKER_RESTARTS`` times).

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
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from demind.logs import progress_bar

from demind.config import MissingDependencyError
from demind.errors import DemindError
from demind.gen.config import GenConfig
from demind.gen.job import JobSummary, ShardOutcome, build_generator, run_shard
from demind.gen.plan import JobPlan, ShardTask

logger = logging.getLogger(__name__)

INSTALL_HINT = "--distributor ray needs Ray: pip install 'demind[distributed]' (or pip install ray)"
WORKER_RESTARTS = 2  # Ray restarts a crashed worker (engine reloaded) this often before it is dropped
WAIT_LOG_S = 60.0  # while no shard finishes, one line this often (workers still waiting for resources)


class DistributedJobError(DemindError, RuntimeError):
    """A Ray job that cannot run: no cluster to connect to, or no worker could start."""


def import_ray():
    """Import ray or raise :class:`MissingDependencyError` naming the install line."""
    try:
        import ray
    except ImportError as e:
        raise MissingDependencyError(f"{INSTALL_HINT} (import failed: {e})") from e
    return ray


class ShardWorker:
    """One engine, loaded once, that turns whole shards into intent shards (a Ray actor)."""

    def __init__(self, cfg: GenConfig):
        from demind.gen.engines import build_engine, disable_loading_progress
        from demind.gen.prompts import load_prompts

        disable_loading_progress()  # the driver shows the one progress view
        self.cfg = cfg
        engine = build_engine(cfg.engine, cfg.sampling, device=cfg.run.device, seed=cfg.run.seed)
        self.generator, self.scorer = build_generator(cfg, engine, load_prompts(cfg.prompts.version))

    def describe(self) -> dict[str, Any]:
        """Where this worker runs; also the driver's probe that it is up."""
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname(), "engine": self.generator.engine.name}

    def run(self, task: ShardTask) -> ShardOutcome:
        return run_shard(task, self.generator, self.cfg, show_progress=False, scorer=self.scorer)


@dataclass
class RayOptions:
    """How the job uses Ray: ``workers`` (0 = one per GPU, or per ``tensor_parallel_size`` GPUs), the
    cluster ``address`` (None: start a local one), tries per shard, a name prefix for the actors."""

    workers: int = 0
    address: str | None = None
    shard_attempts: int = 3
    name_prefix: str = "demind-generate"


def connect(address: str | None, local_cpus: int) -> bool:
    """Join the cluster at ``address``, or start a local one with at least ``local_cpus`` CPUs
    (logical CPUs: ``--workers 4`` on a 2-core machine runs 4 workers). Returns True when this
    call started Ray (the caller shuts it down). A session already open in this process is used."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    try:
        if address:
            ray.init(address=address, log_to_driver=True)
        else:  # "local": a new cluster even where RAY_ADDRESS names another (the command passes it on)
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, local_cpus), include_dashboard=False)
    except ConnectionError as e:
        raise DistributedJobError(f"cannot connect to the Ray cluster at {address!r} ({e}); start it with "
                                  "'ray start --head' or fix --ray-address / RAY_ADDRESS") from e
    return True


def worker_resources(cfg: GenConfig, cluster: dict[str, float], address: str | None) -> dict[str, float]:
    """The Ray resources of one worker: GPUs where the cluster has them (``tensor_parallel_size``
    for vLLM, one for transformers), else ``engine.cpu_threads`` CPUs (at least one)."""
    if cfg.run.device != "cpu" and cluster.get("GPU", 0) > 0:
        gpus = cfg.engine.tensor_parallel_size if cfg.engine.name == "vllm" else 1
        return {"num_cpus": 1, "num_gpus": gpus}
    if cfg.run.device.startswith("cuda"):
        raise DistributedJobError(f"run.device={cfg.run.device} but the Ray cluster at {address or 'local'} has "
                                  "no GPU; start the workers on GPU machines or set run.device=cpu")
    return {"num_cpus": max(cfg.engine.cpu_threads, 1), "num_gpus": 0}


def count_workers(requested: int, resources: dict[str, float], cluster: dict[str, float], shards: int) -> int:
    """``requested`` workers, or (0) one per ``num_gpus`` GPUs of the cluster; never more than the
    shards to do. Without GPUs the count must be given: CPU workers of a large model need memory Ray
    does not account for, so one per core could exhaust it."""
    if requested <= 0:
        if not resources["num_gpus"]:
            raise DistributedJobError(f"the Ray cluster has no GPU ({cluster.get('CPU', 0):g} CPUs): give the number "
                                      "of CPU workers with --workers N (each loads its own copy of the model)")
        requested = max(int(cluster.get("GPU", 0) // resources["num_gpus"]), 1)
    return max(min(requested, shards), 1)


@dataclass
class _Dispatch:
    """The driver's view of the job: shards waiting, calls in flight, workers idle or starting."""

    workers: list = field(default_factory=list)  # actor handles
    pending: deque = field(default_factory=deque)  # ShardTask
    tried_on: dict[int, set[int]] = field(default_factory=dict)  # shard -> workers that failed it
    errors: dict[int, list[str]] = field(default_factory=dict)  # shard -> why each try failed
    running: dict[Any, tuple[int, ShardTask, float]] = field(default_factory=dict)  # ref -> worker, task, start
    probing: dict[Any, int] = field(default_factory=dict)  # describe() ref -> worker (starting or restarted)
    idle: list[int] = field(default_factory=list)
    hosts: dict[int, str] = field(default_factory=dict)
    overhead_s: list[float] = field(default_factory=list)  # per shard: round trip minus the shard's own time
    first_dispatch: float | None = None  # perf_counter when the first shard was handed out
    all_up: float | None = None  # when the last worker of the job came up (its engine loaded)
    done_at: list[float] = field(default_factory=list)  # when each shard came back done

    def next_task(self, worker: int, live: set[int]) -> ShardTask | None:
        """The first waiting shard this worker has not failed (any, once every live worker failed it)."""
        for task in self.pending:
            tried = self.tried_on.get(task.shard_id, set())
            if worker not in tried or live <= tried:
                self.pending.remove(task)
                return task
        return None


def run_plan_on_ray(plan: JobPlan, cfg: GenConfig, options: RayOptions, show_progress: bool = True) -> JobSummary:
    """Generate every shard of the plan that is not done on Ray workers. Returns the job summary:
    per-shard stats as a local run writes them, failed shards with every try's error, and notes
    (workers, hosts, retries, images/s over all workers, scheduling overhead per shard)."""
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
        remote_cls = ray.remote(max_restarts=WORKER_RESTARTS, max_task_retries=0, **resources)(ShardWorker)
        workers = [remote_cls.options(name=f"{options.name_prefix}-{i}").remote(cfg) for i in range(n)]
        size = ", ".join(f"{cluster[k]:g} {k}" for k in ("CPU", "GPU") if k in cluster)
        print(f"ray: {n} worker(s), each {resources}; the cluster has {size}", flush=True)
        state = _Dispatch(workers=workers, pending=deque(todo))
        state.probing = {w.describe.remote(): i for i, w in enumerate(workers)}
        _drive(ray, state, summary, options, show_progress)
        _add_notes(summary, state, n, time.perf_counter() - start)
    finally:
        for worker in workers:  # now, not when Ray collects the handles: frees their GPUs and names
            ray.kill(worker)
        if started:
            ray.shutdown()
    summary.finished.sort(key=lambda s: s["shard"])
    return summary


def _drive(ray, state: _Dispatch, summary: JobSummary, options: RayOptions, show_progress: bool) -> None:
    """Hand shards to free workers until none waits or is in flight; one progress bar for the job."""
    workers = state.workers
    live = set(range(len(workers)))
    bar = progress_bar(total=len(state.pending), desc="shards", unit="shard", disable=not show_progress)
    written, t0, last_news = 0, time.perf_counter(), time.perf_counter()
    with bar:
        while state.pending or state.running:
            for worker in list(state.idle):
                task = state.next_task(worker, live)
                if task is not None:
                    state.idle.remove(worker)
                    now = time.perf_counter()
                    state.first_dispatch = state.first_dispatch or now
                    state.running[workers[worker].run.remote(task)] = (worker, task, now)
            if not live:
                for task in state.pending:
                    summary.failed[task.shard_id] = "no Ray worker left: " + "; ".join(state.errors.get(task.shard_id, []))
                return
            ready, _ = ray.wait(list(state.running) + list(state.probing), num_returns=1, timeout=WAIT_LOG_S)
            if not ready:
                logger.info("%d shard(s) in flight, %d waiting; %d of %d worker(s) up", len(state.running),
                            len(state.pending), len(live) - len(state.probing), len(workers))
                continue
            ref = ready[0]
            if ref in state.probing:
                _probed(ray, ref, state, live)
            else:
                written += _finished(ray, ref, state, summary, options, bar)
                last_news = time.perf_counter()
            bar.set_postfix(in_flight=len(state.running), failed=len(summary.failed),
                            img_s=f"{written / max(last_news - t0, 1e-9):.2f}", refresh=False)


def _probed(ray, ref, state: _Dispatch, live: set[int]) -> None:
    """A worker answered its probe (it is up: idle) or did not (its engine could not load: dropped)."""
    worker = state.probing.pop(ref)
    try:
        info = ray.get(ref)
    except ray.exceptions.RayActorError as e:
        live.discard(worker)
        logger.error("Ray worker %d is gone: %s", worker, last_line(e))
        if not live and not state.hosts:  # not one worker ever started: the job cannot run
            raise DistributedJobError(f"no Ray worker could start its engine: {last_line(e)}") from None
        return
    state.hosts.setdefault(worker, info["host"])
    if len(state.hosts) == len(state.workers):
        state.all_up = state.all_up or time.perf_counter()
    state.idle.append(worker)


def _finished(ray, ref, state: _Dispatch, summary: JobSummary, options: RayOptions, bar: tqdm) -> int:
    """Record a call that returned; a failed try goes back to the queue or, after the last, is
    reported. Returns the samples it wrote."""
    worker, task, t0 = state.running.pop(ref)
    try:
        outcome: ShardOutcome = ray.get(ref)
    except ray.exceptions.RayActorError as e:  # the worker died (killed, out of memory, node lost)
        _failed_try(task, worker, f"worker {worker} died: {last_line(e)}", state, summary, options, bar)
        # Ray restarts it (engine reloaded) unless it was killed for good: it is idle again once
        # it answers a probe, and dropped when the probe fails
        state.probing[state.workers[worker].describe.remote()] = worker
        return 0
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DemindError):  # as in a local run, e.g. the output disk is full: every
            raise e.cause from None           # shard would fail the same way
        logger.warning("shard %d failed on worker %d:\n%s", task.shard_id, worker, e)  # with its remote traceback
        _failed_try(task, worker, f"worker {worker}: {last_line(e)}", state, summary, options, bar)
        state.idle.append(worker)
        return 0
    state.idle.append(worker)
    summary.add(outcome)
    state.done_at.append(time.perf_counter())
    bar.update(1)
    if outcome.stats is None:
        return 0
    state.overhead_s.append(max(time.perf_counter() - t0 - outcome.stats["elapsed_s"], 0.0))
    if len(state.errors.get(task.shard_id, [])):
        summary.notes.append(f"shard {task.shard_id} done after: " + "; ".join(state.errors[task.shard_id]))
    logger.info("shard %d done on worker %d: %d written, %.2f img/s", task.shard_id, worker,
                outcome.stats["written"], outcome.stats["images_per_s"] or 0)
    return outcome.stats["written"]


def _failed_try(task: ShardTask, worker: int, error: str, state: _Dispatch, summary: JobSummary,
                options: RayOptions, bar: tqdm) -> None:
    """Count a failed try: back to the queue's front for another worker, or reported after the last."""
    logger.warning("shard %d: %s", task.shard_id, error)
    state.errors.setdefault(task.shard_id, []).append(error)
    state.tried_on.setdefault(task.shard_id, set()).add(worker)
    if len(state.errors[task.shard_id]) < options.shard_attempts:
        state.pending.appendleft(task)
        return
    summary.failed[task.shard_id] = f"{options.shard_attempts} tries: " + "; ".join(state.errors[task.shard_id])
    bar.update(1)


def _add_notes(summary: JobSummary, state: _Dispatch, workers: int, wall_s: float) -> None:
    """The numbers of the run (``summary.metrics``) and the lines under the summary table."""
    end = time.perf_counter()
    work_s = end - state.first_dispatch if state.first_dispatch is not None else 0.0
    written = sum(s["written"] for s in summary.finished)
    overhead_ms = 1000 * statistics.median(state.overhead_s) if state.overhead_s else 0.0
    summary.metrics = {"workers": workers, "wall_s": round(wall_s, 3), "work_s": round(work_s, 3),
                       "shards_per_s": round(len(summary.finished) / work_s, 4) if work_s else 0.0,
                       "images_per_s": round(written / work_s, 4) if work_s else 0.0,
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
                         f"({wall_s:.1f} s with engine loading) = {summary.metrics['images_per_s']:.2f} img/s over all "
                         f"workers; scheduling overhead {overhead_ms:.1f} ms/shard (median)")


def last_line(error: BaseException) -> str:
    """The last line of a remote error's text (its exception and message; Ray prepends the traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
