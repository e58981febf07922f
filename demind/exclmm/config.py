"""ExclMM's training recipe (``configs/exclmm/*.yaml``): the sections of :class:`ExclMMConfig`.

Torch-free, so ``demind-train-exclmm --help`` and config checks load no model code; the trainer
(:mod:`demind.exclmm.train`) and every caller import the sections from here.

Every key is checked when the config is loaded (:func:`demind.config.load_config`): its declared
rule (range or choices, :func:`~demind.settings.setting`) and the keys that must agree
(:meth:`ExclMMConfig.config_problems`); the folders it writes (``output="dir"``) by
:func:`demind.config_checks.check_command_config`; the keys with no rule say why (``free=``).
The training split and captions file are checked by the trainer before the backbone loads
(:func:`demind.exclmm.train.check_run_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.settings import RunSection, device_setting, setting, threads_setting
from demind.schema import BackboneConfig


CONTRASTIVE_FORMS = ("paper", "dot")
QUERY_SPACES = ("sparse", "clip")
IMAGE_MASKS = ("zc_or_top_t", "top_t")
RECONSTRUCT_FROM = ("unmasked", "masked")
TRIPLET_FORMS = ("paper", "gt-vs-positive")
# the two forms as override lists (benchmarks, ablations)
EARLIER_OVERRIDES = ["space.contrastive=dot", "space.image_mask=top_t", "space.reconstruct=masked",
                     "query.contrastive=dot", "query.triplet=gt-vs-positive"]
PAPER_OVERRIDES = ["space.contrastive=paper", "space.image_mask=zc_or_top_t", "space.reconstruct=unmasked",
                   "query.contrastive=paper", "query.triplet=paper"]


@dataclass
class ExclDataConfig:
    train: str = setting("", free="an input folder (ExclCOCO split); its exclcoco.json is checked before the "
                                   "backbone loads", help="ExclCOCO folder of the training split (its exclcoco.json)")
    captions: str = setting("", free="an input file, checked before the backbone loads when given",
                            help="COCO captions file of that split (\"\" = the one exclcoco.json names)")
    cache_dir: str = setting("", output="dir", help="image-feature cache (\"\" = <output_dir>/feature_cache)")
    encode_batch_size: int = setting(256, ge=1, help="images and texts per CLIP forward pass")


@dataclass
class SaeConfig:
    """Stage 1, step 1 (Eq. 2-4): SPINE's defaults (rho 0.15, unit loss weights)."""

    code_dim: int = setting(1000, ge=1, help="d, the sparse width (SPINE: 1000 over 300-d GloVe)")
    steps: int = setting(1000, ge=0, help="optimizer steps (with stop.window > 0: the most steps)")
    batch_size: int = setting(256, ge=1)
    lr: float = setting(1e-3, gt=0)
    rho: float = setting(0.15, gt=0, lt=1, help="target fraction of words each unit fires on (Eq. 3)")
    w_average_sparsity: float = setting(1.0, ge=0)
    w_partial_sparsity: float = setting(1.0, ge=0)


@dataclass
class SpaceConfig:
    """Stage 1, step 3 (Eq. 8-13)."""

    hidden: int = setting(1024, ge=1)
    top_t: int = setting(32, ge=1, help="Top_t of the masks (at most sae.code_dim)")
    zc_mask: bool = True            # False: mask = Top_t only (the "without z_c" ablation)
    # the paper's forms beside the earlier variants (demind/exclmm/__init__.py). The defaults are the
    # earlier variants, chosen on a comparison that under-trained the paper's form at tau = 1
    # (docs/lab-notes/exclmm-held-out.md); not measured against it again since
    contrastive: str = setting("dot", choices=CONTRASTIVE_FORMS,
                               help="Eq. 12: paper = l2-normalised, symmetric; dot = unnormalised dot product")
    image_mask: str = setting("top_t", choices=IMAGE_MASKS,
                              help="Eq. 8 in training: zc_or_top_t = the caption's z_c OR Top_t (paper); "
                                   "top_t = Top_t alone. At retrieval an image has no caption: Top_t alone")
    reconstruct: str = setting("masked", choices=RECONSTRUCT_FROM,
                               help="Eq. 13's decoders read E^d (unmasked, paper) or the masked code")
    steps: int = setting(2000, ge=0, help="optimizer steps (with stop.window > 0: the most steps)")
    batch_size: int = setting(256, ge=1)
    lr: float = setting(1e-3, gt=0)
    tau: float = setting(1.0, gt=0, help="Eq. 12's temperature (the paper: 1)")
    w_reconstruction: float = setting(1.0, ge=0, help="Eq. 13, both decoders")


