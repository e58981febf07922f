"""The toy world's "web-trained CLIP": a small open_clip model trained from scratch.

``ensure_toy_backbone(cfg, cache_dir)`` trains once and caches the weights in a file
keyed by the model config, the training config and the world version; later calls reuse
it. The file is a plain open_clip state dict, so

    FrozenCLIP(BackboneConfig(name="configs/model/toy-clip.json", pretrained=str(path)))

(or ``open_clip.create_model(..., pretrained=path)``) loads it. The training text is the
web mixture of :func:`demind.toy.texts.web_text` (alt-texts, full descriptions and
edit-form phrasings, each true of its image) over scenes of the "web" seed stream; its
own text-to-image recall is measured on held-out "web_eval" scenes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from open_clip.loss import ClipLoss
from tqdm import tqdm

from demind.config import ConfigError, setting
from demind.backbone import quiet_random_init_notice, run_text_transformer
from demind.io import atomic_path, write_json_atomic

from .parallel import parallel_map
from .probes import PairScorer, pair_probe_cases, probe_ceiling, run_pair_probes
from .render import render_scene
from .texts import alt_text, article, full_description, web_text
from .world import (BACKGROUNDS, COLOURS, EDIT_KINDS, POSITIONS, SHAPES, SIZES, STYLES, THEME_BACKGROUNDS, WORLDS,
                    Scene, apply_edit, derive_seed, edit_is_possible, scene_from_seed, stream_seed, world_version)

logger = logging.getLogger(__name__)

# the scene's ground-truth tags a tag head can be trained on -> their values (the head's classes):
# object attributes (a scene sets the bit of every value its objects hold) and scene attributes
# (one bit). Used by the auxiliary loss and by the image tower's pre-training.
OBJECT_TAGS = {"shape": SHAPES, "colour": COLOURS, "size": SIZES, "position": POSITIONS}
SCENE_TAGS = {"background": BACKGROUNDS + THEME_BACKGROUNDS, "style": STYLES}
TAG_VALUES = {**OBJECT_TAGS, **SCENE_TAGS}


@dataclass
class ToyBackboneConfig:
    """Training recipe of the toy CLIP (defaults sized for the CPU quickstart)."""

    # The full-resolution convnet (demind/towers.py) with a 2-layer text tower, pre-trained on the
    # scene's tags and locked (pretrain_* and lock_image below): chosen on the pair probes (README,
    # "fifth recipe" and "sixth candidate"); the ModifiedResNet recipe is configs/model/toy-clip-rn-text2.json
    # with pretrain_steps=0, lock_image=false
    model_config: str = "configs/model/toy-clip-cnn-text2.json"
    seed: int = 0
    # 1,000 steps: 400 left the toy CLIP at held-out R@1 5 % (full descriptions), 1,000 gave 42 %.
    steps: int = setting(1000, ge=1)
    batch_size: int = setting(128, ge=2)  # contrastive: at least one negative
    lr: float = setting(1e-3, gt=0)
    weight_decay: float = setting(0.1, ge=0)
    warmup_steps: int = setting(100, ge=0)
    num_train_images: int = setting(8000, ge=1)   # rendered once; each step draws fresh texts for them
    # Hard-negative groups (issue 20, demind/toy/README.md "The toy CLIP, second recipe"): this share of
    # every batch is made of groups, each one scene photographed 1 + len(group_edits) times with the same
    # nuisances, every other member edited in one attribute, each captioned with its full description
    # (the only text that tells the members apart). 0 = random batches only.
    group_share: float = setting(0.5, ge=0, le=1)
    group_edits: tuple[str, ...] = setting(("shape", "size", "position"), choices=EDIT_KINDS)
    num_group_scenes: int = setting(2000, ge=1)  # groups rendered once, like the random pool
    # Auxiliary attribute loss (README, "fourth recipe"): a linear head on the image embedding
    # predicts which values of these object attributes the scene holds (multi-label BCE from the
    # scene's ground truth), weighted by aux_weight beside ClipLoss; the head is discarded after
    # training. () = ClipLoss only.
    aux_attributes: tuple[str, ...] = setting((), choices=tuple(TAG_VALUES))
    aux_weight: float = setting(1.0, ge=0)
    # Image-tower pre-training (README, "fifth recipe"): before the contrastive `steps`, `pretrain_steps`
    # steps train the image tower alone, with a linear tag head (discarded), to predict the scene's
    # ground-truth tags: `pretrain_first_tags` only for the first `pretrain_first_steps` steps (shape
    # first: asked for every tag from the start, the easy ones starve it), then `pretrain_tags`. Batches
    # of random web images, constant lr. 0 = none.
    pretrain_steps: int = setting(1000, ge=0)
    pretrain_tags: tuple[str, ...] = setting(("shape", "colour", "size", "background", "style"),
                                             choices=tuple(TAG_VALUES))
    pretrain_first_tags: tuple[str, ...] = setting(("shape",), choices=tuple(TAG_VALUES))
    pretrain_first_steps: int = setting(500, ge=0)
    # The all-tag phase (the pre-training steps after pretrain_first_steps) ends with a cosine decay of
    # the learning rate to 0 instead of staying constant; the shape phase stays constant. Off: measured
    # as the ninth candidate, it lowered the colour probe by 4-9 points (README, "ninth candidate").
    pretrain_anneal: bool = False
    # LiT (Zhai et al. 2022): the contrastive stage keeps the image tower as it is (embedding the
    # training images once) and trains the text tower and the logit scale only.
    lock_image: bool = True
    num_eval_scenes: int = setting(1000, ge=1)
    # pair probes (demind/toy/probes.py): evaluation only, so not part of the cache key
    num_pair_probe_scenes: int = setting(600, ge=1)
    fused_adamw: bool = True       # same update, one kernel (optimizer step 33 -> 7.6 ms: benchmarks/bench_toy.py)
    log_every: int = setting(50, ge=1)
    # the toy world its images and web texts come from (README "World v2"); in the cache key as
    # the world's version string. The quickstart sets it from its `world`.
    world: str = setting("v1", choices=WORLDS)

    def __post_init__(self) -> None:
        # cross-field rules (the per-field ones are checked by demind.config.validate)
        if not set(self.pretrain_first_tags) <= set(self.pretrain_tags):
            raise ConfigError(f"toy CLIP: pretrain_first_tags {list(self.pretrain_first_tags)} must be among "
                              f"pretrain_tags {list(self.pretrain_tags)} (they share one tag head)",
                              key="pretrain_first_tags")
        if self.pretrain_steps and self.pretrain_first_steps > self.pretrain_steps:
            raise ConfigError(f"toy CLIP: pretrain_first_steps ({self.pretrain_first_steps}) is more than "
                              f"pretrain_steps ({self.pretrain_steps})", key="pretrain_first_steps")
        if self.pretrain_steps and not self.pretrain_tags:
            raise ConfigError("toy CLIP: pretrain_steps > 0 needs at least one of pretrain_tags", key="pretrain_tags")
        if self.lock_image and self.aux_attributes:
            raise ConfigError("toy CLIP: aux_attributes trains the image tower, which lock_image freezes; "
                              "set aux_attributes=[] (pretrain_tags is the locked tower's tag training)",
                              key="aux_attributes")


def tag_columns(tags: tuple[str, ...]) -> dict[str, slice]:
    """tag -> its columns in :func:`attribute_targets` ``(scenes, tags)``."""
    columns, start = {}, 0
    for tag in tags:
        columns[tag] = slice(start, start + len(TAG_VALUES[tag]))
        start += len(TAG_VALUES[tag])
    return columns


def attribute_targets(scenes: list[Scene], attributes: tuple[str, ...]) -> torch.Tensor:
    """(B, sum of the attributes' value counts) 0/1: which values of each tag the scene holds. An
    object tag sets the bit of every value its objects hold (a scene with a red and a blue object
    has both colour bits set); a scene tag (background, style) sets one bit."""
    columns = tag_columns(attributes)
    target = torch.zeros(len(scenes), sum(len(TAG_VALUES[a]) for a in attributes))
    for i, scene in enumerate(scenes):
        for attribute in attributes:
            holders = scene.objects if attribute in OBJECT_TAGS else (scene,)
            for holder in holders:
                target[i, columns[attribute].start + TAG_VALUES[attribute].index(getattr(holder, attribute))] = 1
    return target


def _model_name(model_config: str | Path) -> str:
    """Register a model-config JSON with open_clip and return the name to create it by."""
    path = Path(model_config)
    if not path.is_file():
        raise FileNotFoundError(f"toy model config {path} does not exist (expected an open_clip model JSON)")
    open_clip.add_model_config(path)
    return path.stem


def cache_key(cfg: ToyBackboneConfig) -> str:
    """Hash of everything that determines the trained weights."""
    payload = {
        "model_config": json.loads(Path(cfg.model_config).read_text()),
        "train": {k: v for k, v in asdict(cfg).items()
                  if k not in ("model_config", "log_every", "num_pair_probe_scenes", "world")},
        "world": world_version(cfg.world),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_paths(cfg: ToyBackboneConfig, cache_dir: str | Path) -> tuple[Path, Path]:
    """(weights .pt, report .json) for this config in ``cache_dir``."""
    stem = f"{Path(cfg.model_config).stem}-{cache_key(cfg)}"
    return Path(cache_dir) / f"{stem}.pt", Path(cache_dir) / f"{stem}.json"


# --------------------------------------------------------------------------- data

def images_to_tensor(images: np.ndarray) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float, normalised as open_clip's preprocess does."""
    x = torch.from_numpy(np.array(images, dtype=np.uint8)).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def _render_chunk(job: tuple[str, int, int, int, str]) -> np.ndarray:
    """Images of scenes ``start..stop-1`` of a stream, (n, H, W, 3) uint8 (a worker's share)."""
    stream, start, stop, image_size, world = job
    return np.stack([render_scene(scene_from_seed(stream_seed(stream, i), world=world),
                                  derive_seed(stream, "nuisance", i), image_size).image for i in range(start, stop)])


def render_pool(stream: str, count: int, image_size: int, progress: bool = True,
                workers: int | None = None, chunk: int = 250, world: str = "v1") -> tuple[list[Scene], np.ndarray]:
    """Scenes ``0..count-1`` of a seed stream (of ``world``) and their images, (count, H, W, 3) uint8.

    Rendered in chunks over ``workers`` processes (default: every core) when there is more
    than one chunk; the images do not depend on how the work is split.
    """
    scenes = [scene_from_seed(stream_seed(stream, i), world=world) for i in range(count)]
    jobs = [(stream, start, min(start + chunk, count), image_size, world) for start in range(0, count, chunk)]
    parts = parallel_map(_render_chunk, jobs, workers if len(jobs) > 1 else 1, desc=f"render {stream}",
                         progress=progress, unit="chunk")
    return scenes, np.concatenate(list(parts))


def group_scenes(index: int, edits: tuple[str, ...], world: str = "v1") -> list[Scene]:
    """Group ``index``: a training scene of ``world``, then the scene with each edit of ``edits``
    applied (an impossible edit falls back to ``shape``, which every scene allows). Seeded by index."""
    base = scene_from_seed(derive_seed("toy-backbone-groups", index), world=world)
    rng = random.Random(derive_seed("toy-backbone-groups", "edits", index))
    return [base] + [apply_edit(base, kind if edit_is_possible(base, kind) else "shape", rng) for kind in edits]


def _render_group_chunk(job: tuple[int, int, tuple[str, ...], int, str]) -> np.ndarray:
    """Images of groups ``start..stop-1``, (n, 1 + len(edits), H, W, 3) uint8; one nuisance seed
    and per-part streams per group, so its members differ only where an edit shows."""
    start, stop, edits, image_size, world = job
    out = []
    for g in range(start, stop):
        seed = derive_seed("toy-backbone-groups", "nuisance", g)
        out.append(np.stack([render_scene(s, seed, image_size, per_part=True).image
                             for s in group_scenes(g, edits, world)]))
    return np.stack(out)


def render_group_pool(count: int, edits: tuple[str, ...], image_size: int, progress: bool = True,
                      world: str = "v1", chunk: int = 100) -> tuple[list[list[Scene]], np.ndarray]:
    """Groups ``0..count-1`` of ``world`` and their images, (count, 1 + len(edits), H, W, 3) uint8."""
    groups = [group_scenes(g, edits, world) for g in range(count)]
    jobs = [(start, min(start + chunk, count), tuple(edits), image_size, world) for start in range(0, count, chunk)]
    parts = parallel_map(_render_group_chunk, jobs, None if len(jobs) > 1 else 1, desc="render groups",
                         progress=progress, unit="chunk")
    return groups, np.concatenate(list(parts))


def groups_per_batch(cfg: "ToyBackboneConfig") -> int:
    """How many whole groups fill ``group_share`` of a batch (at least one random pair stays)."""
    size = 1 + len(cfg.group_edits)
    return min(int(round(cfg.group_share * cfg.batch_size / size)), (cfg.batch_size - 1) // size)


# ----------------------------------------------------------------------- training

def encode_text_trimmed(model: torch.nn.Module, tokens: torch.Tensor, chunks: int = 2) -> torch.Tensor:
    """``model.encode_text(tokens)`` (B, D), computed without most of the padding.

    The texts run in ``chunks`` length groups, each cut after its own longest text
    (:func:`demind.backbone.run_text_transformer`, always split: the toy world's mix of
    short alt-texts and long descriptions always gains). Same values as ``encode_text``
    (float rounding aside) at about half the cost (measured: 0.4-0.8 s vs 1.0-2.1 s
    forward+backward for 128 texts).
    """
    eot = tokens.argmax(dim=-1)                      # open_clip pools at argmax: EOT has the top id
    x = run_text_transformer(model, model.token_embedding(tokens), eot, chunks, min_saving=0.0)
    return x[torch.arange(x.shape[0]), eot] @ model.text_projection


def draw_batch(cfg: ToyBackboneConfig, scenes: list[Scene], groups: list[list[Scene]], n_groups: int,
               rng: random.Random) -> tuple[np.ndarray, list[str], list[Scene]]:
    """One training batch: ``n_groups`` whole hard-negative groups (full descriptions), the
    rest random web images with web texts; a fresh caption per visit.

    Returns (B,) rows of the training pool (:func:`training_pool`: the ``len(scenes)`` web images,
    then each group's members in order), the B texts and the B scenes they show."""
    idx = rng.sample(range(len(scenes)), cfg.batch_size - n_groups * (1 + len(cfg.group_edits)))
    texts = [web_text(scenes[i], rng, cfg.world) for i in idx]  # a fresh caption per visit
    shown = [scenes[i] for i in idx]
    rows = list(idx)
    if n_groups:
        size = 1 + len(cfg.group_edits)
        chosen = rng.sample(range(len(groups)), n_groups)
        texts += [full_description(scene, rng) for g in chosen for scene in groups[g]]
        shown += [scene for g in chosen for scene in groups[g]]
        rows += [len(scenes) + g * size + m for g in chosen for m in range(size)]
    return np.array(rows), texts, shown


def training_pool(images: np.ndarray, group_images: np.ndarray | None) -> np.ndarray:
    """(N + G * members, H, W, 3) uint8: the web images, then every group's members in order (the
    rows :func:`draw_batch` draws)."""
    if group_images is None:
        return images
    return np.concatenate([images, group_images.reshape(-1, *group_images.shape[2:])])


def _lr_at(step: int, cfg: ToyBackboneConfig) -> float:
    """The learning rate of global step ``step``: constant during image pre-training (with
    ``pretrain_anneal``, its all-tag phase decays to 0 on a half cosine), then the contrastive
    stage's warm-up and cosine decay."""
    if step < cfg.pretrain_steps:
        if not cfg.pretrain_anneal or step < cfg.pretrain_first_steps:
            return cfg.lr
        phase = cfg.pretrain_steps - cfg.pretrain_first_steps  # the all-tag phase, annealed to 0 at its end
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - cfg.pretrain_first_steps) / phase))
    step -= cfg.pretrain_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def build_toy_model(cfg: ToyBackboneConfig) -> tuple[torch.nn.Module, Any, int]:
    """(model, tokenizer, image size) for the config, randomly initialised."""
    name = _model_name(cfg.model_config)
    with quiet_random_init_notice():  # a random start is what is asked for: no warning
        model = open_clip.create_model(name, pretrained=None)
    return model, open_clip.get_tokenizer(name), _image_side(model)


