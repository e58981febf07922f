"""De-MINDS checkpoints: trainable weights only (safetensors), config and backbone identity.

The frozen backbone is never saved (ViT-L-14 is 1.7 GB and unchanged); the checkpoint
records which backbone it was trained on, and loading onto another one is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from demind.backbone import BackboneConfig, FrozenCLIP
from demind.config import from_dict, to_dict
from demind.model import DeMinds, ModelConfig
from demind.io import atomic_path

FORMAT = "demind-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked."""


def save_checkpoint(path: str | Path, model: DeMinds) -> Path:
    """Write ``model``'s trainable weights and metadata to ``path`` (tmp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    metadata = {
        "format": FORMAT,
        "model_config": json.dumps(to_dict(model.cfg)),
        "backbone_identity": json.dumps(model.backbone.identity),
        "backbone_config": json.dumps(to_dict(model.backbone.cfg)),
    }
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)
    return path


def read_checkpoint_metadata(path: str | Path) -> dict:
    """The checkpoint's metadata, decoded: format, model_config, backbone_identity, backbone_config."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint {path} is not a readable safetensors file: {e}") from None
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a De-MINDS checkpoint (format {raw.get('format')!r}, expected {FORMAT!r})")
    return {k: (json.loads(v) if k != "format" else v) for k, v in raw.items()}


def checkpoint_backbone_config(path: str | Path) -> BackboneConfig:
    """The backbone config the checkpoint was trained with (to rebuild it for evaluation)."""
    return from_dict(BackboneConfig, read_checkpoint_metadata(path)["backbone_config"])


def load_checkpoint(path: str | Path, backbone: FrozenCLIP) -> DeMinds:
    """Rebuild the model saved at ``path`` on ``backbone``; the backbone must be the one it was trained on."""
    meta = read_checkpoint_metadata(path)
    if meta["backbone_identity"] != backbone.identity:
        raise CheckpointError(
            f"checkpoint {path} was trained on backbone {meta['backbone_identity']}, "
            f"but the loaded backbone is {backbone.identity}; load the backbone it was trained on"
        )
    model = DeMinds(from_dict(ModelConfig, meta["model_config"]), backbone)
    model.load_state_dict(load_file(str(path)))
    return model.to(backbone.device).eval()
