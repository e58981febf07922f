"""The training curves as a picture: loss terms, learning rate and tanh(gate) per logged step.

Written beside ``metrics.jsonl`` (``training.png``) when a run exports, so the loss is one file
away rather than a script away; TensorBoard (``run.trackers``) keeps the interactive view.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from demind.io import atomic_path
from demind.plots import file_pyplot
from demind.training.step_log import LOSS_TERMS

log = logging.getLogger(__name__)

PLOT_NAME = "training.png"


def read_metrics(path: Path) -> list[dict]:
    """The JSON lines of ``metrics.jsonl`` (a torn last line, from a killed run, is left out)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_training(metrics: Path, out: Path | None = None) -> Path | None:
    """Draw ``metrics`` (a run's ``metrics.jsonl``) as three panels -> the PNG's path, beside it by
    default; None (and one log line saying why) without matplotlib or without logged steps."""
    rows = [r for r in read_metrics(metrics) if "step" in r] if Path(metrics).is_file() else []
    if not rows:
        log.info("no training plot: %s holds no logged step", metrics)
        return None
    plt = file_pyplot(f"training plot (the numbers are in {metrics})")
    if plt is None:
        return None
    out = Path(out) if out is not None else Path(metrics).with_name(PLOT_NAME)
    steps = [r["step"] for r in rows]
    fig, (loss_ax, lr_ax, gate_ax) = plt.subplots(3, 1, figsize=(6, 7), sharex=True)
    for term in LOSS_TERMS:
        if all(term in r for r in rows):
            loss_ax.plot(steps, [r[term] for r in rows], label=term, linewidth=1.2)
    loss_ax.set_ylabel("loss (window mean)")
    loss_ax.legend(fontsize=8)
    lr_ax.plot(steps, [r.get("lr", float("nan")) for r in rows], color="tab:green")
    lr_ax.set_ylabel("learning rate")
    gate_ax.plot(steps, [r.get("gate", float("nan")) for r in rows], color="tab:red")
    gate_ax.axhline(0.0, color="grey", linewidth=0.6)
    gate_ax.set_ylabel("tanh(gate)")
    gate_ax.set_xlabel("optimizer step")
    fig.suptitle(f"{Path(metrics).parent.name}: {len(rows)} logged steps, last step {steps[-1]}", fontsize=9)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")  # the tmp name has no .png for matplotlib to go by
    plt.close(fig)
    return out