def _image_side(model: torch.nn.Module) -> int:
    size = model.visual.image_size  # (H, W) for a ViT, an int for open_clip's ModifiedResNet
    return size[0] if isinstance(size, (tuple, list)) else int(size)


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
    """Image pre-training: the image tower and the tag head. Contrastive stage: the whole model
    and the auxiliary head, or, with ``lock_image``, everything but the image tower."""
    if pretraining:
        named = list(model.visual.named_parameters(prefix="visual"))
        named += list(heads["tag_head"].named_parameters(prefix="tag_head"))
    else:
        named = [(n, p) for n, p in model.named_parameters() if not (cfg.lock_image and n.startswith("visual."))]
        if heads["aux_head"] is not None:
            named += list(heads["aux_head"].named_parameters(prefix="aux_head"))
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


def _enter_contrastive_stage(model: torch.nn.Module, cfg: ToyBackboneConfig, pool: np.ndarray
                             ) -> torch.Tensor | None:
    """Put the model in training mode for the contrastive stage. With ``lock_image``: freeze the
    image tower (eval mode: its BatchNorm statistics stay) and return the (N, D) normalised
    embeddings of the whole training pool, computed once; otherwise None."""
    if not cfg.lock_image:
        model.train()
        return None
    model.visual.requires_grad_(False)
    locked = encode_toy_images(model, pool)  # eval mode
    model.train()
    model.visual.eval()
    return locked


