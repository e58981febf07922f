"""De-MINDS's checkpoints and resume: Accelerate state plus trainer_state.json, saved atomically, pruned, resumed.

``<run.output_dir>/checkpoints/step_XXXXXXXX/`` holds the Accelerate state (model, optimizer,
scheduler, scaler, RNG), ``trainer_state.json`` (progress, data-stream positions, skip counts)
and ``config.yaml``; it is saved to ``*.tmp`` then renamed.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demind.config import config_changes, save_config, to_dict, with_defaults
from demind.io import reporting_output_errors, temp_path
from demind.schema import SPEED_ONLY_KEYS
from demind.trainkit import ResumeError, is_deepspeed, save_accelerator_state_atomically
from demind.training.config import TrainConfig

logger = logging.getLogger(__name__)


STATE_NAME = "trainer_state.json"


@dataclass
class TrainState:
    """What a checkpoint adds to Accelerate's state: progress and data-stream positions."""

    step: int = 0
    samples_seen: int = 0
    positions: dict[int, tuple[int, int]] = field(default_factory=dict)  # this process: worker -> (group, offset)
    counts: Counter = field(default_factory=Counter)  # skipped / patched samples, this process
    resumed_positions: list[dict[int, tuple[int, int]]] | None = None  # all processes, from the checkpoint
    # this process's loss sums since the last log line: part of the resumable state, so a resumed
    # run logs the same averages as an uninterrupted one (the window spans the resume)
    log_window: dict[str, Any] = field(default_factory=dict)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint folder (a ``*.tmp`` folder is an interrupted save)."""
    done = [p for p in checkpoint_root(run_dir).glob("step_*")
            if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE_NAME).is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def save_training_state(accelerator, cfg: TrainConfig, state: TrainState) -> Path:
    """Accelerate state + trainer_state.json + config.yaml into ``step_N.tmp``, then rename.

    Every process must call this (each saves its RNG state and reports its data positions).
    """
    from accelerate.utils import gather_object

    run_dir = Path(cfg.run.output_dir)
    final = checkpoint_root(run_dir) / f"step_{state.step:08d}"
    positions = gather_object([{int(w): list(p) for w, p in state.positions.items()}])
    counts = gather_object([dict(state.counts)])
    windows = gather_object([state.log_window])

    def write_trainer_state(tmp: Path) -> None:
        total = Counter()
        for c in counts:
            total.update(c)
        trainer_state = dict(step=state.step, samples_seen=state.samples_seen,
                             num_processes=accelerator.num_processes, num_workers=cfg.data.num_workers,
                             positions=positions, counts=dict(total), log_windows=windows)
        (tmp / STATE_NAME).write_text(json.dumps(trainer_state, indent=1))
        save_config(cfg, tmp / "config.yaml")

    # torch.save reports a full disk as "basic_ios::clear: iostream error": name the disk and path instead
    with reporting_output_errors(temp_path(final)):
        save_accelerator_state_atomically(accelerator, final, before_rename=write_trainer_state)
        if accelerator.is_main_process:
            prune_checkpoints(run_dir, cfg.run.keep_checkpoints)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and saves interrupted by a kill."""
    folders = list(checkpoint_root(run_dir).glob("step_*"))
    done = sorted((p for p in folders if not p.name.endswith(".tmp")), key=lambda p: int(p.name.split("_")[1]))
    stale = [p for p in folders if p.name.endswith(".tmp")]
    for old in (done[:-keep] if keep > 0 else []) + stale:
        shutil.rmtree(old, ignore_errors=True)


# Keys that change where, how fast or how verbosely a run goes on, not what it trains: a resumed run may
# take other values (reported in one log line). optim.max_steps may grow, to train on (its shrinking below
# the checkpoint's step is refused in resume_state). Every other key is the recipe or its inputs: a
# resumed run with another value would mix two recipes in one set of weights, so it is refused.
RESUME_FREE_KEYS = SPEED_ONLY_KEYS | frozenset({
    "optim.max_steps", "data.num_workers", "data.features", "data.cache_batch_size",
    "run.output_dir", "run.device", "run.log_every", "run.save_every", "run.keep_checkpoints", "run.resume",
    "run.trackers", "run.progress", "run.threads",
})


def check_resumable(saved: dict[str, Any], cfg: TrainConfig, where: Path) -> None:
    """Refuse to resume under another recipe (a changed key outside :data:`RESUME_FREE_KEYS`), naming
    every changed key; report the free keys that changed in one log line."""
    current = to_dict(cfg)
    # a key the checkpoint's config lacks (added since, e.g. run.threads) and left at its default is no change
    defaults = to_dict(type(cfg)())
    changes = [d for s in current
               for d in config_changes(with_defaults(saved.get(s, {}), defaults[s]), current[s], s)]
    recipe = [d for d in changes if d.split(" ")[0] not in RESUME_FREE_KEYS]
    if recipe:
        raise ResumeError(
            f"cannot resume from {where}: {', '.join(recipe)} differ from the checkpoint's config; "
            f"use a new run.output_dir, or rerun with the checkpoint's values"
        )
    if changes:
        logger.warning("resuming from %s with changed settings: %s", where, ", ".join(changes))


