"""Units of work on Ray actors: the one driver loop of every ``--distributor ray`` job.

A job is a queue of units (a generation shard: :mod:`demind.gen.ray_job`; a gallery shard or a
run of image files: :mod:`demind.search.ray_index`) and one actor class that loads its model
once (``__init__``) and turns a unit into a result (``run``). Ray places, schedules and restarts
the actors (``WORKER_RESTARTS`` times); this loop only hands the next waiting unit to whichever
worker is free and counts tries: a unit whose worker died or raised goes back to the queue's
front for a worker that has not failed it, at most ``attempts`` tries in all, then it is given
up with every try's error. A :class:`~demind.errors.DemindError` raised in a worker (the output
disk is full) ends the job as it would end a local run: every unit would fail the same way.
What the caller does with a result (write a shard's stats, a cache part) is its ``on_done``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from demind.errors import DemindError, MissingDependencyError
from demind.logs import progress_bar

logger = logging.getLogger(__name__)

INSTALL_HINT = "--distributor ray needs Ray: pip install 'demind[distributed]' (or pip install ray)"
WORKER_RESTARTS = 2  # Ray restarts a crashed worker (model reloaded) this often before it is dropped
WAIT_LOG_S = 60.0  # while no unit finishes, one line this often (workers still waiting for resources)


class DistributedJobError(DemindError, RuntimeError):
    """A Ray job that cannot run: no cluster to connect to, or no worker could start."""


def import_ray():
    """Import ray or raise :class:`MissingDependencyError` naming the install line."""
    try:
        import ray
    except ImportError as e:
        raise MissingDependencyError(f"{INSTALL_HINT} (import failed: {e})") from e
    return ray


@dataclass
class RayOptions:
    """How a job uses Ray: ``workers`` (0 = one per GPU the cluster has), the cluster ``address``
    (None: start a local one), tries per unit, a name prefix for the actors (``PREFIX-0``...)."""

    workers: int = 0
    address: str | None = None
    shard_attempts: int = 3
    name_prefix: str = "demind"


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


def worker_resources(device: str, cluster: dict[str, float], address: str | None, gpus: int = 1,
                     cpus: int = 1) -> dict[str, float]:
    """The Ray resources of one worker: ``gpus`` GPUs where the cluster has them and ``device`` is
    not ``cpu``, else ``cpus`` CPUs (at least one); ``device=cuda`` on a cluster without GPUs is refused."""
    if device != "cpu" and cluster.get("GPU", 0) > 0:
        return {"num_cpus": 1, "num_gpus": gpus}
    if device.startswith("cuda"):
        raise DistributedJobError(f"run.device={device} but the Ray cluster at {address or 'local'} has "
                                  "no GPU; start the workers on GPU machines or set run.device=cpu")
    return {"num_cpus": max(cpus, 1), "num_gpus": 0}


def count_workers(requested: int, resources: dict[str, float], cluster: dict[str, float], shards: int) -> int:
    """``requested`` workers, or (0) one per ``num_gpus`` GPUs of the cluster; never more than the
    ``shards`` (units) to do. Without GPUs the count must be given: CPU workers of a large model
    need memory Ray does not account for, so one per core could exhaust it."""
    if requested <= 0:
        if not resources["num_gpus"]:
            raise DistributedJobError(f"the Ray cluster has no GPU ({cluster.get('CPU', 0):g} CPUs): give the number "
                                      "of CPU workers with --workers N (each loads its own copy of the model)")
        requested = max(int(cluster.get("GPU", 0) // resources["num_gpus"]), 1)
    return max(min(requested, shards), 1)


def start_workers(ray, actor_class: type, count: int, resources: dict[str, float], name_prefix: str,
                  *args: Any) -> list:
    """``count`` named actors ``name_prefix-i`` of ``actor_class(*args)``; a crashed one is restarted
    (its model reloaded), a call in flight on it is not retried by Ray (the driver retries the unit)."""
    remote_class = ray.remote(max_restarts=WORKER_RESTARTS, max_task_retries=0, **resources)(actor_class)
    return [remote_class.options(name=f"{name_prefix}-{i}").remote(*args) for i in range(count)]


@dataclass
class Dispatch:
    """The driver's view of the job: units waiting, calls in flight, workers idle or starting.
    ``key`` names a unit (its shard id) in the bookkeeping and the messages."""

    key: Callable[[Any], Hashable]
    workers: list = field(default_factory=list)  # actor handles
    pending: deque = field(default_factory=deque)  # units
    tried_on: dict[Hashable, set[int]] = field(default_factory=dict)  # unit -> workers that failed it
    errors: dict[Hashable, list[str]] = field(default_factory=dict)  # unit -> why each try failed
    running: dict[Any, tuple[int, Any, float]] = field(default_factory=dict)  # ref -> worker, unit, start
    probing: dict[Any, int] = field(default_factory=dict)  # describe() ref -> worker (starting or restarted)
    idle: list[int] = field(default_factory=list)
    hosts: dict[int, str] = field(default_factory=dict)
    overhead_s: list[float] = field(default_factory=list)  # per unit: round trip minus the unit's own time
    first_dispatch: float | None = None  # perf_counter when the first unit was handed out
    all_up: float | None = None  # when the last worker of the job came up (its model loaded)
    done_at: list[float] = field(default_factory=list)  # when each unit came back done

    def next_task(self, worker: int, live: set[int]) -> Any | None:
        """The first waiting unit this worker has not failed (any, once every live worker failed it)."""
        for task in self.pending:
            tried = self.tried_on.get(self.key(task), set())
            if worker not in tried or live <= tried:
                self.pending.remove(task)
                return task
        return None


OnDone = Callable[[Any, Any, int, float], int]
"""``on_done(unit, result, worker, start)``: record a unit's result; returns the items (images) it held."""