def train_toy_clip(cfg: ToyBackboneConfig, progress: bool = True, state_path: Path | None = None,
                   save_every: int = 100) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train the toy CLIP from scratch: the optional image pre-training (``pretrain_steps``), then
    ``steps`` of open_clip's ClipLoss. Returns (model, log).

    With ``state_path``, the training state is saved every ``save_every`` steps, and a run
    that finds one continues from it (same batches, same captions) instead of restarting.
    """
    torch.manual_seed(cfg.seed)
    model, tokenizer, image_size = build_toy_model(cfg)
    scenes, images = render_pool("web", cfg.num_train_images, image_size, progress, world=cfg.world)
    n_groups = groups_per_batch(cfg)
    groups, group_images = (render_group_pool(cfg.num_group_scenes, cfg.group_edits, image_size, progress, cfg.world)
                            if n_groups else ([], None))
    pool = training_pool(images, group_images)
    width = model.text_projection.shape[1]
    # tag heads on the unnormalised image embedding (discarded after training): image embedding -> tag values
    aux_classes = sum(len(TAG_VALUES[a]) for a in cfg.aux_attributes)
    heads = {"aux_head": torch.nn.Linear(width, aux_classes) if aux_classes else None,
             "tag_head": (torch.nn.Linear(width, sum(len(TAG_VALUES[t]) for t in cfg.pretrain_tags))
                          if cfg.pretrain_steps else None)}
    rng = random.Random(derive_seed("toy-backbone", cfg.seed))
    first_step, losses, earlier = 0, {"clip": [], "aux": [], "tags": []}, 0.0
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
    locked = _enter_contrastive_stage(model, cfg, pool) if first_step >= cfg.pretrain_steps else None
    if first_step < cfg.pretrain_steps:
        model.train()
    loss_fn = ClipLoss()
    start = time.perf_counter() - earlier
    bar = tqdm(range(first_step, total), desc="toy CLIP", unit="step", disable=not progress,
               initial=first_step, total=total)
    for step in bar:
        if step == cfg.pretrain_steps and step > first_step:  # image pre-training just ended
            optim = _stage_optimizer(model, cfg, False, heads)
            locked = _enter_contrastive_stage(model, cfg, pool)
        for group in optim.param_groups:
            group["lr"] = _lr_at(step, cfg)
        if step < cfg.pretrain_steps:
            loss = _pretrain_loss(model, heads["tag_head"], cfg, step, scenes, images, rng)
            losses["tags"].append(loss.item())
        else:
            rows, texts, shown = draw_batch(cfg, scenes, groups, n_groups, rng)
            text_f = torch.nn.functional.normalize(encode_text_trimmed(model, tokenizer(texts)), dim=-1)
            if locked is not None:
                image_raw, image_f = None, locked[torch.from_numpy(rows)]
            else:
                image_raw = model.encode_image(images_to_tensor(pool[rows]))
                image_f = torch.nn.functional.normalize(image_raw, dim=-1)
            loss = clip_loss = loss_fn(image_f, text_f, model.logit_scale.exp())
            losses["clip"].append(clip_loss.item())  # ClipLoss alone: comparable across recipes
            if heads["aux_head"] is not None:
                aux = torch.nn.functional.binary_cross_entropy_with_logits(
                    heads["aux_head"](image_raw), attribute_targets(shown, cfg.aux_attributes))
                losses["aux"].append(aux.item())
                loss = loss + cfg.aux_weight * aux
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
    aux_note = f" (aux {np.mean(losses['aux'][-n:]):.4f})" if losses["aux"] else ""
    logger.info("toy CLIP step %d/%d loss %.4f%s lr %.2e scale %.1f %.1f samples/s", step + 1 - cfg.pretrain_steps,
                cfg.steps, float(np.mean(losses["clip"][-n:])), aux_note, _lr_at(step, cfg), scale,
                samples_per_second)


# ---------------------------------------------------------------------- evaluation

@torch.no_grad()
def encode_toy_images(model: torch.nn.Module, images: np.ndarray, batch: int = 250) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, D) L2-normalised image embeddings."""
    model.eval()
    return torch.cat([model.encode_image(images_to_tensor(images[i:i + batch]), normalize=True)
                      for i in range(0, len(images), batch)])


