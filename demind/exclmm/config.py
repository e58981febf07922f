"""ExclMM's training recipe (``configs/exclmm/*.yaml``): the sections of :class:`ExclMMConfig`.

Torch-free, so ``demind-train-exclmm --help`` and config checks load no model code; the trainer
(:mod:`demind.exclmm.train`) and every caller import the sections from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.settings import device_setting, setting, threads_setting
from demind.schema import BackboneConfig


CONTRASTIVE_FORMS = ("paper", "dot")
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
    # the paper's forms beside the earlier variants (demind/exclmm/__init__.py). The defaults are the
    # earlier variants: on the exclusion instrument they beat the paper's form on every seed on
    # exclusion AUC and AP@5 (docs/negation.md, "ExclMM on the exclusion instrument")
    contrastive: str = setting("dot", choices=CONTRASTIVE_FORMS,
                               help="Eq. 12: paper = l2-normalised, symmetric; dot = unnormalised dot product")
    image_mask: str = setting("top_t", choices=IMAGE_MASKS,
                              help="Eq. 8 in training: zc_or_top_t = the caption's z_c OR Top_t (paper); "
                                   "top_t = Top_t alone. At retrieval an image has no caption: Top_t alone")
    reconstruct: str = setting("masked", choices=RECONSTRUCT_FROM,
                               help="Eq. 13's decoders read E^d (unmasked, paper) or the masked code")
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
    contrastive: str = setting("dot", choices=CONTRASTIVE_FORMS,
                               help="Eq. 15: paper = l2-normalised, symmetric; dot = one direction, dot product")
    triplet: str = setting("gt-vs-positive", choices=TRIPLET_FORMS,
                           help="Eq. 16: paper = max(0, d(ip, exc_cp) - d(ip, exc_cx) + m), cosine distance, the "
                                "positive query encoded; gt-vs-positive = max(0, m - s(q, gt) + s(q, ip))")
    triplet_margin: float = 0.2     # m of the paper's Eq. 16 (a cosine distance; the paper gives no value)


@dataclass
class ExclRunConfig:
    output_dir: str = "runs/exclmm"
    seed: int = 0
    device: str = device_setting("cpu")  # auto, cpu, cuda or cuda:N
    log_every: int = 200
    save_every: int = 500
    progress: bool = True
    threads: int = threads_setting()


@dataclass
class ExclMMConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    data: ExclDataConfig = field(default_factory=ExclDataConfig)
    sae: SaeConfig = field(default_factory=SaeConfig)
    space: SpaceConfig = field(default_factory=SpaceConfig)
    query: QueryConfig = field(default_factory=QueryConfig)
    run: ExclRunConfig = field(default_factory=ExclRunConfig)