def drive(ray, state: Dispatch, on_done: OnDone, attempts: int, failed: dict, show_progress: bool = True,
          desc: str = "shards", unit: str = "shard", model: str = "engine") -> None:
    """Hand units to free workers until none waits or is in flight; one progress bar for the job
    (units done, in flight, failed, items/s). Units given up go into ``failed`` {key: every try's error}.
    ``state.probing`` holds the workers' first ``describe()`` calls; ``model`` names what they load."""
    workers = state.workers
    live = set(range(len(workers)))
    bar = progress_bar(total=len(state.pending), desc=desc, unit=unit, disable=not show_progress)
    items, t0, last_news = 0, time.perf_counter(), time.perf_counter()
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
                    failed[state.key(task)] = "no Ray worker left: " + "; ".join(state.errors.get(state.key(task), []))
                return
            ready, _ = ray.wait(list(state.running) + list(state.probing), num_returns=1, timeout=WAIT_LOG_S)
            if not ready:
                logger.info("%d %s(s) in flight, %d waiting; %d of %d worker(s) up", len(state.running), unit,
                            len(state.pending), len(live) - len(state.probing), len(workers))
                continue
            ref = ready[0]
            if ref in state.probing:
                _probed(ray, ref, state, live, model)
            else:
                items += _finished(ray, ref, state, on_done, attempts, failed, bar, unit)
                last_news = time.perf_counter()
            bar.set_postfix(in_flight=len(state.running), failed=len(failed),
                            img_s=f"{items / max(last_news - t0, 1e-9):.2f}", refresh=False)


def _probed(ray, ref, state: Dispatch, live: set[int], model: str) -> None:
    """A worker answered its probe (it is up: idle) or did not (its model could not load: dropped)."""
    worker = state.probing.pop(ref)
    try:
        info = ray.get(ref)
    except ray.exceptions.RayActorError as e:
        live.discard(worker)
        logger.error("Ray worker %d is gone: %s", worker, last_line(e))
        if not live and not state.hosts:  # not one worker ever started: the job cannot run
            raise DistributedJobError(f"no Ray worker could start its {model}: {last_line(e)}") from None
        return
    state.hosts.setdefault(worker, info["host"])
    if len(state.hosts) == len(state.workers):
        state.all_up = state.all_up or time.perf_counter()
    state.idle.append(worker)


def _finished(ray, ref, state: Dispatch, on_done: OnDone, attempts: int, failed: dict, bar, unit: str) -> int:
    """Record a call that returned; a failed try goes back to the queue or, after the last, into
    ``failed``. Returns the items the unit held (``on_done``'s count)."""
    worker, task, t0 = state.running.pop(ref)
    try:
        result = ray.get(ref)
    except ray.exceptions.RayActorError as e:  # the worker died (killed, out of memory, node lost)
        failed_try(state, task, worker, f"worker {worker} died: {last_line(e)}", attempts, failed, bar, unit)
        # Ray restarts it (model reloaded) unless it was killed for good: it is idle again once
        # it answers a probe, and dropped when the probe fails
        state.probing[state.workers[worker].describe.remote()] = worker
        return 0
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DemindError):  # as in a local run, e.g. the output disk is full: every
            raise e.cause from None           # unit would fail the same way
        logger.warning("%s %s failed on worker %d:\n%s", unit, state.key(task), worker, e)  # with its remote traceback
        failed_try(state, task, worker, f"worker {worker}: {last_line(e)}", attempts, failed, bar, unit)
        state.idle.append(worker)
        return 0
    state.idle.append(worker)
    state.done_at.append(time.perf_counter())
    bar.update(1)
    return on_done(task, result, worker, t0)


def failed_try(state: Dispatch, task: Any, worker: int, error: str, attempts: int, failed: dict, bar,
               unit: str = "shard") -> None:
    """Count a failed try: back to the queue's front for another worker, or into ``failed`` after the last."""
    key = state.key(task)
    logger.warning("%s %s: %s", unit, key, error)
    state.errors.setdefault(key, []).append(error)
    state.tried_on.setdefault(key, set()).add(worker)
    if len(state.errors[key]) < attempts:
        state.pending.appendleft(task)
        return
    failed[key] = f"{attempts} tries: " + "; ".join(state.errors[key])
    bar.update(1)


def stop_workers(ray, workers: list) -> None:
    """End the actors now, not when Ray collects the handles: frees their GPUs and names."""
    for worker in workers:
        ray.kill(worker)


def last_line(error: BaseException) -> str:
    """The last line of a remote error's text (its exception and message; Ray prepends the traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
