"""The default toy CLIP's trained weights, shipped with the package in under 2 MB.

Training the default toy CLIP is most of the quickstart's time (about 9 of its 12.5 minutes on two
cores). The trained weights ship in a compact form: every tensor except the token embedding, plus
the token-embedding rows that training changed (167 of 49,408). The other rows belong to tokens the
toy world never writes: they get no gradient and no weight decay (the engine's no-decay rule covers
embeddings), so AdamW leaves them exactly at their random initialisation, which
``torch.manual_seed(seed)`` and :func:`toyworld.clip.build_toy_model` draw again.

The expanded weights must equal the trained ones bit for bit: the file records their digest
(:func:`demind.tensor_files.tensors_sha256`) and :func:`expand_shipped` checks it. Where it does not
match (another torch version drawing other initial values, a damaged file) the quickstart trains the
toy CLIP as before, with one log line saying why. A recipe that is not the default has another cache
key, finds no shipped file and is trained.

``demind-toy-clip`` trains the default recipe from scratch (``backbone.shipped=false``) and writes
the file again: ``toyworld/weights/<model config stem>-<cache key>.safetensors``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from demind.errors import DemindError
from demind.io import atomic_path
from demind.tensor_files import read_format_metadata, tensors_sha256

from .clip import build_toy_model
from toyworld.clip_config import ToyBackboneConfig

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
FORMAT = "demind-toy-clip-shipped/1"
EMBEDDING = "token_embedding.weight"


class ShippedWeightsError(DemindError, ValueError):
    """A shipped weights file that does not expand to the weights it records."""


def shipped_path(stem: str, directory: Path | None = None) -> Path:
    """Where the shipped weights of the cache entry ``stem`` (``<config stem>-<cache key>``) live
    (``directory``: default :data:`SHIPPED_DIR`, looked up at call time)."""
    return (directory or SHIPPED_DIR) / f"{stem}.safetensors"


def initial_state(cfg: ToyBackboneConfig) -> dict[str, torch.Tensor]:
    """The random initialisation the trainer starts from (same seed, same model build)."""
    torch.manual_seed(cfg.seed)
    model, _, _ = build_toy_model(cfg)
    return model.state_dict()


def pack(trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], log: dict[str, Any],
         path: Path) -> Path:
    """Write the compact form of ``trained``: all tensors but the token embedding, and the rows of
    it (ids in ``token_embedding.rows``) that differ from ``initial``; ``log`` is the training log."""
    changed = (trained[EMBEDDING] != initial[EMBEDDING]).any(dim=1).nonzero().flatten()
    tensors = {k: v.contiguous() for k, v in trained.items() if k != EMBEDDING}
    tensors["token_embedding.rows"] = changed.to(torch.int64)
    tensors["token_embedding.values"] = trained[EMBEDDING][changed].contiguous()
    metadata = {"format": FORMAT, "weights_sha256": tensors_sha256(trained), "log": json.dumps(log)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


def expand_shipped(path: Path, cfg: ToyBackboneConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the full trained state dict, the training log) from a shipped file; raises
    :class:`ShippedWeightsError` when the result is not the recorded weights."""
    meta = read_format_metadata(path, FORMAT, ShippedWeightsError, "shipped toy CLIP weights")
    try:
        compact = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ShippedWeightsError(f"shipped toy CLIP weights {path} are damaged ({e})") from None
    state = initial_state(cfg)
    rows, values = compact.pop("token_embedding.rows"), compact.pop("token_embedding.values")
    state[EMBEDDING][rows] = values
    state.update(compact)
    if tensors_sha256(state) != meta["weights_sha256"]:
        raise ShippedWeightsError(f"{path} does not expand to the weights it records (torch "
                                  f"{torch.__version__} may draw other initial values)")
    return state, json.loads(meta["log"])
