"""One optimizer step: losses of a batch, the NaN/inf check, accumulation, and the step loop."""

from __future__ import annotations

from typing import Any

import torch
from demind.logs import progress_bar

from demind.backbone import FrozenCLIP
from demind.fidelity import gfq_fidelity
from demind.losses import Gather, demind_losses
from demind.robust import noise_aware_losses, target_fidelity
from demind.schema import NoiseConfig
from demind.trainkit import finite_flags, is_deepspeed, make_gather, raise_non_finite
from demind.training.batches import batch_embeddings, batch_rewritten_embeddings
from demind.training.config import TrainConfig
from demind.training.step_log import LOSS_TERMS, NOISE_TERMS, DeMindsLogWindow, log_metrics
from demind.training.resume import TrainState, save_training_state

__all__ = ["check_finite", "compute_losses", "train_one_step", "train_steps"]


def compute_losses(model: torch.nn.Module, batch: dict[str, Any], backbone: FrozenCLIP, *,
                   distil: bool = True, gather: Gather | None = None, noise: NoiseConfig | None = None,
                   step: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """One forward pass on a batch from the data stream -> {"loss", "distil", "align"} scalars
    (plus the noise terms of :func:`demind.robust.noise_aware_losses` when ``noise.mode`` is not none).

    ``model`` may be wrapped (DDP); the temperature is read from the unwrapped module.
    ``step`` and ``seed`` seed GFQ's random pairings, so a resumed run draws the same ones.
    """
    image_emb, teacher_emb = batch_embeddings(batch, backbone)
    out = model(image_emb, batch["targets"])
    core = model.module if hasattr(model, "module") else model
    if noise is None or noise.mode == "none":
        return demind_losses(out, teacher_emb, image_emb, core.temperature_scale(), distil=distil, gather=gather)
    fidelity_int, fidelity_rew = batch_fidelity(image_emb, teacher_emb, batch_rewritten_embeddings(batch, backbone),
                                                noise.pairings, seed, step)
    negative = core.negative_composition(image_emb) if noise.mode == "conesep" else None
    return noise_aware_losses(out, teacher_emb, image_emb, core.temperature_scale(), noise,
                              target_fidelity(batch["target_kinds"], fidelity_int, fidelity_rew), fidelity_int,
                              negative=negative, after_warmup=step >= noise.warmup_steps, distil=distil,
                              gather=gather)


def batch_fidelity(image_emb: torch.Tensor, teacher_emb: torch.Tensor, rew_emb: torch.Tensor, pairings: int,
                   seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GFQ fidelity (B,) of T_int and of T_rew, the pool being the batch (ConeSep's random texts from
    the batch); from embeddings the batch already holds, so no encoder runs for it when cached."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    fidelity_int, _ = gfq_fidelity(image_emb, teacher_emb, pairings, generator)
    fidelity_rew, _ = gfq_fidelity(image_emb, rew_emb, pairings, generator)
    return fidelity_int, fidelity_rew


def check_finite(losses: dict[str, torch.Tensor], step: int, accelerator) -> None:
    """Stop every process when any process sees a NaN/inf loss term, naming the term."""
    terms = {t: losses[t] for t in losses if t in LOSS_TERMS or t in NOISE_TERMS}
    flags = finite_flags(terms)
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags.to(accelerator.device), reduction="sum") / accelerator.num_processes
    raise_non_finite(terms, flags, step, hint="lower optim.lr, set optim.grad_clip, or check the data; rerunning "
                                              "resumes from the last checkpoint")


def train_one_step(cfg: TrainConfig, accelerator, model, optimizer, scheduler, batches, backbone: FrozenCLIP,
                   state: TrainState, window: DeMindsLogWindow, gather: Gather | None) -> None:
    """One optimizer step over ``optim.grad_accum_steps`` micro-batches from ``batches``."""
    # DeepSpeed's backward also steps (and clips): check the losses before it. Elsewhere the check
    # (which waits for the device) comes after backward is queued, still before optimizer.step().
    steps_in_backward = is_deepspeed(accelerator)
    for _ in range(cfg.optim.grad_accum_steps):
        batch = next(batches)
        truncated = backbone.text_counts["truncated"]
        with accelerator.accumulate(model):
            with accelerator.autocast():
                losses = compute_losses(model, batch, backbone, distil=cfg.loss.distil, gather=gather,
                                        noise=cfg.noise, step=state.step, seed=cfg.run.seed)
            if steps_in_backward:
                check_finite(losses, state.step, accelerator)
            accelerator.backward(losses["loss"])
            if not steps_in_backward:
                # After queueing backward (the check waits for the device), still before any update.
                check_finite(losses, state.step, accelerator)
            # the step's whole gradient, before clipping; read at the log line (DeepSpeed holds its
            # gradients in its own partitions and has stepped already: not logged rather than a fake 0)
            if accelerator.sync_gradients and not steps_in_backward:
                window.note_gate_grad(accelerator.unwrap_model(model).gate)
            if accelerator.sync_gradients and cfg.optim.grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state.positions[batch["worker"]] = tuple(batch["position"])
        state.counts.update(batch["counts"])
        if backbone.text_counts["truncated"] > truncated:  # texts cut to the context: counted and logged
            state.counts["text_truncated"] += backbone.text_counts["truncated"] - truncated
        window.add(losses)
    # Stepped here, once per optimizer step, not by Accelerate (which steps it once per process).
    if not optimizer.step_was_skipped:
        scheduler.step()
    state.step += 1
    state.samples_seen += cfg.optim.global_batch_size


def train_steps(cfg: TrainConfig, accelerator, model, optimizer, scheduler, loader, backbone: FrozenCLIP,
                state: TrainState) -> None:
    """Optimizer steps from ``state.step`` to ``optim.max_steps``, logging and checkpointing."""
    if state.step >= cfg.optim.max_steps:
        return  # a finished run, rerun: nothing to train
    gather = make_gather(accelerator)
    model.train()
    window = DeMindsLogWindow.restore(state.log_window)
    batches = iter(loader)
    with progress_bar(lines=False, total=cfg.optim.max_steps, initial=state.step, desc="train", unit="step",
              disable=not (accelerator.is_local_main_process and cfg.run.progress)) as bar:
        while state.step < cfg.optim.max_steps:
            train_one_step(cfg, accelerator, model, optimizer, scheduler, batches, backbone, state, window, gather)
            window.samples += cfg.optim.global_batch_size
            bar.update(1)
            if state.step % cfg.run.log_every == 0 or state.step == cfg.optim.max_steps:
                log_metrics(accelerator, cfg, state, window, model, scheduler, bar)
                window = DeMindsLogWindow()
            state.log_window = window.snapshot()
            if state.step % cfg.run.save_every == 0 or state.step == cfg.optim.max_steps:
                save_training_state(accelerator, cfg, state)

