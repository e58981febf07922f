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
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

from demind.backbone import quiet_random_init_notice
from demind.text_tower import run_text_transformer
from demind.config import ConfigError

from . import towers  # noqa: F401  (registers the convnet with timm before open_clip builds it)
from .clip_config import OBJECT_TAGS, TAG_VALUES, ToyBackboneConfig, model_config_path
from .world import Scene

logger = logging.getLogger(__name__)


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
