"""The recipe of supervised training on triplets (``demind-train-triplets``): sections of
:class:`TripletTrainConfig`. Torch-free, so ``--help`` and config checks load no model code."""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.schema import BackboneConfig, CombinerConfig
from demind.settings import device_setting, setting, threads_setting

MODES = ("none", "small-loss", "gfq", "conesep", "conesep-nobtu")
SOURCES = ("cirr", "fashioniq", "file")
NOISE_KINDS = ("easy", "hard")


@dataclass
class TripletDataConfig:
    source: str = setting("file", choices=SOURCES, help="cirr / fashioniq: the official training split under "
                                                        "path; file: a .jsonl or .csv of reference, modification, "
                                                        "target")
    path: str = setting("", help="the data root (cirr, fashioniq) or the triplet file (file)")
    categories: str = setting("dress,shirt,toptee", help="FashionIQ categories, comma-separated")
    limit: int | None = setting(None, ge=1, help="the first N triplets only (smoke runs)")
    cache_dir: str = setting("", help="frozen-feature cache ('' = <run.output_dir>/feature_cache)")
    encode_batch_size: int = setting(256, ge=1)


@dataclass
class TripletNoiseConfig:
    """Noise injected into the training texts (:mod:`demind.triplets.noise`); for experiments."""

    rate: float = setting(0.0, ge=0.0, le=1.0, help="share of triplets made noisy (fixed, nested across rates)")
    kind: str = setting("easy", choices=NOISE_KINDS, help="easy: another triplet's text; hard: the triplet's "
                                                          "hard_modification (same edit kind, other outcome)")


@dataclass
class TripletOptimConfig:
    epochs: int = setting(10, ge=1)
    warmup_epochs: int = setting(1, ge=0, help="epochs of plain training before a noise mode acts")
    batch_size: int = setting(128, ge=2)
    lr: float = setting(1e-3, gt=0)
    weight_decay: float = setting(0.01, ge=0)
    temperature: float = setting(0.07, gt=0, help="InfoNCE tau (ConeSep: 0.07)")


@dataclass
class TripletRobustConfig:
    """The noise mode and ConeSep's constants (the paper's values)."""

    mode: str = setting("none", choices=MODES, help="none; small-loss (GMM on per-sample losses); gfq (GFQ "
                                                    "filter through the model); conesep (GFQ + NBL + BTU); "
                                                    "conesep-nobtu")
    pairings: int = setting(4, ge=1, help="GFQ's K")
    omega: float = setting(0.5, gt=0, lt=1, help="fidelity threshold")
    gamma: float = setting(0.7, ge=0, le=1, help="BTU soft-label fusion")
    zeta: float = setting(0.5, ge=0, help="NBL weight")
    nu: float = setting(0.5, ge=0, help="NBL's orthogonality term inside L_intra")
    kappa: float = setting(0.5, ge=0, help="BTU weight")
    sinkhorn_reg: float = setting(0.05, gt=0)
    sinkhorn_iters: int = setting(200, ge=1)
    gmm_threshold: float = setting(0.5, gt=0, lt=1, help="small-loss: clean when P(low-loss component) >= this")


@dataclass
class TripletRunConfig:
    output_dir: str = setting("runs/triplets", help="run folder: state, metrics, combiner.safetensors")
    seed: int = setting(0, ge=0)
    device: str = device_setting("auto")
    log_every: int = setting(1, ge=1, help="a log line every N epochs")
    progress: bool = setting(True, help="progress bars (feature encoding)")
    threads: int = threads_setting()
    detection: bool = setting(True, help="after training, score every triplet with the mode's detector "
                                         "(detection.json; AUROC where noise was injected)")


@dataclass
class TripletTrainConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    data: TripletDataConfig = field(default_factory=TripletDataConfig)
    noise: TripletNoiseConfig = field(default_factory=TripletNoiseConfig)
    model: CombinerConfig = field(default_factory=CombinerConfig)
    optim: TripletOptimConfig = field(default_factory=TripletOptimConfig)
    robust: TripletRobustConfig = field(default_factory=TripletRobustConfig)
    run: TripletRunConfig = field(default_factory=TripletRunConfig)

    def config_problems(self) -> list[tuple[str, str]]:
        problems = []
        if not self.data.path:
            problems.append(("data.path", "is required: the data root or the triplet file"))
        if self.optim.warmup_epochs >= self.optim.epochs and self.robust.mode != "none":
            problems.append(("optim.warmup_epochs", f"must be below optim.epochs ({self.optim.epochs}), or "
                                                    f"robust.mode={self.robust.mode} never acts"))
        return problems