@torch.no_grad()
def text_to_image_recall(model: torch.nn.Module, tokenizer: Any, images: np.ndarray | torch.Tensor, texts: list[str],
                         ks: tuple[int, ...] = (1, 5, 10), batch: int = 250) -> dict[str, float]:
    """Text i should retrieve image i among all images. Returns {"R@k": fraction}.

    ``images``: (N, H, W, 3) uint8, or their (N, D) embeddings from :func:`encode_toy_images`
    (several text sets against one image set encode the images once)."""
    model.eval()
    img = images if isinstance(images, torch.Tensor) else encode_toy_images(model, images, batch)
    txt = torch.cat([model.encode_text(tokenizer(texts[i:i + batch]), normalize=True)
                     for i in range(0, len(texts), batch)])
    sims = txt @ img.T                                   # (N texts, N images)
    correct = sims.diagonal().unsqueeze(1)
    rank = (sims > correct).sum(dim=1)                  # 0 = retrieved first
    return {f"R@{k}": float((rank < k).float().mean()) for k in ks}


def probe_text(scene: Scene, attribute: str) -> str:
    """A text naming one attribute of a scene only: what the backbone can see of it.

    ``shape``: "a photo of a heart and a star"; ``colour``: "a photo of a red object and a
    blue object"; ``background``: "a photo on grass"; ``position``: "a photo of an object
    at the top left and ..." (the style word replaces "photo").
    """
    head = f"{article(scene.style)} {scene.style}"
    if attribute == "background":
        return f"{head} on {scene.background}"
    phrase = {"shape": lambda o: f"a {o.shape}", "colour": lambda o: f"a {o.colour} object",
              "position": lambda o: f"an object at the {o.position}"}[attribute]
    return f"{head} of " + " and ".join(phrase(o) for o in scene.objects)


