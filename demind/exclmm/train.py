"""ExclMM training on frozen CLIP features: stage 1 (SAE, sparse space) then stage 2 (query encoder).

    from demind.config import load_config
    from demind.exclmm.train import ExclMMConfig, train_exclmm
    export = train_exclmm(load_config(ExclMMConfig, "configs/exclmm/toy.yaml", ["run.seed=1"]))

Phases, each resumable: ``sae`` (stage 1 step 1), ``space`` (step 3; step 2 is a fixed mean),
``query`` (stage 2). ``query.space=clip`` (the "without stage 1" ablation) skips the first two.
Every ``run.save_every`` steps and at the end of each phase, ``<output_dir>/state.pt`` is written
atomically (all modules, the current optimizer, phase, step, config); rerunning the same command
resumes from it. Batches are drawn from a generator seeded by (seed, phase, step), so a resumed
run draws the same batches as an uninterrupted one. CLIP features are computed once into
``<output_dir>/features.pt`` (images through the evaluation image cache,
:mod:`demind.eval.image_cache`, so the harness reuses them). The export ``<output_dir>/exclmm.safetensors``
(weights + config + backbone identity) is written last: its presence means done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from demind.backbone import BackboneConfig, FrozenCLIP, build_backbone
from demind.config import save_config
from demind.eval.exclcoco import load_exclcoco
from demind.eval.image_cache import ImageFeatureCache, backbone_cache_slug, encode_image_refs
from demind.eval.structures import ImageRef, read_json
from demind.exclmm import losses as L
from demind.exclmm.model import ExclMM, words_of
from demind.io import atomic_path
from demind.seeding import derive_seed

log = logging.getLogger(__name__)

PHASES = ("sae", "space", "query")
STATE_NAME = "state.pt"
FEATURES_NAME = "features.pt"
EXPORT_NAME = "exclmm.safetensors"


@dataclass
class ExclDataConfig:
    train: str = ""                 # ExclCOCO folder of the training split (its exclcoco.json)
    captions: str = ""              # COCO captions file of that split ("" = the one exclcoco.json names)
    cache_dir: str = ""             # image-feature cache ("" = <output_dir>/feature_cache)
    encode_batch_size: int = 256


@dataclass
class SaeConfig:
    """Stage 1, step 1 (Eq. 2-4): SPINE's defaults (rho 0.15, unit loss weights)."""

    code_dim: int = 1000            # d, the sparse width (SPINE: 1000 over 300-d GloVe)
    steps: int = 1000
    batch_size: int = 256
    lr: float = 1e-3
    rho: float = 0.15               # target fraction of words each unit fires on (Eq. 3)
    w_average_sparsity: float = 1.0
    w_partial_sparsity: float = 1.0


@dataclass
class SpaceConfig:
    """Stage 1, step 3 (Eq. 8-13)."""

    hidden: int = 1024
    top_t: int = 32                 # Top_t of the masks
    zc_mask: bool = True            # False: mask = Top_t only (the "without z_c" ablation)
    steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    tau: float = 1.0                # Eq. 12
    w_reconstruction: float = 1.0   # Eq. 13, both decoders


@dataclass
class QueryConfig:
    """Stage 2 (Eq. 15-17): L = lambda_c * L_c + (1 - lambda_c) * L_t."""

    space: str = "sparse"           # "clip": the "CLIP embeddings without stage 1" ablation
    hidden: int = 1024
    steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    lambda_c: float = 0.5           # 1.0 = without L_t, 0.0 = without L_c
    tau: float = 1.0                # sparse space (dot product)
    margin: float = 1.0             # sparse space (one active dimension's worth)
    clip_tau: float = 0.01          # clip space (cosine; CLIP's trained scale 100)
    clip_margin: float = 0.1


@dataclass
class ExclRunConfig:
    output_dir: str = "runs/exclmm"
    seed: int = 0
    device: str = "cpu"
    log_every: int = 200
    save_every: int = 500
    progress: bool = True


@dataclass
class ExclMMConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    data: ExclDataConfig = field(default_factory=ExclDataConfig)
    sae: SaeConfig = field(default_factory=SaeConfig)
    space: SpaceConfig = field(default_factory=SpaceConfig)
    query: QueryConfig = field(default_factory=QueryConfig)
    run: ExclRunConfig = field(default_factory=ExclRunConfig)