@dataclass
class QueryConfig:
    """Stage 2 (Eq. 15-17): L = lambda_c * L_c + lambda_t * L_t, lambda_t = 1 - lambda_c unless set.

    The ablation "without L_t" as ``lambda_c=1`` doubles L_c's weight against the default
    (0.5 -> 1, a larger step on L_c); ``lambda_t=0`` drops L_t and keeps L_c's weight."""

    space: str = setting("sparse", choices=QUERY_SPACES,
                         help="sparse: F_theta on stage 1's codes; clip: on CLIP embeddings (the \"without "
                              "stage 1\" ablation; stage 1 is not trained)")
    hidden: int = setting(1024, ge=1)
    steps: int = setting(2000, ge=0, help="optimizer steps (0: stage 1 only; with stop.window > 0: the most steps)")
    batch_size: int = setting(256, ge=1)
    lr: float = setting(1e-3, gt=0)
    lambda_c: float = setting(0.5, ge=0, le=1, help="weight of L_c (Eq. 17); 0 = without L_c")
    lambda_t: float | None = setting(None, ge=0, help="weight of L_t; null = 1 - lambda_c; 0 = without L_t "
                                                      "at L_c's own weight")
    tau: float = setting(1.0, gt=0, help="Eq. 15's temperature in the sparse space (the paper: 1)")
    margin: float = setting(1.0, ge=0, help="gt-vs-positive triplet margin, sparse space (one active "
                                             "dimension's worth)")
    clip_tau: float = setting(0.01, gt=0, help="temperature in the clip space (cosine; CLIP's trained scale 100)")
    clip_margin: float = setting(0.1, ge=0, help="gt-vs-positive triplet margin in the clip space")
    contrastive: str = setting("dot", choices=CONTRASTIVE_FORMS,
                               help="Eq. 15: paper = l2-normalised, symmetric; dot = one direction, dot product")
    triplet: str = setting("gt-vs-positive", choices=TRIPLET_FORMS,
                           help="Eq. 16: paper = max(0, d(ip, exc_cp) - d(ip, exc_cx) + m), cosine distance, the "
                                "positive query encoded; gt-vs-positive = max(0, m - s(q, gt) + s(q, ip))")
    triplet_margin: float = setting(0.2, ge=0, help="m of the paper's Eq. 16 (a cosine distance; the paper "
                                                    "gives no value)")

    def weights(self) -> tuple[float, float]:
        """(weight of L_c, weight of L_t) of Eq. 17."""
        return self.lambda_c, (1.0 - self.lambda_c if self.lambda_t is None else self.lambda_t)


@dataclass
class StopConfig:
    """When a phase stops: after its ``steps``, or earlier once its loss has stopped falling.

    The plateau rule (``window`` W > 0): every W steps the mean of the phase's total loss over
    those W steps is taken; the phase stops when that mean is not below the lowest earlier window
    mean by more than ``tol`` of it (relative), i.e. W more steps bought less than ``tol``. The
    phase's ``steps`` are then a cap. The steps each phase ran are in ``<output_dir>/phases.json``."""

    window: int = setting(0, ge=0, help="plateau window W in steps; 0 = run every phase for exactly its steps")
    tol: float = setting(0.002, ge=0, lt=1, help="relative improvement over the best earlier window below "
                                               "which a phase stops")


@dataclass
class ExclMMRunConfig(RunSection):
    """demind-train-exclmm's ``run`` section."""

    device: str = device_setting("cpu")  # auto, cpu, cuda or cuda:N
    progress: bool = True
    output_dir: str = setting("runs/exclmm", output="dir")
    seed: int = setting(0, ge=0)
    log_every: int = setting(200, ge=1, help="steps per console and metrics.jsonl line")
    save_every: int = setting(500, ge=1, help="steps per resumable state")
    threads: int = threads_setting()


@dataclass
class ExclMMConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    data: ExclDataConfig = field(default_factory=ExclDataConfig)
    sae: SaeConfig = field(default_factory=SaeConfig)
    space: SpaceConfig = field(default_factory=SpaceConfig)
    query: QueryConfig = field(default_factory=QueryConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    run: ExclMMRunConfig = field(default_factory=ExclMMRunConfig)

    def config_problems(self) -> list[tuple[str, str]]:
        """The keys that must agree with each other (ranges and choices are declared per key)."""
        problems = []
        if self.space.top_t > self.sae.code_dim:
            problems.append(("space.top_t", f"= {self.space.top_t} exceeds sae.code_dim = {self.sae.code_dim}: the "
                                            "mask would keep every dimension; lower space.top_t or raise sae.code_dim"))
        if self.space.image_mask == "zc_or_top_t" and not self.space.zc_mask:
            problems.append(("space.image_mask", "= 'zc_or_top_t' needs the caption's z_c, which space.zc_mask=false "
                                                 "turns off; set space.image_mask=top_t or space.zc_mask=true"))
        if self.query.steps > 0 and self.query.weights() == (0.0, 0.0):
            problems.append(("query.lambda_c", "and query.lambda_t are both 0: stage 2 would train on no loss"))
        return problems

