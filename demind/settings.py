"""What a config field may hold: declared rules (:func:`setting`) and the common run settings
(:class:`RunSection`, which every command's ``run`` section extends).

The declaration side of :mod:`demind.config` (which loads, checks and saves configs): a
dataclass field is declared with its rule and help text,

    lr: float = setting(1e-6, gt=0, help="peak learning rate")

and :func:`demind.config.validate` checks every value against it once, at load time.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rule:
    """Allowed values of one config field: bounds (inclusive ``ge``/``le``, exclusive ``gt``/``lt``)
    and/or a set of ``choices``. Bounds apply to numbers and to every number of a list."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    pattern: str | None = None  # a string must match it whole (e.g. DEVICE_PATTERN)
    spelled: str | None = None  # how ``pattern`` reads in a message ("auto, cpu, cuda or cuda:N")

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.pattern is not None:
            return self.spelled or f"a string matching {self.pattern!r}"
        parts = [f"{op} {bound:g}" for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                 if bound is not None]
        return " and ".join(parts)

    def allows(self, value: Any) -> bool:
        if value is None:
            return True  # Optional fields: None is checked by the type, not the rule
        if isinstance(value, (list, tuple)):
            return all(self.allows(v) for v in value)
        if self.choices is not None and value not in self.choices:
            return False
        if self.pattern is not None and not (isinstance(value, str) and re.fullmatch(self.pattern, value)):
            return False
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # written as "not (ok)" so that NaN fails every bound
            if self.ge is not None and not value >= self.ge:
                return False
            if self.gt is not None and not value > self.gt:
                return False
            if self.le is not None and not value <= self.le:
                return False
            if self.lt is not None and not value < self.lt:
                return False
        return True


OUTPUT_KINDS = ("dir", "file")
INPUT_KINDS = ("dir", "file", "path")  # path: a file or a folder


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            help: str | None = None, output: str | None = None, refuses: Any = dataclasses.MISSING,  # noqa: A002
            free: str | None = None, input: str | None = None, **rule: Any) -> Any:  # noqa: A002
    """A dataclass field with a declared :class:`Rule` and the text ``--help`` shows for it:
    ``lr: float = setting(1e-6, gt=0, help="peak learning rate")``.

    Every key of a command is checked when its config is (:func:`demind.config.check_command_config`)
    or said to be free; ``tests/test_config_checks.py`` walks every command's keys and tries each
    declared check with a value it must refuse. Besides a rule:

    * ``output="dir"`` (or ``"file"``): a folder (file) the command writes; refused, naming the key,
      when this process cannot create or write it (:func:`demind.config.check_outputs`);
    * ``input="dir"`` (``"file"``, ``"path"``: either): a folder (file) the command reads; refused,
      naming the key, when it does not exist (a Hub reference ``hf-hub:...`` or a URL is left to its
      loader);
    * ``refuses=VALUE``: a value the section's ``config_problems()`` refuses (a cross-field or parsed
      value: ``shard="5-2"``), which the test tries;
    * ``free="why"``: any value of the field's type is fine (a seed, a text, a label), and why."""
    if "choices" in rule:
        rule["choices"] = tuple(rule["choices"])
    if output is not None and output not in OUTPUT_KINDS:
        raise ValueError(f"setting(output=...) is one of {OUTPUT_KINDS}, not {output!r}")
    metadata: dict[str, Any] = {"rule": Rule(**rule)}
    if help:
        metadata["help"] = help
    if output is not None:
        metadata["output"] = output
    if input is not None:
        if input not in INPUT_KINDS:
            raise ValueError(f"setting(input=...) is one of {INPUT_KINDS}, not {input!r}")
        metadata["input"] = input
    if refuses is not dataclasses.MISSING:
        metadata["refuses"] = refuses
    if free:
        metadata["free"] = free
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