DEEPSPEED_FOLDER = "pytorch_model"  # where Accelerate's save_state puts DeepSpeed's engine checkpoint


def check_same_engine(checkpoint: Path, accelerator) -> None:
    """A checkpoint written under DeepSpeed (sharded optimizer states) resumes only under DeepSpeed, and
    the other way round: say so in one line instead of failing inside Accelerate's loader."""
    written = (checkpoint / DEEPSPEED_FOLDER).is_dir()
    running = is_deepspeed(accelerator)
    if written != running:
        raise ResumeError(f"cannot resume from {checkpoint}: it was written {'under' if written else 'without'} "
                          f"DeepSpeed and this run is {'' if running else 'not '}using it; launch with the "
                          f"accelerate config that wrote it, or use a new run.output_dir")


def _resume_fix(latest: Path) -> str:
    return (f"delete {latest} to resume from the checkpoint before it (or restore an intact copy), or use a new "
            f"run.output_dir")


def check_resume_recipe(cfg: TrainConfig) -> Path | None:
    """The newest checkpoint of the run folder (None: a fresh run), refused in one line when this run may
    not resume from it (run.resume=false, an unreadable config, another recipe: :func:`check_resumable`).
    Reads no weights: :func:`demind.training.loop.train` calls it before the backbone loads."""
    import yaml

    run_dir = Path(cfg.run.output_dir)
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None
    if not cfg.run.resume:
        raise ResumeError(f"{run_dir} already holds checkpoints (newest {latest.name}) but run.resume=false; "
                          f"use a new run.output_dir or delete {checkpoint_root(run_dir)}")
    try:
        saved_config = yaml.safe_load((latest / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ResumeError(f"cannot resume: {latest / 'config.yaml'} cannot be read ({str(e).splitlines()[0]}); "
                          f"{_resume_fix(latest)}") from None
    if not isinstance(saved_config, dict):
        raise ResumeError(f"cannot resume: {latest / 'config.yaml'} is not a config (a YAML mapping); "
                          f"{_resume_fix(latest)}")
    check_resumable(saved_config, cfg, latest)
    return latest


def resume_state(accelerator, cfg: TrainConfig) -> TrainState:
    """Load the newest checkpoint of the run folder, or start fresh."""
    run_dir = Path(cfg.run.output_dir)
    latest = check_resume_recipe(cfg)
    if latest is None:
        return TrainState()
    fix = _resume_fix(latest)
    check_same_engine(latest, accelerator)
    try:
        accelerator.load_state(str(latest))
    except (EOFError, pickle.UnpicklingError, RuntimeError) as e:  # a truncated or foreign state file
        raise ResumeError(f"cannot resume from {latest}: its Accelerate state is truncated or corrupted "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); {fix}") from None
    try:
        saved = json.loads((latest / STATE_NAME).read_text(encoding="utf-8"))
        positions = [{int(w): tuple(p) for w, p in per_rank.items()} for per_rank in saved["positions"]]
        saved["step"], saved["samples_seen"]  # noqa: B018  (present, or the file is not ours)
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ResumeError(f"cannot resume: {latest / STATE_NAME} is truncated or not a trainer state "
                          f"({type(e).__name__}: {e}); {fix}") from None
    if saved["step"] > cfg.optim.max_steps:  # its weights are past the end asked for: no export can be that step
        raise ResumeError(f"cannot resume {run_dir} with optim.max_steps={cfg.optim.max_steps}: its newest checkpoint "
                          f"{latest.name} is at step {saved['step']}; give optim.max_steps={saved['step']} or more "
                          f"(= {saved['step']}: export it as it is), or a new run.output_dir to train "
                          f"{cfg.optim.max_steps} steps")
    same_readers = len(positions) == accelerator.num_processes and saved.get("num_workers") == cfg.data.num_workers
    if not same_readers:
        logger.warning("checkpoint %s was written by %d processes x %s workers, this run has %d x %d: the data "
                       "streams restart on a new seed instead of continuing exactly", latest, len(positions),
                       saved.get("num_workers"), accelerator.num_processes, cfg.data.num_workers)
    state = TrainState(step=saved["step"], samples_seen=saved["samples_seen"],
                       resumed_positions=positions if same_readers else None)
    windows = saved.get("log_windows")
    if windows and len(windows) == accelerator.num_processes:
        state.log_window = dict(windows[accelerator.process_index])
    state.positions = dict(positions[accelerator.process_index]) if same_readers else {}
    if accelerator.is_main_process:
        state.counts.update(saved.get("counts", {}))
    logger.info("resumed from %s at step %d (%d samples seen)", latest, state.step, state.samples_seen)
    return state

