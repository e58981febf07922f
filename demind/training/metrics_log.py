"""Progress logging shared by the trainers: loss sums since the last log line (:class:`LogWindow`),
one readable console line (:func:`step_line`) and one ``metrics.jsonl`` line (:func:`append_metrics`)
per log step; De-MINDS adds its tracker values (:func:`log_metrics`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from demind.io import write_text_atomic
from demind.training.config import TrainConfig
from demind.training.optim import gate_lr
from demind.training.checkpoints import TrainState

LOSS_TERMS = ("loss", "distil", "align")
# logged when training.noise.mode is not none (demind.robust): ConeSep's terms, the batch's
# share below omega per term, and the OT plans' mass on masked paths (0 by construction)
NOISE_TERMS = ("ul", "intra", "noisy_align", "noisy_distil", "ot_masked_mass")


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

    names: the terms it sums, in log order (De-MINDS's by default; another trainer passes its own
    and ``sums={}``)."""

    # float64 tensors on the loss's device: adding needs no host sync (a float() per term and
    # step made the CPU wait for every step to finish before queueing the next one), and
    # float64 adds the same as the Python floats summed before.
    sums: dict[str, torch.Tensor | float] = field(default_factory=lambda: dict.fromkeys(LOSS_TERMS, 0.0))
    micro_steps: int = 0
    samples: int = 0
    start: float = field(default_factory=time.perf_counter)
    names: tuple[str, ...] = LOSS_TERMS + NOISE_TERMS
    # |dL/d alpha| of the window's last optimizer step (a device tensor: no host sync per step)
    gate_grad: torch.Tensor | None = None

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        for t in self.names:
            if t in losses:
                self.sums[t] = self.sums.get(t, 0.0) + losses[t].detach().double()
        self.micro_steps += 1

    def note_gate_grad(self, gate: torch.nn.Parameter) -> None:
        """Keep the gate's gradient of this optimizer step (0 when it got none: an ablation without the gate)."""
        self.gate_grad = gate.grad.detach().abs().clone() if gate.grad is not None else torch.zeros(())

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
        """The logged terms: ``names`` this run has (De-MINDS: LOSS_TERMS, then its noise terms)."""
        return [t for t in self.names if t in self.sums]

    def means(self, device: torch.device) -> torch.Tensor:
        """(terms,) float32 mean of each term of :meth:`terms` over the window's micro-steps."""
        sums = torch.stack([torch.as_tensor(self.sums[t], dtype=torch.float64, device=device) for t in self.terms()])
        return (sums / max(self.micro_steps, 1)).float()


def log_metrics(accelerator, cfg: TrainConfig, state: TrainState, window: LogWindow, model, scheduler,
                bar: tqdm) -> None:
    """One console line, a metrics.jsonl line and tracker values, averaged over processes."""
    local = window.means(accelerator.device)
    means = accelerator.reduce(local, reduction="mean") if accelerator.num_processes > 1 else local
    core = accelerator.unwrap_model(model)
    elapsed = max(time.perf_counter() - window.start, 1e-9)
    metrics = {t: round(float(v), 6) for t, v in zip(window.terms(), means.tolist())}
    metrics.update(lr=scheduler.get_last_lr()[0], gate=round(float(torch.tanh(core.gate.detach())), 6),
                   gate_lr=gate_lr(scheduler.optimizer, core.gate, cfg.optim), samples_per_s=round(window.samples / elapsed, 2))
    if window.gate_grad is not None:  # every window holds a step; kept out rather than faked if not
        metrics["gate_grad"] = round(float(window.gate_grad), 8)
    accelerator.log(metrics, step=state.step)
    if accelerator.is_main_process:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(state.counts.items()))
        parts = [*term_parts(metrics, LOSS_TERMS), f"lr {metrics['lr']:.3g}", f"tanh(gate) {metrics['gate']:+.4f}",
                 f"gate lr {metrics['gate_lr']:.3g}", f"|grad gate| {metrics.get('gate_grad', float('nan')):.3g}",
                 f"{metrics['samples_per_s']:.1f} samples/s", *term_parts(metrics, NOISE_TERMS, ".4g")]
        bar.write(step_line(state.step, cfg.optim.max_steps, parts + ([skipped] if skipped else [])))
        append_metrics(Path(cfg.run.output_dir) / "metrics.jsonl",
                       dict(step=state.step, samples_seen=state.samples_seen, **metrics, counts=dict(state.counts)))


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics lines logged after ``step`` by an interrupted run (they will be redone)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    write_text_atomic(path, "".join(line + "\n" for line in keep))

