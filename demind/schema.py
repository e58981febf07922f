"""The config sections of the library's torch-bound objects, importable without torch.

``--help`` of every command lists these keys, and a config is checked against their rules, before
any model code loads: :class:`BackboneConfig` (``backbone``), :class:`ModelConfig` (``model``),
:class:`DataConfig` (``data``) and :class:`NoiseConfig` (``training.noise``). Callers import each
from here; the modules that use them (:mod:`demind.backbone`, :mod:`demind.model`,
:mod:`demind.data`, :mod:`demind.robust`) do too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from demind.settings import setting
from demind.targets import TargetSampling
from demind.templates import PLACEHOLDER, TEMPLATES, TemplateError, template_field

# open_clip's precision names (demind.backbone.PRECISIONS maps each to its autocast dtype)
PRECISION_NAMES = ("fp32", "fp16", "bf16", "pure_fp16", "pure_bf16", "amp", "amp_bf16", "amp_bfloat16")

GFQ_PAIRINGS = 4   # K (demind.fidelity: GFQ's random pairings of the noise boundary)
GFQ_THRESHOLD = 0.5  # omega
NOISE_MODES = ("none", "filter", "downweight", "conesep")
MISSING_TEXT_CHOICES = ("error", "original")
SCHEDULES = ("cosine", "constant")  # the learning rate after the warm-up (demind.trainkit.optim)
# Backbone settings that change how fast, not what, the frozen CLIP computes: a run may
# resume with other values (and checkpoints written before a key existed still resume).
SPEED_ONLY_KEYS = frozenset({"backbone.text_buckets", "backbone.grad_checkpointing"})


@dataclass
class BackboneConfig:
    """Which CLIP to load.

    name: an open_clip model name (``ViT-L-14``) or the path of an open_clip model-config
        JSON (``configs/model/tiny-clip.json``) for custom architectures.
    pretrained: an open_clip pretrained tag (``openai``), the path of a local checkpoint
        file, or ``None`` for random initialisation (tests, toy worlds).
    text_buckets: the texts of a batch are sorted by length and run through the text
        transformer in up to this many groups, each cut after its own longest text, when
        that saves at least 30 % of the padded positions. Exact under CLIP's causal mask;
        1 pads every text to the batch's longest.
    seed: the seed of a random initialisation (``pretrained: null``): the same config gives
        the same weights in training, feature caching and evaluation, so a smoke checkpoint
        trained on a random backbone evaluates on a rebuilt one.
    precision: open_clip's precision names. ``fp32``; ``fp16`` / ``bf16`` (weights in half
        precision, LayerNorms as open_clip keeps them); ``pure_fp16`` / ``pure_bf16`` (every
        weight in half precision); ``amp`` / ``amp_bf16`` (fp32 weights, the towers run under
        fp16 / bf16 autocast). Inputs are cast to the tower's dtype; outputs are float32.
    """

    name: str = setting("ViT-L-14", refuses="configs/model/no-such-model.json")
    pretrained: str | None = setting("openai", refuses="weights/no-such-checkpoint.pt")
    precision: str = setting("fp32", choices=PRECISION_NAMES)
    grad_checkpointing: bool = False
    text_buckets: int = setting(4, ge=1)
    seed: int = setting(0, ge=0)

    def input_problems(self) -> list[tuple[str, str]]:
        """The files this config names exist (a model name or a tag is open_clip's to resolve, when the
        backbone loads): checked with the command's config (:func:`demind.config_checks.check_command_config`),
        before any model loads; not when a config is only parsed (a documented recipe names files that an
        earlier step writes)."""
        problems = []
        if self.name.endswith(".json") and not Path(self.name).is_file():
            problems.append(("name", f"= {self.name!r}: backbone model config {self.name} does not exist; give an "
                                     f"open_clip model name (see open_clip.list_models()) or the path of a "
                                     f"model-config JSON"))
        if pretrained_names_a_file(self.pretrained) and not Path(self.pretrained).exists():
            problems.append(("pretrained", f"= {self.pretrained!r}: backbone checkpoint {self.pretrained} does not "
                                           f"exist; give an existing file or an open_clip pretrained tag"))
        return problems


RANDOM_TAGS = ("none", "random", "null")  # NAME:none in a --backbone spec: random weights (smoke tests)


def pretrained_names_a_file(pretrained: str | None) -> bool:
    """Whether ``backbone.pretrained`` is meant as a local file (a path or a weights file name), not an
    open_clip tag or a Hub reference."""
    return bool(pretrained) and not pretrained.startswith("hf-hub:") and (
        "/" in pretrained or pretrained.endswith((".pt", ".pth", ".bin", ".safetensors")))


FUSIONS = ("gate", "add", "intent_only")
# How the refined queries X^n enter the frozen text tower: as the blocks leave them (the paper does
# not say), or each rescaled to the mean norm of the token-embedding table (the scale the tower's
# first layer was trained on), keeping its direction.
QUERY_SCALES = ("none", "token_norm")


@dataclass
class ModelConfig:
    """De-MINDS hyper-parameters (paper defaults). ``fusion`` selects the Table 5 ablations:
    ``gate`` (the method), ``add`` (w/o gate: t_cls + t*), ``intent_only`` (w/o global feature: t*)."""

    num_queries: int = setting(4, ge=1)
    num_blocks: int = setting(6, ge=1)
    num_heads: int = setting(8, ge=1)  # must divide the backbone's text width (checked with the backbone)
    ff_mult: int = setting(4, ge=1)
    mapping_hidden: int = setting(512, ge=1)
    mapping_dropout: float = setting(0.1, ge=0, lt=1)
    gate_init: float = setting(0.0, free="any real: the gate's value before tanh (0: closed at the start)")
    fusion: str = setting("gate", choices=FUSIONS)
    template: str = setting(TEMPLATES["cirr"], refuses="a photo of {text}", help="training prompt: one '*' and '{text}'")
    learnable_temperature: bool = False
    init_logit_scale: float = setting(math.log(100.0), free="any real: log of the inverse temperature (CLIP's "
                                                             "trained 100); used unless learnable")
    # ConeSep's NBL (training.noise.mode=conesep): learnable negative prompt tokens; 0 = none.
    # Used in training only; queries never read them.
    negative_tokens: int = setting(0, ge=0)
    query_scale: str = setting("none", choices=QUERY_SCALES)

    def config_problems(self) -> list[tuple[str, str]]:
        try:
            ok = template_field(self.template) == "text"
        except TemplateError:
            ok = False
        if not ok:
            return [("template", f"= {self.template!r} must hold one {PLACEHOLDER!r} and '{{text}}' (no other "
                                 f"fields, format specs or conversions)")]
        return []


def heads_problem(num_heads: int, width: int) -> str | None:
    """Why ``num_heads`` cannot split the text width W into equal heads (None when it can): the one
    wording of the rule, read by TrainConfig at load and by DeMinds for a config built in code."""
    if num_heads >= 1 and width % num_heads == 0:
        return None
    divisors = [d for d in (1, 2, 4, 8, 16, 32) if width % d == 0]
    return f"= {num_heads} must divide the backbone's text width {width}; choose one of {divisors}"


@dataclass
class DataConfig:
    """Where the intent shards are and how they are streamed."""

    shards: str = setting("shards/cc3m", free="a folder, brace pattern or hf-hub: reference; resolved (a missing "
                                             "shard named) before the backbone loads")
    """A folder of ``*.tar`` files, or a brace pattern such as
    ``shards/cc3m/{00000..00331}.tar`` (several patterns joined by ``::``)."""
    features: str | None = setting("auto", free="auto, none or a folder; a folder that lacks a shard is "
                                                 "refused naming it")
    """Frozen-feature cache folder.  ``auto``: ``<shard folder>/features/<backbone>``,
    used when it holds every shard; a path: must hold every shard; null or none: never
    (see demind.features.features_off)."""
    shuffle_buffer: int = setting(1000, ge=1)
    shards_per_group: int = setting(4, ge=1)
    resample: bool = True
    """Draw shard groups with replacement (endless, the usual multi-epoch setting);
    false walks the shards epoch by epoch, each epoch a fresh permutation."""
    num_workers: int = setting(4, ge=0)
    missing_text: str = setting("error", choices=MISSING_TEXT_CHOICES)
    """What a sample without ``rew.txt``/``int.txt`` does: ``error`` stops with the
    shard's name; ``original`` uses the original caption instead and counts it."""
    targets: TargetSampling = field(default_factory=TargetSampling)
    cache_batch_size: int = setting(256, ge=1)
    cache_dtype: str = setting("float32", choices=("float32", "float16", "bfloat16"))


