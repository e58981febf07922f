"""Training De-MINDS on intent shards with Accelerate (one process, DDP or DeepSpeed).

    cfg = load_config(TrainConfig, "configs/train/smoke.yaml", ["optim.max_steps=50"])
    checkpoint = train(cfg)          # -> <run.output_dir>/demind.safetensors

The run folder ``run.output_dir`` holds ``config.yaml`` (resolved config),
``checkpoints/step_XXXXXXXX/`` (Accelerate state: model, optimizer, scheduler, scaler,
RNG, plus ``trainer_state.json`` and ``config.yaml``; saved to ``*.tmp`` then renamed),
``metrics.jsonl`` (one JSON line per log step), ``logs/`` (trackers) and, at the end,
``demind.safetensors`` in the core checkpoint format.  Rerunning the same command resumes
from the newest checkpoint and continues the data stream where it stopped.

Batch sizes: ``optim.global_batch_size`` samples per optimizer step =
micro batch x processes x ``optim.grad_accum_steps``.  The contrastive negatives are
gathered over processes (all_gather with gradients), so each loss sees
micro batch x processes samples; accumulation steps do not share negatives.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from demind.backbone import BackboneConfig, FrozenCLIP, build_backbone
from demind.checkpoint import save_checkpoint
from demind.config import ConfigError, save_config, to_dict
from demind.data import DataConfig, StreamSpec, build_loader
from demind.shard_format import resolve_shards
from demind.features import FeatureCache, default_cache_dir
from demind.losses import Gather, demind_losses
from demind.model import DeMinds, ModelConfig, build_model
from demind.io import write_text_atomic

logger = logging.getLogger(__name__)

EXPORT_NAME = "demind.safetensors"
STATE_NAME = "trainer_state.json"
LOSS_TERMS = ("loss", "distil", "align")


class NonFiniteLossError(FloatingPointError):
    """A loss term became NaN or infinite; the run stops instead of training on garbage."""


class ResumeError(ValueError):
    """A run folder whose checkpoints cannot continue with this config."""


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (per optimizer step)."""

    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)  # open_clip's ViT defaults; the paper does not say
    eps: float = 1e-6
    warmup_steps: int = 10_000
    max_steps: int = 30_000
    schedule: str = "cosine"  # "cosine" | "constant" (after warm-up)
    min_lr_ratio: float = 0.0
    grad_clip: float | None = None  # max global grad norm; null = no clipping
    grad_accum_steps: int = 1
    global_batch_size: int = 1024


@dataclass
class LossConfig:
    distil: bool = True  # false: the "w/o distillation" ablation (L = L_align)


@dataclass
class RunConfig:
    output_dir: str = "runs/demind"
    seed: int = 0
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16"
    cpu: bool = False  # force CPU even when a GPU is visible
    log_every: int = 50
    save_every: int = 1000
    keep_checkpoints: int = 2
    resume: bool = True
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # used when installed
    progress: bool = True  # tqdm bar (the log line every log_every steps is printed either way)


@dataclass
class TrainConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    run: RunConfig = field(default_factory=RunConfig)


@dataclass
class TrainState:
    """What a checkpoint adds to Accelerate's state: progress and data-stream positions."""

    step: int = 0
    samples_seen: int = 0
    positions: dict[int, tuple[int, int]] = field(default_factory=dict)  # this process: worker -> (group, offset)
    counts: Counter = field(default_factory=Counter)  # skipped / patched samples, this process
    resumed_positions: list[dict[int, tuple[int, int]]] | None = None  # all processes, from the checkpoint


# --------------------------------------------------------------------------- setup


def setup(cfg: TrainConfig):
    """Create the Accelerator (precision, accumulation, trackers) and seed everything."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import ProjectConfiguration, set_seed

    run_dir = Path(cfg.run.output_dir)
    accelerator = Accelerator(
        mixed_precision=cfg.run.mixed_precision,
        gradient_accumulation_steps=cfg.optim.grad_accum_steps,
        cpu=cfg.run.cpu,
        log_with=available_trackers(cfg.run.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "logs")),
        # The ablations that bypass the gate leave it without a gradient.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=cfg.model.fusion != "gate")],
    )
    set_seed(cfg.run.seed)
    return accelerator


def available_trackers(names: list[str]) -> list[str]:
    """The requested trackers that are installed (tensorboard, wandb, ...)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    found = []
    for name in names:
        tracker = LOGGER_TYPE_TO_CLASS.get(name)
        if tracker is None:
            raise ConfigError(f"run.trackers: unknown tracker {name!r}; choose from {sorted(LOGGER_TYPE_TO_CLASS)}")
        if _tracker_installed(name):
            found.append(name)
        else:
            logger.warning("tracker %s is not installed; skipping it", name)
    return found


