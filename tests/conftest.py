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
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig

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


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_backbone) -> Path:
    """A tiny De-MINDS checkpoint on a tiny backbone whose weights live in a file (so every
    process rebuilds the same backbone, and the feature cache may be reused)."""
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig, ModelConfig
    from demind.checkpoint import save_checkpoint
    from demind.model import DeMinds

    folder = tmp_path_factory.mktemp("ckpt")
    weights = folder / "tiny-clip-weights.pt"
    torch.save(tiny_backbone.model.state_dict(), weights)
    backbone = FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(weights)))
    torch.manual_seed(0)
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16, gate_init=0.5), backbone)
    return save_checkpoint(folder / "tiny.safetensors", model)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> Path:
    """The tiny random LLaVA-NeXT folder (:func:`demind.engines.tiny_llava.build_tiny_llava_next`), built once;
    read only (a test that changes a model folder copies it first)."""
    from demind.engines.tiny_llava import build_tiny_llava_next

    return build_tiny_llava_next(tmp_path_factory.mktemp("tiny-llava-next"))