# ------------------------------------------------------------------------ features

@torch.no_grad()
def encode_texts(backbone: FrozenCLIP, texts: list[str], batch_size: int) -> torch.Tensor:
    """(len(texts), D) L2-normalised pooled CLIP text embeddings, float32 on CPU."""
    out = [F.normalize(backbone.encode_text(texts[i:i + batch_size]).pooled.float(), dim=-1).cpu()
           for i in range(0, len(texts), batch_size)]
    return torch.cat(out) if out else torch.zeros(0, backbone.embed_dim)


def word_index(sentences: list[str], vocab: dict[str, int]) -> list[list[int]]:
    """Per sentence, the vocabulary indices of its words (Eq. 5's average runs over them)."""
    return [[vocab[w] for w in words_of(s) if w in vocab] for s in sentences]


def prepare_features(cfg: ExclMMConfig, backbone: FrozenCLIP, run_dir: Path) -> dict[str, Any]:
    """Frozen CLIP features of everything training reads, computed once (``features.pt``).

    Returns a dict: ``images`` (I, D) normalised, ``image_ids``; ``captions`` (C, D) and
    ``caption_image`` (C,) row of each caption's image, ``caption_words``; ``vocab`` (word list)
    and ``word_vectors`` (V, D) -- each word's pooled CLIP text embedding, alone, normalised;
    ``queries`` (Q, D), ``query_words``, ``query_truth`` (lists of image rows), ``query_positive`` (Q,).
    """
    path = run_dir / FEATURES_NAME
    if path.is_file():
        feats = torch.load(path, weights_only=False)
        if feats.get("backbone") == backbone.identity and feats.get("train") == cfg.data.train:
            return feats
        log.warning("%s was computed for another backbone or data set; recomputing", path)
    if not cfg.data.train:
        raise ValueError("data.train is empty: give the ExclCOCO folder of the training split "
                         "(python -m demind.cli.build_exclcoco ...)")
    data, files = load_exclcoco(cfg.data.train)
    image_ids = list(files)
    row = {i: k for k, i in enumerate(image_ids)}
    cache_root = Path(cfg.data.cache_dir or run_dir / "feature_cache")
    cache = ImageFeatureCache(cache_root, backbone_cache_slug(backbone), "exclcoco", data.get("split", "train"))
    refs = [ImageRef(i, p) for i, p in files.items()]
    raw, _ = encode_image_refs(backbone, refs, cache, "gallery", cfg.data.encode_batch_size, progress=cfg.run.progress,
                           desc="exclmm train images")
    images = F.normalize(torch.stack([raw[i] for i in image_ids]).float(), dim=-1)

    captions_path = Path(cfg.data.captions or data["source"]["captions"])
    if not captions_path.is_file():
        raise FileNotFoundError(f"captions file {captions_path} not found; set data.captions to the COCO "
                                f"captions_{{split}}.json of the training split")
    caps = [c for c in read_json(captions_path)["annotations"] if str(c["image_id"]) in row]
    caption_texts = [c["caption"].strip() for c in caps]
    queries = data["queries"]
    vocab = sorted({w for s in caption_texts + [q["query"] for q in queries] for w in words_of(s)})
    bs = cfg.data.encode_batch_size
    log.info("exclmm features: %d images, %d captions, %d queries, %d words", len(image_ids), len(caps),
             len(queries), len(vocab))
    vindex = {w: k for k, w in enumerate(vocab)}
    feats = {
        "backbone": backbone.identity, "train": cfg.data.train, "image_ids": image_ids, "images": images,
        "captions": encode_texts(backbone, caption_texts, bs),
        "caption_image": torch.tensor([row[str(c["image_id"])] for c in caps]),
        "caption_words": word_index(caption_texts, vindex),
        "vocab": vocab, "word_vectors": encode_texts(backbone, vocab, bs),
        "queries": encode_texts(backbone, [q["query"] for q in queries], bs),
        "query_words": word_index([q["query"] for q in queries], vindex),
        "query_truth": [[row[i] for i in q["ground_truth"]] for q in queries],
        "query_positive": torch.tensor([row[q["image_id"]] for q in queries]),
    }
    with atomic_path(path) as tmp:
        torch.save(feats, tmp)
    return feats