PROBED_ATTRIBUTES = ("shape", "colour", "position", "background")


def evaluate_toy_clip(model: torch.nn.Module, tokenizer: Any, image_size: int, num_scenes: int,
                      progress: bool = True, world: str = "v1") -> dict[str, dict[str, float]]:
    """Text-to-image recall on held-out scenes (of ``world``): full descriptions, alt-texts, and
    texts that name one attribute only (``probe:shape`` ...), which show what the backbone sees."""
    scenes, images = render_pool("web_eval", num_scenes, image_size, progress, world=world)
    images = encode_toy_images(model, images)  # one image pass for all six text sets
    rng = random.Random(derive_seed("web_eval", "texts"))
    recall = {
        "full_description": text_to_image_recall(model, tokenizer, images, [full_description(s, rng) for s in scenes]),
        "alt_text": text_to_image_recall(model, tokenizer, images, [alt_text(s, rng) for s in scenes]),
    }
    for attribute in PROBED_ATTRIBUTES:
        recall[f"probe:{attribute}"] = text_to_image_recall(model, tokenizer, images,
                                                            [probe_text(s, attribute) for s in scenes])
    return recall


def clip_pair_scorer(model: torch.nn.Module, tokenizer, batch: int = 250) -> PairScorer:
    """The toy CLIP's cosine similarity of image i and text i, (N,)."""
    encoded: dict[tuple[str, ...], torch.Tensor] = {}  # every attribute scores the same descriptions

    @torch.no_grad()
    def score(images: np.ndarray, texts: list[str]) -> torch.Tensor:
        img = encode_toy_images(model, images, batch)
        key = tuple(texts)
        if key not in encoded:
            encoded.clear()
            encoded[key] = torch.cat([model.encode_text(tokenizer(texts[i:i + batch]), normalize=True)
                                      for i in range(0, len(texts), batch)])
        return (img * encoded[key]).sum(dim=-1)

    return score


