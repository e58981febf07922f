"""Shared fixtures: a tiny random open_clip backbone built from ``helpers.TINY_CLIP``
(configs/model/tiny-clip.json); constants and plain builders live in ``tests/helpers.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import REPO_ROOT, TINY_CLIP


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_backbone():
    from demind.backbone import BackboneConfig, FrozenCLIP

    torch.manual_seed(0)
    return FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None))


@pytest.fixture()
def one_thread_and_fresh_accelerator():
    """One torch thread (on 2 shared cores OpenMP spinning made 2 threads ~30x slower),
    and a fresh Accelerate singleton per test (each run may choose its own precision)."""
    from accelerate.state import AcceleratorState, GradientState

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
