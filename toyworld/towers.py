"""Image towers of our own, registered with timm so that open_clip's timm adapter builds them.

An open_clip model config names one with ``"timm_model_name": "demind_toy_convnet"``;
importing this module registers it, after which ``open_clip.create_model`` builds it like any
timm model. demind's loaders import it on demand: this package declares it in the
``demind.plugins`` entry-point group (``pyproject.toml``; :mod:`demind.plugins`). A user loading
such weights with plain open_clip imports ``toyworld.towers`` first.

``demind_toy_convnet`` is the toy CLIP's image tower: a plain full-resolution convnet whose
global pooling is chosen by open_clip's ``timm_pool`` (``max`` for the toy CLIP). It exists
because, in a supervised shape proxy (lab notes), CLIP's ModifiedResNet, a patch-8 ViT and
strided timm ByobNets did not start to learn which shapes an image holds within 500 steps,
while this design did.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import ConvNormAct, SelectAdaptivePool2d
from timm.models import register_model

from demind.errors import InputError

TOY_CONVNET = "demind_toy_convnet"


class ToyConvNet(nn.Module):
    """Conv-BN-ReLU stages with 2x2 max-pool downsampling, first two convs at full resolution.

    (B, 3, H, W) -> (B, num_features) after global pooling (``global_pool``: timm's names,
    ``max`` / ``avg`` / ``avgmax`` ...). Widths: ``width`` at H, W; 2 ``width`` at H/2 and
    H/4; 4 ``width`` at H/8. A 14-pixel object (the toy world's small size at 64 px) is
    seen by 3x3 convs at full resolution before any pooling discards where its edges are.
    """

    def __init__(self, width: int = 16, num_classes: int = 0, global_pool: str = "max", in_chans: int = 3,
                 **_: object) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            ConvNormAct(in_chans, w, 3), ConvNormAct(w, w, 3), nn.MaxPool2d(2),
            ConvNormAct(w, 2 * w, 3), nn.MaxPool2d(2),
            ConvNormAct(2 * w, 2 * w, 3), nn.MaxPool2d(2),
            ConvNormAct(2 * w, 4 * w, 3),
        )
        self.num_features = 4 * w
        self.default_cfg = {"pool_size": None}  # open_clip's adapter reads it (attention pooling only)
        self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=True)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        # channels-last convolutions: forward + backward of a 64-px batch of 128 on 2 CPU threads
        # 315 ms against 453-526 (one script run, benchmarks/bench_channels_last.py; PyTorch follows the
        # weight's layout). load_state_dict copies into these tensors, so a loaded tower keeps it
        self.to(memory_format=torch.channels_last)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """timm's interface: a new head (0 = none) and, if given, a new global pooling."""
        if global_pool is not None:
            self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=True)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's interface; open_clip calls it with False on every load. Four convs need none."""
        if enable:
            raise NotImplementedError(f"{TOY_CONVNET} has no gradient checkpointing")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, num_features), or (B, num_classes) with a head."""
        return self.head(self.global_pool(self.features(x)))


@register_model
def demind_toy_convnet(pretrained: bool = False, **kwargs: object) -> ToyConvNet:
    """The toy CLIP's convnet (no pretrained weights exist: it is trained from scratch)."""
    if pretrained:
        raise InputError(f"{TOY_CONVNET} has no pretrained weights; train the toy CLIP instead")
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):  # timm's factory extras
        kwargs.pop(key, None)
    return ToyConvNet(**kwargs)