def _tracker_installed(name: str) -> bool:
    from accelerate.utils import imports

    check = getattr(imports, f"is_{name}_available", None)
    return bool(check and check())


def micro_batch_size(optim: OptimConfig, num_processes: int) -> int:
    """Per-process batch of one forward pass; the global batch must split evenly."""
    per_step = num_processes * optim.grad_accum_steps
    if optim.global_batch_size % per_step:
        raise ConfigError(
            f"optim.global_batch_size={optim.global_batch_size} does not split into {num_processes} processes "
            f"x {optim.grad_accum_steps} accumulation steps; make it a multiple of {per_step}"
        )
    return optim.global_batch_size // per_step


def build_modules(cfg: TrainConfig, device: torch.device) -> tuple[FrozenCLIP, DeMinds]:
    """The frozen backbone and the trainable De-MINDS model on ``device``.

    Seeded by run.seed first: a randomly initialised backbone (pretrained: null) then has
    the same weights as the one ``python -m demind.features`` cached features with.
    """
    torch.manual_seed(cfg.run.seed)
    backbone = build_backbone(cfg.backbone, device=device)
    model = build_model(cfg.model, backbone)
    return backbone, model


def build_optimizer(optim: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW; as in CLIP/open_clip, gains, biases, the gate and the temperature get no weight decay."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [dict(params=decay, weight_decay=optim.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


def lr_factor(step: int, optim: OptimConfig) -> float:
    """Multiplier of optim.lr at optimizer step ``step``: linear warm-up, then cosine or constant."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    if optim.schedule != "cosine":
        raise ConfigError(f"optim.schedule must be 'cosine' or 'constant', got {optim.schedule!r}")
    span = max(optim.max_steps - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optim: OptimConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim))


def find_feature_cache(data: DataConfig, shards: list[str], backbone: FrozenCLIP) -> FeatureCache | None:
    """The feature cache to train on, or None to decode images (see DataConfig.features)."""
    if data.features is None or str(data.features).lower() in ("none", "null", ""):
        return None
    if data.features == "auto":
        directory = default_cache_dir(shards, backbone.identity_str)
        if not directory.is_dir():
            return None
        return FeatureCache.find(directory, shards, backbone.identity, required=False)
    return FeatureCache.find(data.features, shards, backbone.identity, required=True)


def build_data(cfg: TrainConfig, accelerator, backbone: FrozenCLIP, state: TrainState):
    """Per-process DataLoader, positioned after the data a resumed run already consumed.

    Returns (loader, cache or None).
    """
    shards = resolve_shards(cfg.data.shards)
    cache = find_feature_cache(cfg.data, shards, backbone)
    rank, world = accelerator.process_index, accelerator.num_processes
    start = dict(state.resumed_positions[rank]) if state.resumed_positions is not None else {}
    # A stream that cannot continue exactly restarts on fresh seeds rather than repeating data.
    seed = cfg.run.seed if (start or state.step == 0) else cfg.run.seed + state.step
    spec = StreamSpec(shards=shards, batch_size=micro_batch_size(cfg.optim, world), seed=seed, rank=rank,
                      world_size=world, shuffle_buffer=cfg.data.shuffle_buffer,
                      shards_per_group=cfg.data.shards_per_group, resample=cfg.data.resample,
                      missing_text=cfg.data.missing_text, targets=cfg.data.targets, start=start)
    loader = build_loader(spec, cfg.data.num_workers, transform=None if cache else backbone.preprocess, cache=cache)
    return loader, cache


# --------------------------------------------------------------------------- one step


def make_gather(accelerator) -> Gather | None:
    """Gather (B, D) features from every process with gradients -> ((P*B, D), this process's offset)."""
    if accelerator.num_processes == 1:
        return None
    import warnings

    import torch.distributed.nn

    # all_gather with autograd is deprecated in favour of a private API; keep the public one.
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated")
    rank = accelerator.process_index

    def gather(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return torch.cat(torch.distributed.nn.all_gather(x.contiguous())), rank * x.shape[0]

    return gather


def batch_embeddings(batch: dict[str, Any], backbone: FrozenCLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """(image_emb, teacher_emb), both (B, D) raw: from the feature cache, or the frozen encoders."""
    if "image_emb" in batch:
        return batch["image_emb"].to(backbone.device), batch["teacher_emb"].to(backbone.device)
    return backbone.encode_image(batch["images"]), backbone.encode_text(batch["intents"]).pooled


def compute_losses(model: torch.nn.Module, batch: dict[str, Any], backbone: FrozenCLIP, *,
                   distil: bool = True, gather: Gather | None = None) -> dict[str, torch.Tensor]:
    """One forward pass on a batch from the data stream -> {"loss", "distil", "align"} scalars.

    ``model`` may be wrapped (DDP); the temperature is read from the unwrapped module.
    """
    image_emb, teacher_emb = batch_embeddings(batch, backbone)
    out = model(image_emb, batch["targets"])
    core = model.module if hasattr(model, "module") else model
    return demind_losses(out, teacher_emb, image_emb, core.temperature_scale(), distil=distil, gather=gather)


def check_finite(losses: dict[str, torch.Tensor], step: int, accelerator) -> None:
    """Stop every process when any process sees a NaN/inf loss term, naming the term."""
    flags = torch.stack([torch.isfinite(losses[t].detach()).float() for t in LOSS_TERMS])
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags.to(accelerator.device), reduction="sum") / accelerator.num_processes
    bad = [t for t, ok in zip(LOSS_TERMS, flags.tolist()) if ok < 1.0]
    if bad:
        values = {t: float(losses[t].detach()) for t in bad}
        raise NonFiniteLossError(
            f"non-finite loss at step {step}: {', '.join(f'{t}={v}' for t, v in values.items())} "
            f"(term{'s' if len(bad) > 1 else ''} {', '.join(bad)}); lower optim.lr, set optim.grad_clip, or check "
            f"the data; rerunning resumes from the last checkpoint"
        )


# --------------------------------------------------------------------------- checkpoints


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
    tmp = final.with_name(final.name + ".tmp")
    positions = gather_object([{int(w): list(p) for w, p in state.positions.items()}])
    counts = gather_object([dict(state.counts)])
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        total = Counter()
        for c in counts:
            total.update(c)
        trainer_state = dict(step=state.step, samples_seen=state.samples_seen, num_processes=accelerator.num_processes,
                             num_workers=cfg.data.num_workers, positions=positions, counts=dict(total))
        (tmp / STATE_NAME).write_text(json.dumps(trainer_state, indent=1))
        save_config(cfg, tmp / "config.yaml")
        if final.exists():  # the same step saved before (e.g. the final save after a resume)
            shutil.rmtree(final)
        tmp.replace(final)
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


# Backbone settings that change how fast, not what, the frozen CLIP computes: a run may
# resume with other values (and checkpoints written before a key existed still resume).
SPEED_ONLY_KEYS = frozenset({"backbone.text_buckets", "backbone.grad_checkpointing"})


def check_resumable(saved: dict[str, Any], cfg: TrainConfig, where: Path) -> None:
    """The backbone and model must match the checkpoint; other changes are only reported."""
    current = to_dict(cfg)
    for section in ("backbone", "model"):
        diff = [d for d in _diff(saved.get(section, {}), current[section], section)
                if d.split(" ")[0] not in SPEED_ONLY_KEYS]
        if diff:
            raise ResumeError(
                f"cannot resume from {where}: {', '.join(diff)} differ from the checkpoint's config; "
                f"use a new run.output_dir or set run.resume=false with an empty run folder"
            )
    other = [d for s in ("backbone", "data", "optim", "loss", "run") for d in _diff(saved.get(s, {}), current[s], s)
             if s != "backbone" or d.split(" ")[0] in SPEED_ONLY_KEYS]
    if other:
        logger.warning("resuming from %s with changed settings: %s", where, ", ".join(other))


def _diff(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in _diff(old.get(k), new.get(k), f"{prefix}.{k}")]
    return [] if old == new else [f"{prefix} ({old!r} -> {new!r})"]


def resume_state(accelerator, cfg: TrainConfig) -> TrainState:
    """Load the newest checkpoint of the run folder, or start fresh."""
    import yaml

    run_dir = Path(cfg.run.output_dir)
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return TrainState()
    if not cfg.run.resume:
        raise ResumeError(f"{run_dir} already holds checkpoints (newest {latest.name}) but run.resume=false; "
                          f"use a new run.output_dir or delete {checkpoint_root(run_dir)}")
    check_resumable(yaml.safe_load((latest / "config.yaml").read_text()), cfg, latest)
    accelerator.load_state(str(latest))
    saved = json.loads((latest / STATE_NAME).read_text())
    positions = [{int(w): tuple(p) for w, p in per_rank.items()} for per_rank in saved["positions"]]
    same_readers = len(positions) == accelerator.num_processes and saved.get("num_workers") == cfg.data.num_workers
    if not same_readers:
        logger.warning("checkpoint %s was written by %d processes x %s workers, this run has %d x %d: the data "
                       "streams restart on a new seed instead of continuing exactly", latest, len(positions),
                       saved.get("num_workers"), accelerator.num_processes, cfg.data.num_workers)
    state = TrainState(step=saved["step"], samples_seen=saved["samples_seen"],
                       resumed_positions=positions if same_readers else None)
    state.positions = dict(positions[accelerator.process_index]) if same_readers else {}
    if accelerator.is_main_process:
        state.counts.update(saved.get("counts", {}))
    logger.info("resumed from %s at step %d (%d samples seen)", latest, state.step, state.samples_seen)
    return state


# --------------------------------------------------------------------------- loop


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics lines logged after ``step`` by an interrupted run (they will be redone)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    write_text_atomic(path, "".join(line + "\n" for line in keep))


@dataclass
class LogWindow:
    """Loss sums and sample counts since the last log line."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSS_TERMS, 0.0))
    micro_steps: int = 0
    samples: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        for t in LOSS_TERMS:
            self.sums[t] += float(losses[t].detach())
        self.micro_steps += 1


def log_metrics(accelerator, cfg: TrainConfig, state: TrainState, window: LogWindow, model, scheduler,
                bar: tqdm) -> None:
    """One console line, a metrics.jsonl line and tracker values, averaged over processes."""
    local = torch.tensor([window.sums[t] / max(window.micro_steps, 1) for t in LOSS_TERMS], device=accelerator.device)
    means = accelerator.reduce(local, reduction="mean") if accelerator.num_processes > 1 else local
    core = accelerator.unwrap_model(model)
    elapsed = max(time.perf_counter() - window.start, 1e-9)
    metrics = {t: round(float(v), 6) for t, v in zip(LOSS_TERMS, means.tolist())}
    metrics.update(lr=scheduler.get_last_lr()[0], gate=round(float(torch.tanh(core.gate.detach())), 6),
                   samples_per_s=round(window.samples / elapsed, 2))
    accelerator.log(metrics, step=state.step)
    if accelerator.is_main_process:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(state.counts.items()))
        bar.write(f"step {state.step}/{cfg.optim.max_steps} | loss {metrics['loss']:.4f} | distil {metrics['distil']:.4f}"
                  f" | align {metrics['align']:.4f} | lr {metrics['lr']:.3g} | tanh(gate) {metrics['gate']:+.4f}"
                  f" | {metrics['samples_per_s']:.1f} samples/s" + (f" | {skipped}" if skipped else ""))
        with open(Path(cfg.run.output_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps(dict(step=state.step, samples_seen=state.samples_seen, **metrics,
                                    counts=dict(state.counts))) + "\n")


def train_one_step(cfg: TrainConfig, accelerator, model, optimizer, scheduler, batches, backbone: FrozenCLIP,
                   state: TrainState, window: LogWindow, gather: Gather | None) -> None:
    """One optimizer step over ``optim.grad_accum_steps`` micro-batches from ``batches``."""
    for _ in range(cfg.optim.grad_accum_steps):
        batch = next(batches)
        with accelerator.accumulate(model):
            with accelerator.autocast():
                losses = compute_losses(model, batch, backbone, distil=cfg.loss.distil, gather=gather)
            check_finite(losses, state.step, accelerator)
            accelerator.backward(losses["loss"])
            if accelerator.sync_gradients and cfg.optim.grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state.positions[batch["worker"]] = tuple(batch["position"])
        state.counts.update(batch["counts"])
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
    window = LogWindow()
    batches = iter(loader)
    with tqdm(total=cfg.optim.max_steps, initial=state.step, desc="train", unit="step",
              disable=not (accelerator.is_local_main_process and cfg.run.progress)) as bar:
        while state.step < cfg.optim.max_steps:
            train_one_step(cfg, accelerator, model, optimizer, scheduler, batches, backbone, state, window, gather)
            window.samples += cfg.optim.global_batch_size
            bar.update(1)
            if state.step % cfg.run.log_every == 0 or state.step == cfg.optim.max_steps:
                log_metrics(accelerator, cfg, state, window, model, scheduler, bar)
                window = LogWindow()
            if state.step % cfg.run.save_every == 0 or state.step == cfg.optim.max_steps:
                save_training_state(accelerator, cfg, state)


def describe_run(cfg: TrainConfig, accelerator, model: DeMinds, cache: FeatureCache | None, state: TrainState) -> None:
    """Derived quantities, printed once at start-up."""
    micro = micro_batch_size(cfg.optim, accelerator.num_processes)
    lines = [
        f"processes {accelerator.num_processes} ({accelerator.distributed_type}, {accelerator.device}), "
        f"mixed precision {accelerator.mixed_precision}",
        f"global batch {cfg.optim.global_batch_size} = micro batch {micro} x {accelerator.num_processes} processes "
        f"x {cfg.optim.grad_accum_steps} accumulation; contrastive batch {micro * accelerator.num_processes}",
        f"trainable parameters {model.num_trainable_parameters():,}; backbone {model.backbone.identity}",
        f"steps {state.step} -> {cfg.optim.max_steps} ({cfg.optim.max_steps * cfg.optim.global_batch_size:,} samples)",
        f"features: {'cache ' + str(cache.directory) if cache else 'decoding images (no feature cache)'}",
    ]
    for line in lines:
        accelerator.print(line)


def _tracker_config(cfg: TrainConfig) -> dict[str, Any]:
    """Flat scalar config for tracker hyper-parameter tables."""
    flat: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk(to_dict(cfg), "")
    return flat


def train(cfg: TrainConfig) -> Path:
    """Train (or resume) the run described by ``cfg``; returns the exported checkpoint path.

    Call it in every process (``accelerate launch``); only the main process writes files.
    """
    accelerator = setup(cfg)
    run_dir = Path(cfg.run.output_dir)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    backbone, model = build_modules(cfg, accelerator.device)
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.optim, optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    state = resume_state(accelerator, cfg)
    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")
        trim_metrics(run_dir, state.step)
    loader, cache = build_data(cfg, accelerator, backbone, state)
    describe_run(cfg, accelerator, accelerator.unwrap_model(model), cache, state)
    if available_trackers(cfg.run.trackers):
        accelerator.init_trackers("demind", config=_tracker_config(cfg))
    train_steps(cfg, accelerator, model, optimizer, scheduler, loader, backbone, state)
    export = run_dir / EXPORT_NAME
    if accelerator.is_main_process:
        save_checkpoint(export, accelerator.unwrap_model(model))
        accelerator.print(f"exported {export} (step {state.step}, {state.samples_seen:,} samples"
                          + (f"; {dict(state.counts)}" if state.counts else "") + ")")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return export


def load_train_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """TrainConfig from a YAML recipe plus dotted overrides (see demind.config.load_config)."""
    from demind.config import load_config

    return load_config(TrainConfig, path, overrides)


__all__ = ["TrainConfig", "OptimConfig", "LossConfig", "RunConfig", "DataConfig", "train", "load_train_config",
           "compute_losses", "make_gather", "NonFiniteLossError", "ResumeError"]
