"""De-MINDS's progress logging: its loss terms (:data:`LOSS_TERMS`, :data:`NOISE_TERMS`), its log
window with the gate's gradient (:class:`DeMindsLogWindow`) and its log step (:func:`log_metrics`:
console line, ``metrics.jsonl`` line and tracker values), on the shared :mod:`demind.trainkit` pieces."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from demind.trainkit import LogWindow, append_metrics, step_line, term_parts
from demind.training.config import TrainConfig
from demind.training.optim import gate_lr
from demind.training.resume import TrainState

LOSS_TERMS = ("loss", "distil", "align")
# logged when training.noise.mode is not none (demind.robust): ConeSep's terms, the batch's
# share below omega per term, and the OT plans' mass on masked paths (0 by construction)
NOISE_TERMS = ("ul", "intra", "noisy_align", "noisy_distil", "ot_masked_mass")


@dataclass
class DeMindsLogWindow(LogWindow):
    """:class:`~demind.trainkit.LogWindow` over De-MINDS's terms, plus the gate's gradient."""

    sums: dict[str, torch.Tensor | float] = field(default_factory=lambda: dict.fromkeys(LOSS_TERMS, 0.0))
    names: tuple[str, ...] = LOSS_TERMS + NOISE_TERMS
    # |dL/d alpha| of the window's last optimizer step (a device tensor: no host sync per step)
    gate_grad: torch.Tensor | None = None

    def note_gate_grad(self, gate: torch.nn.Parameter) -> None:
        """Keep the gate's gradient of this optimizer step (0 when it got none: an ablation without the gate)."""
        self.gate_grad = gate.grad.detach().abs().clone() if gate.grad is not None else torch.zeros(())


def log_metrics(accelerator, cfg: TrainConfig, state: TrainState, window: DeMindsLogWindow, model, scheduler,
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
