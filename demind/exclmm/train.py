"""ExclMM training on frozen CLIP features: stage 1 (SAE, sparse space) then stage 2 (query encoder).

    from demind.config import load_config
    from demind.exclmm.train import ExclMMConfig, train_exclmm
    export = train_exclmm(load_config(ExclMMConfig, "configs/exclmm/toy.yaml", ["run.seed=1"]))

Phases, each resumable: ``sae`` (stage 1 step 1), ``space`` (step 3; step 2 is a fixed mean),
``query`` (stage 2). ``query.space=clip`` (the "without stage 1" ablation) skips the first two.
The shared trainer parts do the work (:mod:`demind.trainkit`: optimizer and schedule,
non-finite check, log line, state file). Every ``run.save_every`` steps and at the end of each
phase, ``<output_dir>/state.safetensors`` is written atomically (all modules, the current
optimizer and scheduler, RNG, phase, step, config: safetensors + JSON, no pickle); rerunning the
same command resumes from it. Batches are drawn from a generator seeded by (seed, phase, step),
so a resumed run draws the same batches and ends with the same weights, bit for bit, as an
uninterrupted one. With ``stop.window`` > 0 a phase stops once its loss has stopped falling
(:class:`Plateau`, the rule in :class:`~demind.exclmm.config.StopConfig`); the steps each phase
ran, and why it stopped, are written to ``<output_dir>/phases.json``; the model as stage 1 leaves
it (F_theta still the identity: the "stage 1 only" ablation) to ``stage1.safetensors``. CLIP features are computed once into ``<output_dir>/features.safetensors``
(:mod:`demind.exclmm.features`). One log line per ``run.log_every`` steps goes to the console
and ``<output_dir>/metrics.jsonl``. The export ``<output_dir>/exclmm.safetensors`` (weights +
config + backbone identity) is written last: its presence means done. A run folder holding the
pickles of earlier versions is refused with a message saying what to do (:mod:`demind.exclmm.run_upgrade`).
The files and folders a run reads and writes are checked before the backbone loads
(:func:`check_run_inputs`); every other key was checked when the config was loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from demind.backbone import FrozenCLIP, build_backbone
from demind.config import config_changes, save_config, with_defaults
from demind.config_checks import check_output_key
from demind.errors import InputError, MissingInputError
from demind.io import write_json_atomic
from demind.exclmm import losses as L
from demind.exclmm.config import ExclMMConfig
from demind.exclmm.features import FEATURES_NAME, prepare_features
from demind.exclmm.model import ExclMM
from demind.exclmm.run_upgrade import refuse_pickled_files
from demind.seeding import derive_seed
from demind.trainkit import (LogWindow, append_metrics, build_adamw, build_lr_scheduler, check_finite_terms,
                             load_train_state, restore_train_state, save_train_state, step_line, term_parts,
                             trim_metrics)

log = logging.getLogger(__name__)

__all__ = ["ExclMMConfig", "train_exclmm", "FEATURES_NAME", "STATE_NAME", "EXPORT_NAME", "PHASES", "PHASES_NAME",
           "STAGE1_NAME", "Plateau", "plateau_reached", "check_run_inputs"]

PHASES = ("sae", "space", "query")
PHASE_TERMS = {"sae": ("loss", "rec", "asl", "psl"), "space": ("loss", "con", "rec_v", "rec_t"),
               "query": ("loss", "con", "tri")}
STATE_NAME = "state.safetensors"
EXPORT_NAME = "exclmm.safetensors"
PHASES_NAME = "phases.json"  # steps each phase ran and why it stopped
STAGE1_NAME = "stage1.safetensors"  # the model when stage 1 ends (F_theta still the identity): "stage 1 only"


# ------------------------------------------------------------------------ plateau rule

def plateau_reached(window_means: list[float], tol: float) -> bool:
    """The plateau rule on a phase's window means (mean loss of each run of W steps, in order):
    True when the last one is not below the lowest earlier one by more than ``tol`` of it.

    Compared with the best earlier window rather than the previous one, so a noisy window that
    happens to rise does not hide a loss that is still falling overall (the best moves on)."""
    if len(window_means) < 2:
        return False
    best = min(window_means[:-1])
    return window_means[-1] > best - tol * abs(best)


@dataclass
class Plateau:
    """Running state of the plateau rule for one phase (saved in the state file, so a resumed run
    stops at the same step as an uninterrupted one). ``window`` 0: never stops early."""

    window: int
    tol: float
    means: list = field(default_factory=list)  # one per finished window
    total: float = 0.0                          # loss summed over the current window
    count: int = 0

    def add(self, loss: float) -> bool:
        """Count one step's loss; True when this step ends a window and the rule says stop."""
        if self.window <= 0:
            return False
        self.total += loss
        self.count += 1
        if self.count < self.window:
            return False
        self.means.append(self.total / self.count)
        self.total, self.count = 0.0, 0
        return plateau_reached(self.means, self.tol)

    def snapshot(self) -> dict[str, Any]:
        return {"means": list(self.means), "total": self.total, "count": self.count}

    @classmethod
    def restore(cls, snap: dict[str, Any] | None, window: int, tol: float) -> "Plateau":
        snap = snap or {}
        return cls(window, tol, list(snap.get("means", [])), float(snap.get("total", 0.0)), int(snap.get("count", 0)))


