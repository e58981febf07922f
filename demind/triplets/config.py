"""The recipe of supervised training on triplets (``demind-train-triplets``): sections of
:class:`TripletTrainConfig`. Torch-free, so ``--help`` and config checks load no model code."""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.schema import BackboneConfig, CombinerConfig
from demind.settings import RunSection, setting, threads_setting

MODES = ("none", "small-loss", "gfq", "rcl", "conesep", "conesep-nobtu", "conesep-nonbl", "conesep-nogfq")
SOURCES = ("cirr", "fashioniq", "file", "generated", "megapairs")
NOISE_KINDS = ("easy", "hard", "tme")


@dataclass
class TripletDataConfig:
    source: str = setting("file", choices=SOURCES, help="cirr / fashioniq: the official training split under "
                                                        "path; file: a .jsonl or .csv of reference, modification, "
                                                        "target; generated: demind-generate-triplets' folder; "
                                                        "megapairs: a file in MegaPairs's released layout")
    path: str = setting("", refuses="", help="the data root (cirr, fashioniq) or the triplet file (file); read, "
                                             "with one error naming the file and line, before any model loads")
    categories: str = setting("dress,shirt,toptee", refuses="dress,hat", help="FashionIQ categories, comma-separated")
    limit: int | None = setting(None, ge=1, help="the first N triplets only (smoke runs); fashioniq: the first N "
                                                 "of each category, as demind-eval's limit")
    cache_dir: str = setting("", output="dir", help="frozen-feature cache ('' = <run.output_dir>/feature_cache); runs may share "
                                      "one: entries are keyed by backbone and content")
    encode_batch_size: int = setting(256, ge=1)
    hard_negatives: int = setting(5, ge=0, help="generated / megapairs: each triplet's first H hard negatives join "
                                                "its InfoNCE beside the in-batch targets (MegaPairs: 5); 0: "
                                                "in-batch negatives only")
    corpus: str = setting("", free="a shard list, compared with the recorded corpus by content digest",
                          help="generated: where the corpus the pairs were mined from lies now, if it moved "
                               "('' = where the pairs manifest says)")


@dataclass
class TripletNoiseConfig:
    """Noise injected into the training texts (:mod:`demind.triplets.noise`); for experiments."""

    rate: float = setting(0.0, ge=0.0, le=1.0, help="share of triplets made noisy (fixed, nested across rates)")
    kind: str = setting("easy", choices=NOISE_KINDS, help="easy: another triplet's text; hard: the triplet's "
                                                          "hard_modification (same edit kind, other outcome); "
                                                          "tme: TME's thirds (shuffled references, texts, targets)")


@dataclass
class TripletOptimConfig:
    epochs: int = setting(10, ge=1)
    warmup_epochs: int = setting(2, ge=0, help="epochs before a noise mode acts (ConeSep's code: 2)")
    batch_size: int = setting(128, ge=2)
    lr: float = setting(1e-3, gt=0)
    weight_decay: float = setting(0.01, ge=0)
    temperature: float = setting(0.07, gt=0, help="InfoNCE tau (ConeSep: 0.07)")


