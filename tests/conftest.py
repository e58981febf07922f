"""Shared fixtures: a tiny random open_clip backbone built from configs/model/tiny-clip.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CLIP = REPO_ROOT / "configs" / "model" / "tiny-clip.json"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_backbone():
    from demind.backbone import BackboneConfig, FrozenCLIP

    torch.manual_seed(0)
    return FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None))
