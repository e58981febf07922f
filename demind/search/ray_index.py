"""A gallery index whose features are encoded on a Ray cluster (``demind-index --distributor ray``).

The images no finished part of the index holds (after :func:`~demind.search.index.build_index`'s
cache check, so a rerun or a resumed build does only what is missing) are split into units
(:func:`plan_units`): a tar shard's members together, runs of loose files in groups of
``part_size``. :class:`IndexWorker` actors each load the backbone once, from the settings the
local build loads it from, and return a unit's rows in the index's stored form (L2-normalised
float16: :meth:`ImageFeatureCache.stored`) with its unreadable files. The driver writes each unit
as one part of the index's cache as it arrives, so a killed driver loses only the units in
flight: the rerun finds the others cached. The driver loop is :func:`demind.distributed.drive`,
the one generation runs (free worker gets the next unit; a failed try goes to another worker,
``shard_attempts`` in all). Once every unit is back, this run's parts are put in unit order, which
is the listing order, so the rows follow the order a local build gives, and the ordinary local
pass of ``build_index`` assembles ``index.json`` from the cache, encoding nothing.

Every worker reads the images at the absolute paths the driver lists: the gallery (and the
checkpoint) must be on a filesystem every node mounts at the same path. A worker that cannot read
a file reports it as unreadable, named and counted as a broken file is.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from operator import attrgetter
from pathlib import Path

import torch

from demind.backbone import FrozenCLIP
from demind.distributed import (Dispatch, DistributedJobError, RayOptions, connect, count_workers, drive, import_ray,
                                start_workers, stop_workers, worker_resources)
from demind.embedding_cache import backbone_mismatch, cache_identity, read_record, read_tensors
from demind.retrieval import DamagedPartError, ImageFeatureCache, ImageRef, encode_image_refs, stack_features
from demind.search.index import ROLE, IndexBuildStats, build_index

log = logging.getLogger(__name__)


class UnitsFailedError(DistributedJobError):
    """Units that failed every try: the finished ones are kept, ``index.json`` is not updated."""


@dataclass(frozen=True)
class BackboneSource:
    """Where every process loads the backbone from: a De-MINDS ``checkpoint`` (its backbone rebuilt)
    or a ``spec`` ``NAME:TAG_OR_PATH``, in ``precision`` (what ``demind-index`` loads locally)."""

    checkpoint: str | None = None
    spec: str | None = None
    precision: str = "fp32"

    def absolute(self) -> "BackboneSource":
        """The same source with local files named by absolute paths (a worker's working folder differs)."""
        def absolute(value: str | None) -> str | None:
            return str(Path(value).absolute()) if value and Path(value).exists() else value

        spec = self.spec
        if spec and ":" in spec:
            name, _, tag = spec.partition(":")
            spec = f"{absolute(name)}:{absolute(tag)}"
        return replace(self, checkpoint=absolute(self.checkpoint), spec=spec)

    def load(self, device: str) -> FrozenCLIP:
        from demind.checkpoint import load_backbone_and_model

        return load_backbone_and_model(self.checkpoint, self.spec, precision=self.precision, device=device)[0]


@dataclass(frozen=True)
class IndexUnit:
    """Images encoded together and written as one part: ``refs`` in listing order; ``label`` names
    them in messages (a shard's path, or the first file of a run)."""

    unit_id: int
    label: str
    refs: tuple[ImageRef, ...]


@dataclass
class UnitResult:
    """What a worker returns for a unit: the readable ``names`` and their (n, D) ``rows`` in the
    cache's stored form, {name: error} of the unreadable, the unit's own time."""

    names: list[str]
    rows: torch.Tensor
    unreadable: dict[str, str]
    seconds: float


def plan_units(refs: list[ImageRef], part_size: int) -> list[IndexUnit]:
    """``refs`` (listing order) as units: each tar shard's members together, each run of loose files
    between shards in groups of at most ``part_size``. Concatenated in unit order they are ``refs``."""
    groups: list[list[ImageRef]] = []
    for ref in refs:
        last = groups[-1][-1] if groups else None
        same_shard = last is not None and ref.span and last.span and ref.path == last.path
        same_run = last is not None and not ref.span and not last.span and len(groups[-1]) < part_size
        if same_shard or same_run:
            groups[-1].append(ref)
        else:
            groups.append([ref])
    return [IndexUnit(i, str(g[0].path) if g[0].span else f"{g[0].name} and {len(g) - 1} more file(s)", tuple(g))
            for i, g in enumerate(groups)]


class IndexWorker:
    """One backbone, loaded once, that encodes whole units (a Ray actor). ``form``: the index's
    cache, whose stored form the rows are returned in (the worker writes nothing)."""

    def __init__(self, source: BackboneSource, identity: dict, device: str, batch_size: int, num_workers: int,
                 form: ImageFeatureCache):
        import socket

        self.host = socket.gethostname()
        self.backbone = source.load(device)
        mismatch = backbone_mismatch(identity, cache_identity(self.backbone))
        if mismatch:  # e.g. another file under the checkpoint's path on this node
            raise DistributedJobError(f"Ray worker on {self.host}: the index {mismatch}; every node must read the "
                                      "same checkpoint and backbone files (a shared filesystem, at the same path)")
        self.batch_size, self.num_workers, self.form = batch_size, num_workers, form

    def describe(self) -> dict:
        """Where this worker runs; also the driver's probe that it is up."""
        return {"pid": os.getpid(), "host": self.host, "device": str(self.backbone.device)}

    def run(self, unit: IndexUnit) -> UnitResult:
        """Encode one unit: a file this node cannot read (not on the shared filesystem, damaged) is
        reported in ``unreadable``, as the local build reports it."""
        start = time.perf_counter()
        features, stats = encode_image_refs(self.backbone, list(unit.refs), None, ROLE, self.batch_size,
                                            self.num_workers, max(len(unit.refs), 1), progress=False,
                                            desc=f"unit {unit.unit_id}", on_unreadable="skip")
        names = [r.name for r in unit.refs if r.name in features]
        rows = (self.form.stored(stack_features(features, names)) if names
                else torch.zeros(0, self.backbone.embed_dim, dtype=self.form.dtype))
        return UnitResult(names, rows, stats.unreadable, time.perf_counter() - start)


def build_index_on_ray(images: str | Path, index_dir: str | Path, source: BackboneSource, options: RayOptions,
                       batch_size: int = 64, num_workers: int = 0, part_size: int = 1024, progress: bool = True,
                       new_root: bool = False, device: str = "auto") -> IndexBuildStats:
    """:func:`~demind.search.index.build_index` with the missing images encoded on Ray workers
    (``device``: ``cpu``, ``cuda`` or ``auto`` = a GPU each where the cluster has GPUs). Returns the
    build's stats (``encoded``: on the workers). :class:`UnitsFailedError` when a unit failed
    every try (the finished units stay cached: the rerun encodes the rest)."""
    import_ray()  # before a model loads: a missing extra is one line at once
    source = source.absolute()
    backbone = source.load("cpu")  # the index's identity and width; this process encodes nothing
    job = partial(encode_on_ray, source=source, identity=cache_identity(backbone), options=options, device=device,
                  batch_size=batch_size, num_workers=num_workers, part_size=part_size, progress=progress)
    return build_index(images, index_dir, backbone, batch_size, num_workers, part_size, progress, new_root,
                       encode_missing=job)


def encode_on_ray(refs: list[ImageRef], cache: ImageFeatureCache, *, source: BackboneSource, identity: dict,
                  options: RayOptions, device: str, batch_size: int, num_workers: int, part_size: int,
                  progress: bool) -> tuple[int, dict[str, str]]:
    """Encode ``refs`` into parts of ``cache`` on Ray workers, one part per unit. Returns (rows
    written, {name: why unreadable})."""
    if not refs:
        return 0, {}
    ray = import_ray()
    units = plan_units([replace(r, path=r.path.absolute()) for r in refs], part_size)
    written: dict[int, tuple[Path, int]] = {}  # unit -> its part's record and rows, in arrival order
    unreadable: dict[str, str] = {}
    failed: dict[int, str] = {}
    started = connect(options.address, options.workers)
    workers: list = []
    try:
        cluster = ray.cluster_resources()
        resources = worker_resources(device, cluster, options.address)
        count = count_workers(options.workers, resources, cluster, len(units))
        workers = start_workers(ray, IndexWorker, count, resources, options.name_prefix, source, identity,
                                "cuda" if resources["num_gpus"] else "cpu", batch_size, num_workers, cache)
        log.info("ray: %d worker(s), each %s, for %d image(s) in %d unit(s)", count, resources, len(refs), len(units))
        state = Dispatch(key=attrgetter("unit_id"), workers=workers, pending=deque(units))
        state.probing = {w.describe.remote(): i for i, w in enumerate(workers)}
        drive(ray, state, partial(_write_unit, cache, identity, written, unreadable), options.shard_attempts,
              failed, progress, desc="index units", unit="unit", model="backbone")
    finally:
        stop_workers(ray, workers)
        if started:
            ray.shutdown()
    if failed:
        by_id = {u.unit_id: u for u in units}
        first = min(failed)
        raise UnitsFailedError(
            f"{len(failed)} of {len(units)} unit(s) could not be encoded on Ray, e.g. {by_id[first].label}: "
            f"{failed[first]}; the {len(written)} finished unit(s) are kept in {cache.dir}: rerun the same command "
            f"to encode the rest (index.json is written once every image is encoded)")
    retried = sorted(state.errors)
    if retried:
        log.warning("ray: %d unit(s) done after a failed try: %s", len(retried),
                    "; ".join(f"unit {u}: {', '.join(state.errors[u])}" for u in retried))
    _in_unit_order(cache, written, identity)
    return sum(rows for _, rows in written.values()), unreadable


def _write_unit(cache: ImageFeatureCache, identity: dict, written: dict[int, tuple[Path, int]],
                unreadable: dict[str, str], unit: IndexUnit, result: UnitResult, worker: int, start: float) -> int:
    """A unit came back: its rows become one part of the cache now (the rerun of a killed driver
    finds them). Returns the images it held (read or not)."""
    unreadable.update(result.unreadable)
    if result.names:
        keys = {r.name: r.cache_key for r in unit.refs}
        record = cache.write_part(ROLE, result.names, [keys[n] for n in result.names], result.rows, identity)
        written[unit.unit_id] = (record, len(result.names))
    log.debug("unit %d (%s) done on worker %d in %.1f s", unit.unit_id, unit.label, worker, result.seconds)
    return len(unit.refs)


def _in_unit_order(cache: ImageFeatureCache, written: dict[int, tuple[Path, int]], identity: dict) -> None:
    """Rewrite this run's parts in unit order (they were written as they arrived) after every other
    part, so the rows follow the listing order as a local build's do. A kill in here leaves some
    entries twice: the local pass then compacts the whole index, in listing order."""
    if list(written) == sorted(written):
        return
    for unit_id in sorted(written):
        record_path = written[unit_id][0]
        record = read_record(record_path, DamagedPartError, "")
        rows = read_tensors(record_path.with_suffix(".safetensors"), DamagedPartError, "feature part", "")["features"]
        cache.write_part(ROLE, record["names"], record["keys"], rows, identity)
    for record_path, _ in written.values():  # the record (done-marker) first, as replace_all does
        record_path.unlink(missing_ok=True)
        record_path.with_suffix(".safetensors").unlink(missing_ok=True)
