"""Training the toy CLIP from scratch: image-tower pre-training on tags, then ClipLoss with the tower locked.

On the shared trainer parts (:mod:`demind.trainkit`): the optimizer and schedule
(``build_adamw``, ``build_lr_scheduler``), the non-finite check (``check_finite_terms``), the log
line (``step_line``) and the resumable state (``save_train_state``: one ``.safetensors`` file,
tensors + JSON, no pickle). A stage has its own optimizer and schedule: the image pre-training a
constant lr, the contrastive stage a linear warm-up then a cosine towards 0 (reached just after its
last step).
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from open_clip.loss import ClipLoss
from demind.logs import progress_bar

from demind.trainkit import (build_adamw, build_lr_scheduler, check_finite_terms, load_train_state,
                             restore_train_state, save_train_state, step_line, term_parts)

from .clip import (
    attribute_targets, build_toy_model, encode_text_trimmed, encode_toy_images, images_to_tensor, tag_columns)
from toyworld.clip_config import TAG_VALUES, ToyBackboneConfig
from .clip_data import draw_batch, groups_per_batch, render_group_pool, render_pool, training_pool
from .world import Scene
from demind.seeding import derive_seed

logger = logging.getLogger(__name__)

Stage = tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]


def stage_optimizer(model: torch.nn.Module, cfg: ToyBackboneConfig, pretraining: bool,
                    heads: dict[str, torch.nn.Module | None]) -> Stage:
    """The optimizer and schedule of a stage. Image pre-training: the image tower and the tag head,
    constant lr. Contrastive stage: everything but the (locked) image tower, ``warmup_steps`` of
    linear warm-up, then a cosine over the rest of ``steps``. CLIP's AdamW either way (decay on
    matrices; none on gains, biases, embeddings and the logit scale: the engine's one rule)."""
    if pretraining:
        named = list(model.visual.named_parameters(prefix="visual"))
        named += list(heads["tag_head"].named_parameters(prefix="tag_head"))
    else:
        named = [(n, p) for n, p in model.named_parameters() if not n.startswith("visual.")]
    optim = build_adamw(named, cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98), eps=1e-6,
                        fused=cfg.fused_adamw)
    if pretraining:
        return optim, build_lr_scheduler(optim, 0, cfg.pretrain_steps, "constant")
    return optim, build_lr_scheduler(optim, cfg.warmup_steps, cfg.steps, "cosine")


def _pretrain_loss(model: torch.nn.Module, tag_head: torch.nn.Module, cfg: ToyBackboneConfig, step: int,
                   scenes: list[Scene], images: np.ndarray, rng: random.Random) -> torch.Tensor:
    """Binary cross-entropy of the tag head on a batch of random web images, over the tags of
    this step (``pretrain_first_tags`` during the first ``pretrain_first_steps``)."""
    idx = rng.sample(range(len(scenes)), min(cfg.batch_size, len(scenes)))
    logits = tag_head(model.encode_image(images_to_tensor(images[idx])))  # unnormalised: (B, classes)
    target = attribute_targets([scenes[i] for i in idx], cfg.pretrain_tags)
    tags = cfg.pretrain_first_tags if step < cfg.pretrain_first_steps else cfg.pretrain_tags
    columns = tag_columns(cfg.pretrain_tags)
    keep = torch.cat([torch.arange(columns[t].start, columns[t].stop) for t in tags])
    return torch.nn.functional.binary_cross_entropy_with_logits(logits[:, keep], target[:, keep])


def _enter_contrastive_stage(model: torch.nn.Module, pool: np.ndarray) -> torch.Tensor:
    """Put the model in training mode for the contrastive stage with the image tower locked (eval
    mode: its BatchNorm statistics stay); returns the (N, D) normalised embeddings of the whole
    training pool, computed once."""
    model.visual.requires_grad_(False)
    locked = encode_toy_images(model, pool)  # eval mode
    model.train()
    model.visual.eval()
    return locked


def _trained_modules(model: torch.nn.Module, heads: dict[str, torch.nn.Module | None]) -> dict[str, torch.nn.Module]:
    return {"model": model, **{name: head for name, head in heads.items() if head is not None}}