@dataclass
class NoiseConfig:
    """``training.noise``: how the trainer treats descriptions GFQ scores as noisy (see the module docstring)."""

    mode: str = setting("none", choices=NOISE_MODES)
    omega: float = setting(GFQ_THRESHOLD, gt=0, lt=1)  # F below omega: noisy
    pairings: int = setting(GFQ_PAIRINGS, ge=1)  # K random pairings of GFQ's noise boundary (per batch)
    gamma: float = setting(0.7, ge=0, le=1)  # soft labels Y = gamma P* + (1 - gamma) L
    kappa: float = setting(0.5, ge=0)  # weight of L_ul
    zeta: float = setting(0.5, ge=0)  # weight of L_intra
    nu: float = setting(0.5, ge=0)  # weight of the orthogonality hinge inside L_intra
    warmup_steps: int = setting(0, ge=0)  # optimizer steps before L_ul joins
    sinkhorn_reg: float = setting(0.05, gt=0)  # entropic regularisation of the OT (costs lie in [0, 2])
    sinkhorn_iters: int = setting(1000, ge=1)

    def config_problems(self) -> list[tuple[str, str]]:
        """conesep's OT solver is POT (an optional dependency): missing, it is named at load time,
        not after the warm-up."""
        import importlib.util

        if self.mode == "conesep" and importlib.util.find_spec("ot") is None:
            return [("mode", "= 'conesep' needs POT for the Sinkhorn solver: pip install pot "
                             "(or pip install -e '.[robust]')")]
        return []


COMBINER_ARCHITECTURE = "combiner"


@dataclass
class CombinerConfig:
    """The combiner's sizes (:mod:`demind.combiner`; trained on triplets by :mod:`demind.triplets`)."""

    architecture: str = setting(COMBINER_ARCHITECTURE, choices=(COMBINER_ARCHITECTURE,), help="fixed: tells checkpoints apart")
    embed_dim: int = setting(0, ge=0, help="feature size D (0: the backbone's)")
    projection_dim: int = setting(256, ge=1, help="P, each modality's projection")
    hidden_dim: int = setting(512, ge=1, help="H, the mixing MLP's width")
    dropout: float = setting(0.1, ge=0.0, lt=1.0, help="dropout after the projections and the mixing layer")
