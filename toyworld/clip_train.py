"""Training the toy CLIP from scratch: image-tower pre-training on tags, then ClipLoss with the tower locked.

Its own AdamW, schedule and resume state live here, in one module, so that moving it onto the
shared training engine (``demind.training``) is a local change.
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
from tqdm import tqdm

from demind.io import atomic_path

from .clip import (TAG_VALUES, ToyBackboneConfig, attribute_targets, build_toy_model, encode_text_trimmed,
                   encode_toy_images, images_to_tensor, tag_columns)
from .clip_data import draw_batch, groups_per_batch, render_group_pool, render_pool, training_pool
from .world import Scene, derive_seed

logger = logging.getLogger(__name__)


def _lr_at(step: int, cfg: ToyBackboneConfig) -> float:
    """The learning rate of global step ``step``: constant during image pre-training, then the
    contrastive stage's warm-up and cosine decay."""
    if step < cfg.pretrain_steps:
        return cfg.lr
    step -= cfg.pretrain_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def save_train_state(path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int,
                     rng: random.Random, losses: dict[str, list[float]], elapsed: float,
                     heads: dict[str, torch.nn.Module | None], optim_pretraining: bool = False) -> None:
    """Everything a killed run needs to continue exactly: weights (and the tag heads'), the
    optimizer and which stage it belongs to (``optim_pretraining``), the next step, the sampling RNG (which batches and captions
    come next), recent losses. Atomic."""
    with atomic_path(path) as tmp:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step,
                    "optim_pretraining": optim_pretraining,
                    "rng": rng.getstate(), "losses": losses, "elapsed": elapsed,
                    "heads": {name: head.state_dict() for name, head in heads.items() if head is not None}}, tmp)


def _adamw(named: list[tuple[str, torch.nn.Parameter]], cfg: ToyBackboneConfig) -> torch.optim.Optimizer:
    """CLIP's AdamW: weight decay on matrices, none on gains, biases, embeddings and the scale."""
    decay = [p for n, p in named if p.ndim >= 2 and "embedding" not in n]
    no_decay = [p for n, p in named if p.ndim < 2 or "embedding" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6,
                             fused=cfg.fused_adamw)


def _stage_optimizer(model: torch.nn.Module, cfg: ToyBackboneConfig, pretraining: bool,
                     heads: dict[str, torch.nn.Module | None]) -> torch.optim.Optimizer:
    """Image pre-training: the image tower and the tag head. Contrastive stage: everything but the
    (locked) image tower."""
    if pretraining:
        named = list(model.visual.named_parameters(prefix="visual"))
        named += list(heads["tag_head"].named_parameters(prefix="tag_head"))
    else:
        named = [(n, p) for n, p in model.named_parameters() if not n.startswith("visual.")]
    return _adamw(named, cfg)


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


def train_toy_clip(cfg: ToyBackboneConfig, progress: bool = True, state_path: Path | None = None,
                   save_every: int = 100) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train the toy CLIP from scratch: the image pre-training (``pretrain_steps``), then ``steps`` of
    open_clip's ClipLoss with the image tower locked. Returns (model, log).

    With ``state_path``, the training state is saved every ``save_every`` steps, and a run
    that finds one continues from it (same batches, same captions) instead of restarting.
    """
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
    state = torch.load(state_path, weights_only=False) if state_path is not None and state_path.is_file() else None
    if state is not None:  # our own file: holds the RNG tuple
        model.load_state_dict(state["model"])
        for name, head_state in state["heads"].items():
            heads[name].load_state_dict(head_state)
        rng.setstate(state["rng"])
        first_step, losses, earlier = state["step"], state["losses"], state["elapsed"]
        logger.info("toy CLIP: resuming from step %d (%s)", first_step, state_path)
    total = cfg.pretrain_steps + cfg.steps
    optim = _stage_optimizer(model, cfg, first_step < cfg.pretrain_steps, heads)
    if state is not None and state["optim_pretraining"] == (first_step < cfg.pretrain_steps):
        # (a state saved on the last pre-training step holds that stage's optimizer; the contrastive
        # stage starts with a fresh one, as an uninterrupted run does)
        optim.load_state_dict(state["optim"])
    locked = _enter_contrastive_stage(model, pool) if first_step >= cfg.pretrain_steps else None
    if first_step < cfg.pretrain_steps:
        model.train()
    loss_fn = ClipLoss()
    start = time.perf_counter() - earlier
    bar = tqdm(range(first_step, total), desc="toy CLIP", unit="step", disable=not progress,
               initial=first_step, total=total)
    for step in bar:
        if step == cfg.pretrain_steps and step > first_step:  # image pre-training just ended
            optim = _stage_optimizer(model, cfg, False, heads)
            locked = _enter_contrastive_stage(model, pool)
        for group in optim.param_groups:
            group["lr"] = _lr_at(step, cfg)
        if step < cfg.pretrain_steps:
            loss = _pretrain_loss(model, heads["tag_head"], cfg, step, scenes, images, rng)
            losses["tags"].append(loss.item())
        else:
            rows, texts, _ = draw_batch(cfg, scenes, groups, n_groups, rng)
            text_f = torch.nn.functional.normalize(encode_text_trimmed(model, tokenizer(texts)), dim=-1)
            loss = loss_fn(locked[torch.from_numpy(rows)], text_f, model.logit_scale.exp())
            losses["clip"].append(loss.item())
        if not torch.isfinite(loss):
            raise FloatingPointError(f"toy CLIP loss is {loss.item()} at step {step}")
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        with torch.no_grad():  # as CLIP: cap the temperature at 100
            model.logit_scale.clamp_(0, math.log(100))
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == total:
            _log_step(cfg, step, losses, model.logit_scale.exp().item(), (step + 1) * cfg.batch_size
                      / (time.perf_counter() - start))
        if state_path is not None and (step + 1) % save_every == 0 and step + 1 < total:
            save_train_state(state_path, model, optim, step + 1, rng, losses, time.perf_counter() - start, heads,
                             optim_pretraining=step < cfg.pretrain_steps)
    model.eval()
    log = {"train_seconds": round(time.perf_counter() - start, 1), "final_loss": float(np.mean(losses["clip"][-20:]))}
    if losses["tags"]:
        log["pretrain_final_loss"] = float(np.mean(losses["tags"][-20:]))
    return model, log


def _log_step(cfg: ToyBackboneConfig, step: int, losses: dict[str, list[float]], scale: float,
              samples_per_second: float) -> None:
    """One readable line every ``log_every`` steps (the mean loss of the last ``log_every``)."""
    n = cfg.log_every
    if step < cfg.pretrain_steps:
        tags = cfg.pretrain_first_tags if step < cfg.pretrain_first_steps else cfg.pretrain_tags
        logger.info("toy CLIP image pre-training step %d/%d tag loss %.4f (%s) %.1f samples/s", step + 1,
                    cfg.pretrain_steps, float(np.mean(losses["tags"][-n:])), ", ".join(tags), samples_per_second)
        return
    logger.info("toy CLIP step %d/%d loss %.4f lr %.2e scale %.1f %.1f samples/s", step + 1 - cfg.pretrain_steps,
                cfg.steps, float(np.mean(losses["clip"][-n:])), _lr_at(step, cfg), scale,
                samples_per_second)
