"""The toy world's "web-trained CLIP": its recipe, the model and the tensors it reads.

One recipe (:class:`ToyBackboneConfig`): the full-resolution convnet of :mod:`toyworld.towers`
(``toyworld/model_configs/toy-clip-cnn-text2.json``) with a 2-layer text tower, the image tower
pre-trained on the scene's ground-truth tags and then locked while ClipLoss trains the text tower
(LiT), on random web pairs plus hard-negative groups. Training: :mod:`toyworld.clip_train`;
evaluation: :mod:`toyworld.clip_eval`; the cached weights: :mod:`toyworld.clip_cache`. The weights
are a plain open_clip state dict, so

    FrozenCLIP(BackboneConfig(name=TOY_CLIP_CONFIG, pretrained=str(path)))

(or ``open_clip.create_model(..., pretrained=path)`` after ``import toyworld.towers``) loads them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

from demind.backbone import quiet_random_init_notice, run_text_transformer
from demind.config import ConfigError, setting, validate
from demind.errors import MissingInputError

from . import towers  # noqa: F401  (registers the convnet with timm before open_clip builds it)
from .world import BACKGROUNDS, COLOURS, EDIT_KINDS, POSITIONS, SHAPES, SIZES, STYLES, THEME_BACKGROUNDS, Scene

logger = logging.getLogger(__name__)

# the toy CLIP's open_clip model config, relative to the repository root (resolved from there when
# the current folder is elsewhere: model_config_path)
TOY_CLIP_CONFIG = "toyworld/model_configs/toy-clip-cnn-text2.json"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


# the scene's ground-truth tags the image tower's pre-training predicts -> their values (the tag
# head's classes): object attributes (a scene sets the bit of every value its objects hold) and
# scene attributes (one bit)
OBJECT_TAGS = {"shape": SHAPES, "colour": COLOURS, "size": SIZES, "position": POSITIONS}
SCENE_TAGS = {"background": BACKGROUNDS + THEME_BACKGROUNDS, "style": STYLES}
TAG_VALUES = {**OBJECT_TAGS, **SCENE_TAGS}


@dataclass
class ToyBackboneConfig:
    """Training recipe of the toy CLIP (defaults sized for the CPU quickstart)."""

    # The full-resolution convnet (toyworld/towers.py) with a 2-layer text tower, pre-trained on the
    # scene's tags, then locked: chosen on the pair probes among ten measured candidates (lab notes)
    model_config: str = TOY_CLIP_CONFIG
    seed: int = 0
    # 1,000 steps: 400 left the toy CLIP at held-out R@1 5 % (full descriptions), 1,000 gave 42 %.
    steps: int = setting(1000, ge=1)
    batch_size: int = setting(128, ge=2)  # contrastive: at least one negative
    lr: float = setting(1e-3, gt=0)
    weight_decay: float = setting(0.1, ge=0)
    warmup_steps: int = setting(100, ge=0)
    num_train_images: int = setting(8000, ge=1)   # rendered once; each step draws fresh texts for them
    # Hard-negative groups: this share of every batch is made of groups, each one scene photographed
    # 1 + len(group_edits) times with the same nuisances, every other member edited in one attribute,
    # each captioned with its full description (the only text that tells the members apart).
    # 0 = random batches only.
    group_share: float = setting(0.5, ge=0, le=1)
    group_edits: tuple[str, ...] = setting(("shape", "size", "position"), choices=EDIT_KINDS)
    num_group_scenes: int = setting(2000, ge=1)  # groups rendered once, like the random pool
    # Image-tower pre-training: before the contrastive `steps`, `pretrain_steps` steps train the image
    # tower alone, with a linear tag head (discarded), to predict the scene's ground-truth tags:
    # `pretrain_first_tags` only for the first `pretrain_first_steps` steps (shape first: asked for
    # every tag from the start, the easy ones starve it), then `pretrain_tags`. Batches of random web
    # images, constant lr. 0 = none. The contrastive stage then keeps the image tower as it is (LiT,
    # Zhai et al. 2022: the training images are embedded once) and trains the text tower and the scale.
    pretrain_steps: int = setting(1000, ge=0)
    pretrain_tags: tuple[str, ...] = setting(("shape", "colour", "size", "background", "style"),
                                             choices=tuple(TAG_VALUES))
    pretrain_first_tags: tuple[str, ...] = setting(("shape",), choices=tuple(TAG_VALUES))
    pretrain_first_steps: int = setting(500, ge=0)
    num_eval_scenes: int = setting(1000, ge=1)
    # pair probes (toyworld/probes.py): evaluation only, so not part of the cache key
    num_pair_probe_scenes: int = setting(600, ge=1)
    fused_adamw: bool = True       # same update, one kernel (optimizer step 33 -> 7.6 ms: benchmarks/bench_toy.py)
    log_every: int = setting(50, ge=1)
    # The modality gap (toyworld.clip.add_modality_gap): text embeddings get one more dimension, held
    # at this constant, that images never use, so a caption's cosines to all images crowd into a
    # narrow band as real CLIP's do. Applied to the trained weights, so not part of the cache key.
    # 0: the toy CLIP as trained. 50: calibrated on the toy CIRR's baselines (lab notes).
    modality_gap: float = setting(50.0, ge=0)
    # use the weights shipped in toyworld/weights/ when this recipe has them (toyworld/shipped.py: the
    # default recipe's trained weights, checked bit for bit); false trains from scratch. Not in the key.
    shipped: bool = True

    def config_problems(self) -> list[tuple[str, str]]:
        """The rules that involve several fields (each field's own rule is declared with setting())."""
        problems = []
        if not set(self.pretrain_first_tags) <= set(self.pretrain_tags):
            problems.append(("pretrain_first_tags", f"= {list(self.pretrain_first_tags)} must be among pretrain_tags "
                                                    f"= {list(self.pretrain_tags)} (they share one tag head)"))
        if self.pretrain_steps and self.pretrain_first_steps > self.pretrain_steps:
            problems.append(("pretrain_first_steps", f"= {self.pretrain_first_steps} is more than pretrain_steps "
                                                     f"= {self.pretrain_steps}"))
        if self.pretrain_steps and not self.pretrain_tags:
            problems.append(("pretrain_tags", "is empty, but pretrain_steps > 0 needs at least one tag"))
        return problems

    def __post_init__(self) -> None:
        validate(self)  # built in code by the quickstart and the benchmarks: the rules a loaded config meets


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


def model_config_path(model_config: str | Path) -> Path:
    """The absolute path of a model-config JSON: as given (from the current folder), else the
    shipped one of that repository-relative name (``toyworld/model_configs/...``), so the toy
    commands and the checkpoints that record the path work from any folder."""
    path = Path(model_config)
    for candidate in (path, PACKAGE_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    raise MissingInputError(f"toy model config {path} does not exist (expected an open_clip model JSON)")


def model_name(model_config: str | Path) -> str:
    """Register a model-config JSON with open_clip and return the name to create it by."""
    path = model_config_path(model_config)
    open_clip.add_model_config(path)
    return path.stem


def images_to_tensor(images: np.ndarray) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float, normalised as open_clip's preprocess does."""
    x = torch.from_numpy(np.array(images, dtype=np.uint8)).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def build_toy_model(cfg: ToyBackboneConfig) -> tuple[torch.nn.Module, Any, int]:
    """(model, tokenizer, image size) for the config, randomly initialised."""
    name = model_name(cfg.model_config)
    with quiet_random_init_notice():  # a random start is what is asked for: no warning
        model = open_clip.create_model(name, pretrained=None)
    return model, open_clip.get_tokenizer(name), image_side(model)


def image_side(model: torch.nn.Module) -> int:
    size = model.visual.image_size  # (H, W) for a ViT, an int for open_clip's ModifiedResNet
    return size[0] if isinstance(size, (tuple, list)) else int(size)


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


@torch.no_grad()
def encode_toy_images(model: torch.nn.Module, images: np.ndarray, batch: int = 250) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, D) L2-normalised image embeddings."""
    model.eval()
    return torch.cat([model.encode_image(images_to_tensor(images[i:i + batch]), normalize=True)
                      for i in range(0, len(images), batch)])



def gap_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The open_clip model config of :func:`add_modality_gap`'s state: ``embed_dim`` + 1 and a text
    projection with bias."""
    out = json.loads(json.dumps(config))
    out["embed_dim"] = config["embed_dim"] + 1
    out["text_cfg"]["proj_bias"] = True
    return out


def add_modality_gap(state: dict[str, torch.Tensor], gap: float) -> dict[str, torch.Tensor]:
    """The trained toy CLIP's state dict, extended by one embedding dimension (the modality gap).

    Image embedding (D,) -> [e, 0]; text embedding x P (D,) -> [x P, gap]: the text projection
    (W, D) becomes a Linear (D + 1, W) with bias (0, ..., 0, gap), the image projection gets a zero
    output (a zero row of the convnet head's (D, C) Linear, a zero column of a ViT's (W, D) ``proj``).
    Each text's norm then scales all its cosines to images by k = |x P| / sqrt(|x P|^2 + gap^2),
    so every text->image ranking, every image-image similarity and every pair probe (two images, one
    text) are unchanged, while the spread of a caption's cosines to images shrinks by k and
    text-text cosines crowd toward 1: the two-cone geometry of real CLIP (Liang et al., "Mind the
    Gap", 2022).
    """
    out = dict(state)
    proj = out.pop("text_projection")                                  # (W, D)
    width, dim = proj.shape
    out["text_projection.weight"] = torch.cat([proj.T, proj.new_zeros(1, width)])   # (D + 1, W)
    out["text_projection.bias"] = torch.cat([proj.new_zeros(dim), proj.new_full((1,), float(gap))])
    if "visual.head.proj.weight" in out:                               # timm tower: Linear (D, C)
        head = out["visual.head.proj.weight"]
        out["visual.head.proj.weight"] = torch.cat([head, head.new_zeros(1, head.shape[1])])
    elif "visual.proj" in out:                                         # ViT: (W, D)
        head = out["visual.proj"]
        out["visual.proj"] = torch.cat([head, head.new_zeros(head.shape[0], 1)], dim=1)
    else:
        raise ConfigError("backbone.modality_gap needs an image tower whose output projection is a timm head "
                          "(visual.head.proj) or a ViT's visual.proj; this toy model has neither: set "
                          "backbone.modality_gap=0")
    return out
