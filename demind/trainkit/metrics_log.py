"""Progress logging shared by the trainers: loss sums since the last log line (:class:`LogWindow`),
one readable console line (:func:`step_line`) and one ``metrics.jsonl`` line (:func:`append_metrics`)
per log step, trimmed back on a resume (:func:`trim_metrics`). De-MINDS's own line and window:
:mod:`demind.training.step_log`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from demind.io import write_text_atomic


def step_line(step: int, total: int, parts: list[str], prefix: str = "") -> str:
    """``"<prefix>step 40/100 | loss 0.1234 | ..."``: the one console line of a log step."""
    return " | ".join([f"{prefix}step {step}/{total}", *parts])


def term_parts(values: dict[str, float], names: tuple[str, ...] | list[str], fmt: str = ".4f") -> list[str]:
    """``["loss 0.1234", ...]`` for the ``names`` present in ``values``, in that order."""
    return [f"{name} {values[name]:{fmt}}" for name in names if name in values]


def append_metrics(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line to ``path`` (``metrics.jsonl``; see :func:`trim_metrics` for resumes)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@dataclass
class LogWindow:
    """Loss sums and sample counts since the last log line.

    names: the terms it sums, in log order (each trainer passes its own; De-MINDS's window is
    :class:`demind.training.step_log.DeMindsLogWindow`)."""

    # float64 tensors on the loss's device: adding needs no host sync (a float() per term and
    # step made the CPU wait for every step to finish before queueing the next one), and
    # float64 adds the same as the Python floats summed before.
    sums: dict[str, torch.Tensor | float] = field(default_factory=dict)
    micro_steps: int = 0
    samples: int = 0
    start: float = field(default_factory=time.perf_counter)
    names: tuple[str, ...] = ()

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        for t in self.names:
            if t in losses:
                self.sums[t] = self.sums.get(t, 0.0) + losses[t].detach().double()
        self.micro_steps += 1

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint keeps of the window (not the timer: samples/s restarts after a resume)."""
        # the sums live on the device (see above); the checkpoint's JSON wants plain floats, and
        # float64 -> float keeps every bit, so a resumed window logs what an uninterrupted one does
        return {"sums": {t: float(v) for t, v in self.sums.items()}, "micro_steps": self.micro_steps}

    @classmethod
    def restore(cls, saved: dict[str, Any], **fields: Any) -> "LogWindow":
        """A window from :meth:`snapshot`'s output (``fields``: the constructor's, e.g. ``names``)."""
        window = cls(**fields)
        if saved:
            window.sums.update(saved["sums"])
            window.micro_steps = saved["micro_steps"]  # samples stay 0: samples/s counts from the resume
        return window

    def terms(self) -> list[str]:
        """The logged terms: ``names`` this run has (De-MINDS: its loss terms, then its noise terms)."""
        return [t for t in self.names if t in self.sums]

    def means(self, device: torch.device) -> torch.Tensor:
        """(terms,) float32 mean of each term of :meth:`terms` over the window's micro-steps."""
        sums = torch.stack([torch.as_tensor(self.sums[t], dtype=torch.float64, device=device) for t in self.terms()])
        return (sums / max(self.micro_steps, 1)).float()


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics lines logged after ``step`` by an interrupted run (they will be redone)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    write_text_atomic(path, "".join(line + "\n" for line in keep))