def probe_ceilings(num_scenes: int, k: int = 10, world: str = "v1") -> dict[str, float]:
    """``probe:<attribute>`` -> R@k (fraction) of a perfect model on the held-out probe texts of
    :func:`evaluate_toy_clip` (their ambiguity caps it: :func:`demind.toy.probes.probe_ceiling`)."""
    scenes = [scene_from_seed(stream_seed("web_eval", i), world=world) for i in range(num_scenes)]
    return {f"probe:{a}": round(probe_ceiling(scenes, a, k), 4) for a in PROBED_ATTRIBUTES}


def pair_probes(model: torch.nn.Module, tokenizer: Any, image_size: int, num_scenes: int,
                world: str = "v1") -> dict[str, float]:
    """attribute -> pair-probe accuracy in % (chance 50) on ``num_scenes`` held-out scenes of ``world``."""
    return run_pair_probes(clip_pair_scorer(model, tokenizer), pair_probe_cases(num_scenes, world=world), image_size)


def _add_probe_reports(report: dict[str, Any], model: torch.nn.Module, tokenizer: Any, cfg: ToyBackboneConfig
                       ) -> dict[str, Any]:
    """The report plus the pair probes and the R@10 probe ceilings (backfilled into older reports)."""
    report = dict(report)
    report["pair_probes"] = pair_probes(model, tokenizer, _image_side(model), cfg.num_pair_probe_scenes, cfg.world)
    report["pair_probe_scenes"] = cfg.num_pair_probe_scenes
    report["heldout_probe_ceiling_R@10"] = probe_ceilings(cfg.num_eval_scenes, world=cfg.world)
    logger.info("toy CLIP pair probes (%%, chance 50): %s", json.dumps(report["pair_probes"]))
    return report