# ------------------------------------------------------------------------ state

def save_state(path: Path, model: ExclMM, optimizer: torch.optim.Optimizer, scheduler, phase: str, step: int,
               window: LogWindow, cfg: ExclMMConfig, plateau: Plateau, phase_done: bool,
               steps_run: dict[str, dict]) -> None:
    """The resumable state after ``step`` steps of ``phase`` (:func:`demind.trainkit.save_train_state`);
    ``phase_done``: the phase has finished (its cap or the plateau rule); ``steps_run``: the earlier phases'."""
    save_train_state(path, step=step, modules={"model": model}, optimizer=optimizer, scheduler=scheduler,
                     extra={"phase": phase, "config": asdict(cfg), "log_window": window.snapshot(),
                            "plateau": plateau.snapshot(), "phase_done": phase_done, "steps_run": steps_run})


def batch_rows(n: int, size: int, seed: int, phase: str, step: int) -> torch.Tensor:
    """Rows of step ``step``'s batch: a function of (seed, phase, step) only, so resuming is exact."""
    g = torch.Generator().manual_seed(derive_seed("exclmm", seed, phase, step))
    return torch.randint(0, n, (size,), generator=g)


def sample_truth(truth: list[list[int]], rows: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    """One ground-truth image row per query row, drawn from (seed, step)."""
    g = torch.Generator().manual_seed(derive_seed("exclmm-gt", seed, step))
    picks = torch.rand(len(rows), generator=g)
    return torch.tensor([truth[r][int(p * len(truth[r]))] for r, p in zip(rows.tolist(), picks.tolist())])


# ------------------------------------------------------------------------ phases

def sae_loss(model: ExclMM, feats: dict[str, Any], rows: torch.Tensor, cfg: ExclMMConfig) -> dict[str, torch.Tensor]:
    z, x_hat, x = model.sae(feats["word_vectors"][rows])
    terms = {"rec": L.reconstruction_loss(x, x_hat), "asl": L.average_sparsity_loss(z, cfg.sae.rho),
             "psl": L.partial_sparsity_loss(z)}
    terms["loss"] = terms["rec"] + cfg.sae.w_average_sparsity * terms["asl"] + cfg.sae.w_partial_sparsity * terms["psl"]
    return terms


def space_loss(model: ExclMM, feats: dict[str, Any], rows: torch.Tensor, cfg: ExclMMConfig) -> dict[str, torch.Tensor]:
    """Stage 1, step 3: Eq. 12 (``space.contrastive``) + Eq. 13 (decoders read ``space.reconstruct``)."""
    text = feats["captions"][rows]
    image = feats["images"][feats["caption_image"][rows]]
    z_c = feats["caption_codes"][rows] if cfg.space.zc_mask else None
    e_v, e_t = model.space.image_code(image), model.space.text_code(text)
    image_z = z_c if cfg.space.image_mask == "zc_or_top_t" else None
    h_v, h_t = e_v * model.space.mask(e_v, image_z), e_t * model.space.mask(e_t, z_c)
    contrast = L.normalised_contrastive_loss if cfg.space.contrastive == "paper" else L.contrastive_loss
    rec_v, rec_t = (e_v, e_t) if cfg.space.reconstruct == "unmasked" else (h_v, h_t)
    terms = {"con": contrast(h_v, h_t, cfg.space.tau),
             "rec_v": L.reconstruction_loss(image, model.space.image_decoder(rec_v)),
             "rec_t": L.reconstruction_loss(text, model.space.text_decoder(rec_t))}
    terms["loss"] = terms["con"] + cfg.space.w_reconstruction * (terms["rec_v"] + terms["rec_t"])
    return terms


def query_loss(model: ExclMM, feats: dict[str, Any], rows: torch.Tensor, step: int,
               cfg: ExclMMConfig) -> dict[str, torch.Tensor]:
    """Stage 2: lambda_c * L_c (Eq. 15, ``query.contrastive``) + (1 - lambda_c) * L_t (Eq. 16, ``query.triplet``)."""
    q = model.query_encoder(feats["query_inputs"][rows])
    gt = sample_truth(feats["query_truth"], rows, cfg.run.seed, step)
    gallery = feats["gallery_codes"]
    truth_sets = [set(feats["query_truth"][r]) for r in rows.tolist()]
    also = torch.tensor([[j != i and int(g) in truth_sets[i] for j, g in enumerate(gt.tolist())]
                         for i in range(len(rows))])
    clip = cfg.query.space == "clip"
    tau, margin = (cfg.query.clip_tau, cfg.query.clip_margin) if clip else (cfg.query.tau, cfg.query.margin)
    positive_images = gallery[feats["query_positive"][rows]]
    if cfg.query.contrastive == "paper":
        con = L.normalised_contrastive_loss(q, gallery[gt], tau, also)
    else:
        con = L.query_contrastive_loss(q, gallery[gt], also, tau)
    if cfg.query.triplet == "paper":  # exc_cp: the positive caption through F_theta as well
        positive_queries = model.query_encoder(feats["positive_inputs"][rows])
        tri = L.paper_triplet_loss(positive_images, positive_queries, q, cfg.query.triplet_margin)
    else:
        tri = L.triplet_loss(q, gallery[gt], positive_images, margin)
    w_c, w_t = cfg.query.weights()
    return {"con": con, "tri": tri, "loss": w_c * con + w_t * tri}


@dataclass
class Phase:
    """One resumable phase: ``steps`` optimizer steps of Adam at ``lr`` on ``module``, batches of
    ``batch`` rows out of ``rows``; ``offset`` = steps of the run's earlier phases (metrics.jsonl's step)."""

    name: str
    module: torch.nn.Module
    steps: int
    lr: float
    rows: int
    batch: int
    loss_fn: Callable[[torch.Tensor, int], dict[str, torch.Tensor]]
    offset: int = 0


def run_phase(phase: Phase, model: ExclMM, cfg: ExclMMConfig, state: dict | None, state_path: Path,
              steps_run: dict[str, dict]) -> dict:
    """Train ``phase``, resuming from ``state`` (a loaded state file of this phase) when given; returns
    ``{"steps": steps run, "stopped": "plateau" or "cap", "window_means": [...]}``."""
    # Adam as in the paper (AdamW with no weight decay is Adam), constant lr: the engine's pieces
    optimizer = build_adamw(phase.module.named_parameters(), phase.lr)
    scheduler = build_lr_scheduler(optimizer, 0, phase.steps, "constant")
    terms = PHASE_TERMS[phase.name]
    window, start = LogWindow(sums={}, names=terms), 0
    plateau = Plateau(cfg.stop.window, cfg.stop.tol)
    if state is not None:
        start = restore_train_state(state, modules={}, optimizer=optimizer, scheduler=scheduler)
        window = LogWindow.restore(state["extra"]["log_window"], sums={}, names=terms)
        plateau = Plateau.restore(state["extra"].get("plateau"), cfg.stop.window, cfg.stop.tol)
        log.info("exclmm %s: resuming at step %d/%d", phase.name, start, phase.steps)
    stopped = "cap"
    for step in range(start, phase.steps):
        rows = batch_rows(phase.rows, phase.batch, cfg.run.seed, phase.name, step)
        losses = phase.loss_fn(rows, step)
        check_finite_terms(losses, step, where=f"exclmm {phase.name}",
                           hint=f"lower {phase.name}.lr or check the data; rerunning resumes from {state_path}")
        optimizer.zero_grad(set_to_none=True)
        losses["loss"].backward()
        optimizer.step()
        scheduler.step()
        window.add(losses)
        window.samples += phase.batch
        done = step + 1
        flat = plateau.add(float(losses["loss"].detach()))
        end = flat or done == phase.steps
        if done % cfg.run.log_every == 0 or end:
            log_phase(phase, done, window, Path(cfg.run.output_dir))
            window = LogWindow(sums={}, names=terms)
        if done % cfg.run.save_every == 0 or end:
            save_state(state_path, model, optimizer, scheduler, phase.name, done, window, cfg, plateau, end, steps_run)
        if flat:
            stopped = "plateau"
            log.info("exclmm %s: loss stopped falling at step %d (window means %s)", phase.name, done,
                     ", ".join(f"{m:.4f}" for m in plateau.means[-3:]))
            break
    else:
        done = max(start, phase.steps)
    return {"steps": done, "stopped": stopped, "window_means": [round(m, 6) for m in plateau.means]}


def log_phase(phase: Phase, done: int, window: LogWindow, run_dir: Path) -> None:
    """One console line and one metrics.jsonl line: the window's mean of each loss term, rows/s."""
    means = dict(zip(window.terms(), window.means(torch.device("cpu")).tolist()))
    rate = window.samples / max(time.perf_counter() - window.start, 1e-9)
    log.info(step_line(done, phase.steps, term_parts(means, window.terms()) + [f"{rate:.0f} rows/s"],
                       prefix=f"exclmm {phase.name} "))
    append_metrics(run_dir / "metrics.jsonl", {"phase": phase.name, "step": phase.offset + done, "phase_step": done,
                                               **{k: round(v, 6) for k, v in means.items()},
                                               "rows_per_s": round(rate, 1)})


def result_defining(cfg: ExclMMConfig | dict) -> dict[str, Any]:
    """The parts of a config that change the trained weights (not logging or where to write)."""
    # a key added since a run was written reads as its default (with_defaults): no change
    d = with_defaults(asdict(cfg) if not isinstance(cfg, dict) else cfg, asdict(ExclMMConfig()))
    return {"backbone": d["backbone"], "data": {"train": d["data"]["train"]}, "sae": d["sae"], "space": d["space"],
            "query": d["query"], "stop": d["stop"], "run": {"seed": d["run"]["seed"]}}


def check_same_run(found: dict, cfg: ExclMMConfig, path: Path) -> None:
    """A state or export in ``run.output_dir`` must come from the same recipe, or we would resume
    (or reuse) another experiment under this one's name."""
    changes = config_changes(result_defining(found), result_defining(cfg))
    if changes:
        raise InputError(f"{path} was written with another config ({'; '.join(changes)}); "
                         f"choose another run.output_dir or delete {path}")


def check_run_inputs(cfg: ExclMMConfig) -> None:
    """What a run reads and writes, before the backbone loads: the training split (its
    exclcoco.json), the captions file when given, and the output and cache folders (writable).
    Ranges, choices and keys that must agree were checked when the config was loaded."""
    if not cfg.data.train:
        raise InputError("config key 'data.train' is empty: give the ExclCOCO folder of the training split "
                         "(python -m demind.cli.build_exclcoco ...)")
    train = Path(cfg.data.train)
    if not (train / "exclcoco.json").is_file():
        raise MissingInputError(f"config key 'data.train' = {str(train)!r}: {train / 'exclcoco.json'} does not "
                                "exist; give the folder demind-build-exclcoco wrote for the training split")
    if cfg.data.captions and not Path(cfg.data.captions).is_file():
        raise MissingInputError(f"config key 'data.captions' = {cfg.data.captions!r}: no such file; give the COCO "
                                "captions_<split>.json of the training split, or leave it empty")
    check_output_key("run.output_dir", cfg.run.output_dir)
    if cfg.data.cache_dir:
        check_output_key("data.cache_dir", cfg.data.cache_dir)


def train_exclmm(cfg: ExclMMConfig, backbone: FrozenCLIP | None = None) -> Path:
    """Train (or resume, or reuse) one ExclMM run; returns the export path."""
    run_dir = Path(cfg.run.output_dir)
    export = run_dir / EXPORT_NAME
    if export.is_file():
        from demind.exclmm.model import read_export_config

        check_same_run(read_export_config(export), cfg, export)
        log.info("exclmm: %s exists; nothing to do", export)
        return export
    refuse_pickled_files(run_dir, FEATURES_NAME)
    check_run_inputs(cfg)
    torch.manual_seed(cfg.run.seed)
    backbone = backbone or build_backbone(cfg.backbone, device=cfg.run.device)
    state_path = run_dir / STATE_NAME
    feats = prepare_features(cfg.data, backbone, run_dir, cfg.run.progress)
    # seeded here, not only at the start: whether the features came from disk or were computed
    # (DataLoaders draw from the global generator) must not change the initial weights
    torch.manual_seed(derive_seed("exclmm-init", cfg.run.seed) % 2**63)
    model = ExclMM.from_config(cfg, backbone.embed_dim, backbone.identity)
    model.sae.set_statistics(feats["word_vectors"])
    state = load_train_state(state_path) if state_path.is_file() else None
    if state is not None:
        check_same_run(state["extra"]["config"], cfg, state_path)
        model.load_state_dict(state["modules"]["model"])
    save_config(cfg, run_dir / "config.yaml")
    phases = ("query",) if cfg.query.space == "clip" else PHASES
    log.info("exclmm: %d images, %d captions, %d words, %d queries; phases %s; d=%d, top_t=%d",
             len(feats["image_ids"]), len(feats["captions"]), len(feats["vocab"]), len(feats["queries"]),
             ",".join(phases), cfg.sae.code_dim, cfg.space.top_t)
    done_before = PHASES.index(state["extra"]["phase"]) if state is not None else -1
    steps_run = finished_phases(state, cfg, phases)
    offset = 0
    for name in phases:
        index = PHASES.index(name)
        phase = build_phase(name, model, feats, cfg, offset)
        if name == "space" or name == "query":
            prepare_phase_inputs(model, feats, name, cfg)
        if name not in steps_run:
            resume = state if index == done_before else None
            if name == "query" and resume is None and "space" in steps_run:
                model.save(run_dir / STAGE1_NAME)  # "stage 1 only", for free: F_theta is still the identity
            # lines a killed run logged after its last saved state are logged again
            trim_metrics(run_dir, phase.offset + (resume["step"] if resume is not None else 0))
            steps_run[name] = run_phase(phase, model, cfg, resume, state_path, dict(steps_run))
        offset += steps_run[name]["steps"]
    write_json_atomic(run_dir / PHASES_NAME, {"phases": steps_run, "stop": asdict(cfg.stop)}, indent=1)
    model.save(export)
    log.info("exclmm: exported %s", export)
    return export


def finished_phases(state: dict | None, cfg: ExclMMConfig, phases: tuple[str, ...]) -> dict[str, dict]:
    """The phases a saved state has finished -> what each ran (a state written before the plateau
    rule ran every finished phase to its ``steps``)."""
    if state is None:
        return {}
    extra = state["extra"]
    done = dict(extra.get("steps_run", {}))
    index = PHASES.index(extra["phase"])
    for name in [p for p in PHASES[:index] if p in phases]:
        done.setdefault(name, {"steps": getattr(cfg, name).steps, "stopped": "cap", "window_means": []})
    current = getattr(cfg, extra["phase"])
    if extra.get("phase_done", state["step"] >= current.steps):
        done[extra["phase"]] = {"steps": state["step"], "stopped": "plateau" if state["step"] < current.steps else "cap",
                                "window_means": [round(m, 6) for m in extra.get("plateau", {}).get("means", [])]}
    return done


def build_phase(name: str, model: ExclMM, feats: dict[str, Any], cfg: ExclMMConfig, offset: int) -> Phase:
    """The :class:`Phase` of ``name`` from the config's section of that name."""
    section = {"sae": cfg.sae, "space": cfg.space, "query": cfg.query}[name]
    rows = {"sae": len(feats["vocab"]), "space": len(feats["captions"]), "query": len(feats["queries"])}[name]
    return Phase(name, model.phase_module(name), section.steps, section.lr, rows, section.batch_size,
                 phase_loss(name, model, feats, cfg), offset)


def phase_loss(phase: str, model: ExclMM, feats: dict[str, Any], cfg: ExclMMConfig):
    if phase == "sae":
        return lambda rows, step: sae_loss(model, feats, rows, cfg)
    if phase == "space":
        return lambda rows, step: space_loss(model, feats, rows, cfg)
    return lambda rows, step: query_loss(model, feats, rows, step, cfg)


@torch.no_grad()
def prepare_phase_inputs(model: ExclMM, feats: dict[str, Any], phase: str, cfg: ExclMMConfig) -> None:
    """Frozen inputs of a phase from the finished previous ones: caption codes z_c (Eq. 5) for
    ``space``; the frozen sparse query codes and gallery codes for ``query``."""
    if phase == "space":
        word_codes = model.sae.encode(feats["word_vectors"])
        feats["caption_codes"] = model.sentence_codes(word_codes, feats["caption_words"])
        return
    if cfg.query.space == "clip":
        feats["query_inputs"], feats["gallery_codes"] = feats["queries"], feats["images"]
        feats["positive_inputs"] = feats["positive_queries"]
        return
    word_codes = model.sae.encode(feats["word_vectors"])
    z_q = model.sentence_codes(word_codes, feats["query_words"]) if cfg.space.zc_mask else None
    feats["query_inputs"] = model.space.encode_text(feats["queries"], z_q)
    if cfg.query.triplet == "paper":  # spar_cp: only the paper's Eq. 16 reads the positive query
        z_p = model.sentence_codes(word_codes, feats["positive_words"]) if cfg.space.zc_mask else None
        feats["positive_inputs"] = model.space.encode_text(feats["positive_queries"], z_p)
    # the gallery as at retrieval: Top_t alone (an image has no caption there)
    feats["gallery_codes"] = model.space.encode_image(feats["images"])
