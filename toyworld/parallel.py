"""Process-parallel map for the toy world's CPU-bound rendering.

Drawing a 64 px scene costs ~4 ms of pure Python/NumPy/PIL, so the 20,000 images of a
quickstart take ~85 s on one core; every image depends only on its own seed, so the
work splits across processes with identical results.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

from demind.logs import progress_bar

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """Cores this process may use (the affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int | None = None, desc: str = "",
                 progress: bool = True, unit: str = "it") -> Iterator[R]:
    """``map(fn, items)`` in input order, over ``workers`` processes (1: in this process).

    ``fn`` must be a module-level function (it is pickled). Workers are forked where the
    platform can (no re-import of torch, and it works from a notebook or stdin); the toy
    renderer uses only NumPy and PIL, never the parent's torch/OpenMP thread pool, which
    is what does not survive a fork.
    """
    items = list(items)
    workers = min(workers or default_workers(), len(items))
    bar = progress_bar(total=len(items), desc=desc, unit=unit, disable=not progress or not items, leave=False)
    with bar:
        if workers <= 1:
            for item in items:
                yield fn(item)
                bar.update(1)
            return
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
            for result in pool.map(fn, items):
                yield result
                bar.update(1)