def format_backbone_report(report: dict[str, Any]) -> str:
    """The pair probes (main table) and the held-out R@K recall with each probe's ceiling."""
    lines = []
    if "pair_probes" in report:
        lines.append(f"toy CLIP pair probes ({report.get('pair_probe_scenes', '?')} held-out scenes; % of scenes "
                     "whose own image beats the one-attribute edit against its description; chance 50):")
        lines.append("  " + "  ".join(f"{a} {v:.1f}" for a, v in report["pair_probes"].items()))
    ceilings = report.get("heldout_probe_ceiling_R@10", {})
    lines.append("toy CLIP held-out text->image recall (R@1 / R@5 / R@10, %; probe = a text naming one attribute; "
                 "ceiling = R@10 of a perfect model):")
    for texts, recall in report["heldout_text_to_image"].items():
        ceiling = f"   (ceiling {100 * ceilings[texts]:.1f})" if texts in ceilings else ""
        lines.append(f"  {texts:<17} " + " / ".join(f"{100 * v:.1f}" for v in recall.values()) + ceiling)
    return "\n".join(lines)


# -------------------------------------------------------------------------- cache

def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Plain open_clip state dict, written atomically."""
    with atomic_path(path) as tmp:
        torch.save(model.state_dict(), tmp)


def ensure_toy_backbone(cfg: ToyBackboneConfig | None = None, cache_dir: str | Path = "cache/toy",
                        progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Path of the trained toy CLIP weights (training it if absent) and its report.

    The report (same stem, ``.json``) holds the configs, training time and held-out
    text-to-image recall; it is written after the weights, so a report means done.
    """
    cfg = cfg or ToyBackboneConfig()
    weights, report_path = cached_paths(cfg, cache_dir)
    if weights.is_file() and report_path.is_file():
        logger.info("reusing toy CLIP %s", weights)
        report = json.loads(report_path.read_text())
        if report.get("pair_probe_scenes") != cfg.num_pair_probe_scenes:  # an older report, or another count
            model, tokenizer, _ = build_toy_model(cfg)
            model.load_state_dict(torch.load(weights, weights_only=True))
            report = _add_probe_reports(report, model.eval(), tokenizer, cfg)
            write_json_atomic(report_path, report, indent=2)
        return weights, report
    logger.info("training toy CLIP (%s: %d image pre-training steps, then %d contrastive steps%s, batch %d) -> %s",
                cfg.model_config, cfg.pretrain_steps, cfg.steps, " with the image tower locked" if cfg.lock_image
                else "", cfg.batch_size, weights)
    state_path = weights.with_name(weights.stem + ".state.pt")  # mid-training state: a rerun resumes
    weights.parent.mkdir(parents=True, exist_ok=True)
    model, log = train_toy_clip(cfg, progress, state_path)
    save_weights(model, weights)
    state_path.unlink(missing_ok=True)
    tokenizer = open_clip.get_tokenizer(_model_name(cfg.model_config))
    recall = evaluate_toy_clip(model, tokenizer, _image_side(model), cfg.num_eval_scenes, progress, cfg.world)
    report = {"weights": str(weights), "cache_key": cache_key(cfg), "world_version": world_version(cfg.world),
              "config": json.loads(json.dumps(asdict(cfg))),  # as read back: tuples become lists
              "model_config": json.loads(Path(cfg.model_config).read_text()),
              **log, "heldout_text_to_image": recall}
    report = _add_probe_reports(report, model, tokenizer, cfg)
    write_json_atomic(report_path, report, indent=2)
    logger.info("toy CLIP held-out text->image recall: %s", json.dumps(recall))
    return weights, report