def device_setting(default: str = "auto") -> Any:
    """``run.device``: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    return setting(default, pattern=DEVICE_PATTERN, spelled="auto, cpu, cuda or cuda:N",
                   help="auto = cuda when a GPU is visible, else cpu")


def threads_setting() -> Any:
    """``run.threads``: torch's CPU threads for the command, set before its first tensor op
    (:func:`demind.cli.common.apply_threads`)."""
    # bounded: torch starts every thread asked for on its first op (100,000 crashed the process with a
    # segmentation fault, after the model had loaded); more threads than cores only contend
    return setting(0, ge=0, le=MAX_THREADS, help="torch CPU threads (0: torch's default, one per core); 1 keeps "
                                                 "batch-1 queries steady on a machine busy with other work "
                                                 "(BENCHMARKS.md, search)")


MAX_THREADS = 1024
"""The most threads a ``run.threads`` key takes (4,096 ran; 100,000 crashed torch's thread pool)."""


def resolve_device(name: str) -> str:
    """``run.device`` -> a torch device string: ``auto`` becomes ``cuda`` when a GPU is visible, else ``cpu``."""
    if name != "auto":
        return name
    import torch  # only here: reading a config must not need torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass
class RunSection:
    """What every command's ``run`` section holds: where it runs and whether it shows progress bars.

    Each command's section extends it and is named for its command (``TrainRunConfig``,
    ``ExclMMRunConfig``, ``TripletRunConfig``, ``MinePairsRunConfig``, ``GenRunConfig``,
    :class:`ModelRunConfig`, :class:`QueryRunConfig`, the toy world's ``ToyRunConfig``); one whose
    default or help text differs declares ``device`` or ``progress`` again. ``threads`` is
    :func:`threads_setting` where a command has it."""

    device: str = device_setting()
    progress: bool = setting(True, help="progress bars")


@dataclasses.dataclass
class ModelRunConfig(RunSection):
    """The ``run`` section of the commands that only load and apply a model (demind-index; demind-eval,
    demind-search and demind-serve extend it: :class:`QueryRunConfig`)."""

    threads: int = threads_setting()


@dataclasses.dataclass
class DistributorOptions:
    """Where a job's units of work run (``demind-generate``: input shards; ``demind-index``: a tar
    shard's images, or a run of loose files): this process, or Ray workers each holding one model."""

    distributor: str = setting("local", choices=("local", "ray"),
                               help="'local': in this process; 'ray': on Ray workers, one model (engine or "
                                    "backbone) each, every node reading the inputs at the same path (a shared "
                                    "filesystem; pip install 'demind[distributed]')")
    workers: int = setting(0, ge=0, help="ray: models (Ray actors) to start; 0 = one per GPU of the cluster "
                                         "(tensor_parallel_size GPUs each for vLLM); required without GPUs")
    ray_address: str | None = setting(None, refuses="head:6379", help="ray: the cluster to join (HOST:6379); "
                                                 "default RAY_ADDRESS, else a local cluster on this machine")
    shard_attempts: int = setting(3, ge=1, help="ray: tries of a unit of work whose worker died or raised, each "
                                                "on another worker where one is free; then it is reported as failed")

    def distributor_problems(self) -> list[tuple[str, str]]:
        """The Ray settings given without ``--distributor ray``: refused rather than ignored."""
        if self.distributor != "local":
            return []
        return [(key, f"= {getattr(self, key)} applies to --distributor ray only; add --distributor ray")
                for key, unset in (("workers", 0), ("ray_address", None), ("shard_attempts", 3))
                if getattr(self, key) != unset]


# How De-MINDS queries run (DeMinds.set_query_mode): declared here, torch-free, for the run sections
QUERY_MODES = ("eager", "compile", "cudagraphs")


@dataclasses.dataclass
class QueryRunConfig(ModelRunConfig):
    """The ``run`` section of the commands that compose queries with a checkpoint (eval, search, serve)."""

    query_mode: str = setting("eager", choices=QUERY_MODES,
                              help="how a checkpoint's queries run: eager; compile (torch.compile; on a CPU the "
                                   "weights are frozen into the compiled code: a batch-1 query's text side about "
                                   "1.8x faster after the first, which compiles for about a minute; images are "
                                   "encoded eagerly; needs a C++ compiler); "
                                   "cudagraphs (a "
                                   "GPU: CUDA graphs replay the launches). Embeddings equal eager's within float "
                                   "rounding (BENCHMARKS.md, search)")


def resolve_workers(requested: int) -> int:
    """An encoding DataLoader's worker count: ``requested``, at most the CPUs this process may use.

    More decoding workers than cores only contend (torch warns about it on every run); the results
    do not depend on the count. The training stream is not capped here: there the worker count
    splits the shards between readers and is part of what a resumed run must match."""
    import os

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(0, min(requested, cpus))