@dataclass
class TripletRobustConfig:
    """The noise mode and ConeSep's constants. Defaults: the authors' code where it and the paper
    differ or the paper is silent (docs/training.md lists our earlier forms and how to select them)."""

    mode: str = setting("none", choices=MODES, help="none; small-loss (GMM on per-sample losses); gfq (GFQ "
                                                    "filter through the model); rcl (RCL's loss alone); conesep "
                                                    "(GFQ + NBL + BTU); conesep-nobtu / -nonbl / -nogfq: ablations")
    pairings: int = setting(1, ge=1, help="GFQ's K: boundary draws per batch (the code: 1; the paper: 4)")
    omega: float = setting(0.5, gt=0, lt=1, help="share (omega_form=share) or fidelity threshold")
    omega_form: str = setting("share", choices=("share", "threshold"), help="share: the int(omega * B) "
                              "lowest-fidelity triplets of a batch are noisy (the code); threshold: F < omega")
    fidelity: str = setting("cone", choices=("cone", "sigmoid"), help="cone: x^2 (1 - x^2), x the clamped, "
                            "batch-normalised similarity above the boundary (the code); sigmoid((s - B) / tau)")
    boundary: str = setting("pixel", choices=("pixel", "fitted"), help="pixel: N(0, 1) pixel images through "
                            "the frozen encoder and the model (the code); fitted: a Gaussian fitted to the features")
    robust_loss: str = setting("rcl", choices=("rcl", "infonce"), help="conesep's L_robust: rcl (RCL's "
                               "complementary loss on every triplet, the code) or infonce (on the clean ones)")
    negative: str = setting("phrase", choices=("phrase", "prompt"), help="NBL's negative: phrase (a learnable "
                            "offset + a negation phrase + the text, the code) or prompt (P_neg replaces the text)")
    nbl: str = setting("authors", choices=("authors", "siglip"), help="authors: target-oriented loss on softmax "
                       "probabilities (nu, warm-up only) + fixed slack band (zeta); siglip: our push + batch band")
    band: str = setting("code", choices=("code", "own"), help="nbl=authors' slack band on every pair's "
                        "coordinate products (the code's broadcast) or on each query's own cos(F_c, F_neg)")
    btu: str = setting("paper", choices=("paper", "code"), help="paper (default, fixed before any run: the "
                       "code's form reads as slips): KL to softmax(scale * cos), no noisy row to its own target, "
                       "no clean one to its own negative; code: the authors' code's (docs/training.md)")
    gamma: float = setting(0.7, ge=0, le=1, help="BTU soft-label fusion")
    zeta: float = setting(0.8, ge=0, help="NBL weight (authors: the slack band's; the code: 0.8)")
    nu: float = setting(0.5, ge=0, help="authors: the target-oriented term's weight; siglip: the band's in L_intra")
    kappa: float = setting(0.5, ge=0, help="BTU weight")
    sinkhorn_reg: float = setting(0.05, gt=0, help="btu=paper's entropic reg (btu=code: the code's 0.03)")
    sinkhorn_iters: int = setting(200, ge=1, help="btu=paper's Sinkhorn iterations (btu=code: the code's 100)")
    gmm_threshold: float = setting(0.5, gt=0, lt=1, help="small-loss: clean when P(low-loss component) >= this")


@dataclass
class TripletRunConfig(RunSection):
    """demind-train-triplets's ``run`` section."""

    progress: bool = setting(True, help="progress bars (feature encoding)")
    output_dir: str = setting("runs/triplets", output="dir", help="run folder: state, metrics, combiner.safetensors")
    seed: int = setting(0, ge=0)
    log_every: int = setting(1, ge=1, help="a log line every N epochs")
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
        from demind.eval import FASHIONIQ_CATEGORIES  # torch-free

        names = [c.strip() for c in self.data.categories.split(",") if c.strip()]
        unknown = [c for c in names if c not in FASHIONIQ_CATEGORIES]
        if unknown or not names:
            problems.append(("data.categories", f"must name FashionIQ categories among {','.join(FASHIONIQ_CATEGORIES)}"
                                                f" (comma-separated), got {self.data.categories!r}"))
        if self.data.source in ("generated", "megapairs") and self.data.hard_negatives and self.robust.mode != "none":
            problems.append(("data.hard_negatives", f"joins the loss of robust.mode=none only (the noise modes keep "
                                                    f"in-batch negatives); set it to 0 for robust.mode="
                                                    f"{self.robust.mode}"))
        if self.optim.warmup_epochs >= self.optim.epochs and self.robust.mode != "none":
            problems.append(("optim.warmup_epochs", f"must be below optim.epochs ({self.optim.epochs}), or "
                                                    f"robust.mode={self.robust.mode} never acts"))
        return problems