# ------------------------------------------------------------------------ state

def save_state(path: Path, model: ExclMM, optim: torch.optim.Optimizer | None, phase: str, step: int,
               cfg: ExclMMConfig) -> None:
    with atomic_path(path) as tmp:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict() if optim else None,
                    "phase": phase, "step": step, "config": asdict(cfg)}, tmp)


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
    text = feats["captions"][rows]
    image = feats["images"][feats["caption_image"][rows]]
    z_c = feats["caption_codes"][rows] if cfg.space.zc_mask else None
    h_v = model.space.encode_image(image)
    h_t = model.space.encode_text(text, z_c)
    terms = {"con": L.contrastive_loss(h_v, h_t, cfg.space.tau),
             "rec_v": L.reconstruction_loss(image, model.space.image_decoder(h_v)),
             "rec_t": L.reconstruction_loss(text, model.space.text_decoder(h_t))}
    terms["loss"] = terms["con"] + cfg.space.w_reconstruction * (terms["rec_v"] + terms["rec_t"])
    return terms


def query_loss(model: ExclMM, feats: dict[str, Any], rows: torch.Tensor, step: int,
               cfg: ExclMMConfig) -> dict[str, torch.Tensor]:
    q = model.query_encoder(feats["query_inputs"][rows])
    gt = sample_truth(feats["query_truth"], rows, cfg.run.seed, step)
    gallery = feats["gallery_codes"]
    truth_sets = [set(feats["query_truth"][r]) for r in rows.tolist()]
    also = torch.tensor([[j != i and int(g) in truth_sets[i] for j, g in enumerate(gt.tolist())]
                         for i in range(len(rows))])
    clip = cfg.query.space == "clip"
    tau, margin = (cfg.query.clip_tau, cfg.query.clip_margin) if clip else (cfg.query.tau, cfg.query.margin)
    terms = {"con": L.query_contrastive_loss(q, gallery[gt], also, tau),
             "tri": L.triplet_loss(q, gallery[gt], gallery[feats["query_positive"][rows]], margin)}
    lam = cfg.query.lambda_c
    terms["loss"] = lam * terms["con"] + (1 - lam) * terms["tri"]
    return terms


def run_phase(name: str, model: ExclMM, params: list[torch.nn.Parameter], steps: int, lr: float, n_rows: int,
              batch: int, loss_fn, cfg: ExclMMConfig, state: dict | None, state_path: Path) -> None:
    """Adam on ``params`` for ``steps`` steps, resuming from ``state`` when it is this phase."""
    optim = torch.optim.Adam(params, lr=lr)
    start = 0
    if state is not None and state["phase"] == name:
        optim.load_state_dict(state["optim"])
        start = state["step"]
        log.info("exclmm %s: resuming at step %d/%d", name, start, steps)
    t0 = time.perf_counter()
    for step in range(start, steps):
        rows = batch_rows(n_rows, batch, cfg.run.seed, name, step)
        terms = loss_fn(rows, step)
        if not torch.isfinite(terms["loss"]):
            bad = [k for k, v in terms.items() if not torch.isfinite(v)]
            raise FloatingPointError(f"exclmm {name} step {step}: non-finite loss term(s) {bad}")
        optim.zero_grad(set_to_none=True)
        terms["loss"].backward()
        optim.step()
        done = step + 1
        if done % cfg.run.log_every == 0 or done == steps:
            rate = (done - start) * batch / max(time.perf_counter() - t0, 1e-9)
            log.info("exclmm %s step %d/%d %s %.0f rows/s", name, done, steps,
                     " ".join(f"{k} {v.item():.4f}" for k, v in terms.items()), rate)
        if done % cfg.run.save_every == 0 or done == steps:
            save_state(state_path, model, optim, name, done, cfg)


def result_defining(cfg: ExclMMConfig | dict) -> dict[str, Any]:
    """The parts of a config that change the trained weights (not logging or where to write)."""
    d = asdict(cfg) if not isinstance(cfg, dict) else cfg
    return {"backbone": d["backbone"], "train": d["data"]["train"], "sae": d["sae"], "space": d["space"],
            "query": d["query"], "seed": d["run"]["seed"]}