def train_toy_clip(cfg: ToyBackboneConfig, progress: bool = True, state_path: Path | None = None,
                   save_every: int = 100) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train the toy CLIP from scratch: the image pre-training (``pretrain_steps``), then ``steps`` of
    open_clip's ClipLoss with the image tower locked. Returns (model, log).

    With ``state_path`` (a ``.safetensors`` file), the training state is saved every ``save_every``
    steps, and a run that finds one continues from it (same batches, same captions, same weights
    bit for bit) instead of restarting. A damaged state file is a
    :class:`~demind.trainkit.StateFileError` (a ``DemindError``) naming it, raised before any
    work; :func:`toyworld.clip_cache.ensure_toy_backbone` deletes it and trains again.
    """
    # read first: a damaged file fails in milliseconds, before the pools are rendered
    state = load_train_state(state_path) if state_path is not None and state_path.is_file() else None
    torch.manual_seed(cfg.seed)
    model, tokenizer, image_size = build_toy_model(cfg)
    scenes, images = render_pool("web", cfg.num_train_images, image_size, progress)
    n_groups = groups_per_batch(cfg)
    groups, group_images = (render_group_pool(cfg.num_group_scenes, cfg.group_edits, image_size, progress)
                            if n_groups else ([], None))
    pool = training_pool(images, group_images)
    width = model.text_projection.shape[1]
    # the tag head on the unnormalised image embedding (discarded after training): image embedding -> tag values
    heads = {"tag_head": (torch.nn.Linear(width, sum(len(TAG_VALUES[t]) for t in cfg.pretrain_tags))
                          if cfg.pretrain_steps else None)}
    rng = random.Random(derive_seed("toy-backbone", cfg.seed))
    first_step, losses, earlier = 0, {"clip": [], "tags": []}, 0.0
    if state is not None:
        first_step = state["step"]
    optim, sched = stage_optimizer(model, cfg, first_step < cfg.pretrain_steps, heads)
    if state is not None:
        extra = state["extra"]
        # a state saved on the last pre-training step holds that stage's optimizer; the contrastive
        # stage starts with a fresh one, as an uninterrupted run does
        same_stage = extra["pretraining"] == (first_step < cfg.pretrain_steps)
        restore_train_state(state, modules=_trained_modules(model, heads), optimizer=optim if same_stage else None,
                            scheduler=sched if same_stage else None)
        rng.setstate(extra["sampler"])
        losses, earlier = extra["losses"], extra["elapsed"]
        logger.info("toy CLIP: resuming from step %d (%s)", first_step, state_path)
    total = cfg.pretrain_steps + cfg.steps
    locked = _enter_contrastive_stage(model, pool) if first_step >= cfg.pretrain_steps else None
    if first_step < cfg.pretrain_steps:
        model.train()
    loss_fn = ClipLoss()
    start = time.perf_counter() - earlier
    bar = progress_bar(range(first_step, total), lines=False, desc="toy CLIP", unit="step", disable=not progress,
               initial=first_step, total=total)
    for step in bar:
        if step == cfg.pretrain_steps and step > first_step:  # image pre-training just ended
            optim, sched = stage_optimizer(model, cfg, False, heads)
            locked = _enter_contrastive_stage(model, pool)
        pretraining = step < cfg.pretrain_steps
        if pretraining:
            term, loss = "tags", _pretrain_loss(model, heads["tag_head"], cfg, step, scenes, images, rng)
        else:
            rows, texts, _ = draw_batch(cfg, scenes, groups, n_groups, rng)
            text_f = torch.nn.functional.normalize(encode_text_trimmed(model, tokenizer(texts)), dim=-1)
            term, loss = "clip", loss_fn(locked[torch.from_numpy(rows)], text_f, model.logit_scale.exp())
        check_finite_terms({term: loss}, step, where="toy CLIP")
        losses[term].append(loss.item())
        lr = sched.get_last_lr()[0]  # this step's
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        with torch.no_grad():  # as CLIP: cap the temperature at 100
            model.logit_scale.clamp_(0, math.log(100))
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == total:
            _log_step(cfg, step, losses, lr, model.logit_scale.exp().item(),
                      (step + 1) * cfg.batch_size / (time.perf_counter() - start))
        if state_path is not None and (step + 1) % save_every == 0 and step + 1 < total:
            save_train_state(state_path, step=step + 1, modules=_trained_modules(model, heads), optimizer=optim,
                             scheduler=sched, extra={"pretraining": pretraining, "sampler": rng.getstate(),
                                                     "losses": losses, "elapsed": time.perf_counter() - start})
    model.eval()
    log = {"train_seconds": round(time.perf_counter() - start, 1), "final_loss": float(np.mean(losses["clip"][-20:]))}
    if losses["tags"]:
        log["pretrain_final_loss"] = float(np.mean(losses["tags"][-20:]))
    return model, log


def _log_step(cfg: ToyBackboneConfig, step: int, losses: dict[str, list[float]], lr: float, scale: float,
              samples_per_second: float) -> None:
    """One readable line every ``log_every`` steps (the mean loss of the last ``log_every``), its
    step counted within the stage."""
    n = cfg.log_every
    speed = f"{samples_per_second:.1f} samples/s"
    if step < cfg.pretrain_steps:
        tags = cfg.pretrain_first_tags if step < cfg.pretrain_first_steps else cfg.pretrain_tags
        parts = [*term_parts({"tags": float(np.mean(losses["tags"][-n:]))}, ["tags"]), f"asked {', '.join(tags)}",
                 f"lr {lr:.2e}", speed]
        logger.info("%s", step_line(step + 1, cfg.pretrain_steps, parts, prefix="toy CLIP image pre-training "))
        return
    parts = [*term_parts({"clip": float(np.mean(losses["clip"][-n:]))}, ["clip"]), f"lr {lr:.2e}",
             f"scale {scale:.1f}", speed]
    logger.info("%s", step_line(step + 1 - cfg.pretrain_steps, cfg.steps, parts, prefix="toy CLIP "))