def check_same_run(found: dict, cfg: ExclMMConfig, path: Path) -> None:
    """A state or export in ``run.output_dir`` must come from the same recipe, or we would resume
    (or reuse) another experiment under this one's name."""
    old, new = result_defining(found), result_defining(cfg)
    if old != new:
        diff = [k for k in new if old.get(k) != new[k]]
        raise ValueError(f"{path} was written with another config (differs in {diff}); "
                         f"choose another run.output_dir or delete {path}")


def train_exclmm(cfg: ExclMMConfig, backbone: FrozenCLIP | None = None) -> Path:
    """Train (or resume, or reuse) one ExclMM run; returns the export path."""
    run_dir = Path(cfg.run.output_dir)
    export = run_dir / EXPORT_NAME
    if export.is_file():
        from demind.exclmm.model import read_export_config

        check_same_run(read_export_config(export), cfg, export)
        log.info("exclmm: %s exists; nothing to do", export)
        return export
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    backbone = backbone or build_backbone(cfg.backbone, device=cfg.run.device)
    state_path = run_dir / STATE_NAME
    feats = prepare_features(cfg, backbone, run_dir)
    # seeded here, not only at the start: whether the features came from disk or were computed
    # (DataLoaders draw from the global generator) must not change the initial weights
    torch.manual_seed(derive_seed("exclmm-init", cfg.run.seed) % 2**63)
    model = ExclMM.from_config(cfg, backbone.embed_dim, backbone.identity)
    model.sae.set_statistics(feats["word_vectors"])
    state = torch.load(state_path, weights_only=False) if state_path.is_file() else None
    if state is not None:
        check_same_run(state["config"], cfg, state_path)
        model.load_state_dict(state["model"])
    save_config(cfg, run_dir / "config.yaml")
    phases = ("query",) if cfg.query.space == "clip" else PHASES
    log.info("exclmm: %d images, %d captions, %d words, %d queries; phases %s; d=%d, top_t=%d",
             len(feats["image_ids"]), len(feats["captions"]), len(feats["vocab"]), len(feats["queries"]),
             ",".join(phases), cfg.sae.code_dim, cfg.space.top_t)
    done_before = PHASES.index(state["phase"]) if state is not None else -1
    for phase in phases:
        index = PHASES.index(phase)
        finished = index < done_before or (index == done_before and state["step"] >= phase_steps(cfg, phase))
        if phase == "space" or phase == "query":
            prepare_phase_inputs(model, feats, phase, cfg)
        if finished:
            continue
        resume = state if index == done_before else None
        run_phase(phase, model, list(model.phase_module(phase).parameters()), phase_steps(cfg, phase),
                  phase_lr(cfg, phase), phase_rows(feats, phase), phase_batch(cfg, phase),
                  phase_loss(phase, model, feats, cfg), cfg, resume, state_path)
    model.save(export)
    log.info("exclmm: exported %s", export)
    return export


def phase_steps(cfg: ExclMMConfig, phase: str) -> int:
    return {"sae": cfg.sae.steps, "space": cfg.space.steps, "query": cfg.query.steps}[phase]


def phase_lr(cfg: ExclMMConfig, phase: str) -> float:
    return {"sae": cfg.sae.lr, "space": cfg.space.lr, "query": cfg.query.lr}[phase]


def phase_batch(cfg: ExclMMConfig, phase: str) -> int:
    return {"sae": cfg.sae.batch_size, "space": cfg.space.batch_size, "query": cfg.query.batch_size}[phase]


def phase_rows(feats: dict[str, Any], phase: str) -> int:
    return {"sae": len(feats["vocab"]), "space": len(feats["captions"]), "query": len(feats["queries"])}[phase]


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
        return
    word_codes = model.sae.encode(feats["word_vectors"])
    z_q = model.sentence_codes(word_codes, feats["query_words"]) if cfg.space.zc_mask else None
    feats["query_inputs"] = model.space.encode_text(feats["queries"], z_q)
    feats["gallery_codes"] = model.space.encode_image(feats["images"])
