"""Backbone identity, by content: what makes two frozen CLIPs the same (architecture and weights).

Feature caches, checkpoints and ExclMM exports record the identity of the backbone they were
made with and refuse another one; the identity never depends on a file's name or place.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn


class ModelSpec(Protocol):
    """What an identity reads of a backbone config (:class:`demind.backbone.BackboneConfig`)."""

    name: str
    pretrained: str | None


_FILE_HASHES: dict[tuple[str, int, float], str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, memoised per (path, size, mtime) since checkpoints can be GBs."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime)
    if key not in _FILE_HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        _FILE_HASHES[key] = digest.hexdigest()
    return _FILE_HASHES[key]


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 over a model's parameters and buffers, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def backbone_identity(cfg: ModelSpec, model: nn.Module | None = None) -> dict[str, str | None]:
    """What makes two backbones the same: architecture and weights, by content, never by file name.

    A model-config JSON is identified by its content hash, a local checkpoint by the sha256
    of its bytes (the same weights under another name are the same backbone), a tag by
    itself, and random initialisation by a fingerprint of the weights (``model``).
    """
    name = cfg.name
    if name.endswith(".json"):
        name = f"{Path(name).stem}@{hashlib.sha256(Path(name).read_bytes()).hexdigest()[:12]}"
    pretrained = cfg.pretrained
    if pretrained and Path(pretrained).is_file():
        pretrained = f"sha256:{file_sha256(pretrained)[:16]}"
    elif not pretrained and model is not None:
        pretrained = f"random:{weights_fingerprint(model)[:16]}"
    return {"name": name, "pretrained": pretrained}


_OLD_FILE_IDENTITY = re.compile(r"^file:.*@(sha256:[0-9a-f]+)$")


def canonical_identity(identity: dict[str, str | None]) -> dict[str, str | None]:
    """An identity as :func:`backbone_identity` writes it today; older records named the
    file (``file:NAME@sha256:HEX``), which now reads ``sha256:HEX`` so they still match."""
    out = dict(identity)
    match = _OLD_FILE_IDENTITY.match(str(out.get("pretrained") or ""))
    if match:
        out["pretrained"] = match.group(1)
    return out


def same_backbone(a: dict[str, str | None], b: dict[str, str | None]) -> bool:
    """Whether two recorded identities name the same backbone (architecture + weights)."""
    return canonical_identity(a) == canonical_identity(b)


def identity_slug(identity: dict[str, str | None]) -> str:
    """A short, file-name-safe string for an identity (cache folders, logs)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    readable = "".join(c if c.isalnum() or c in "-_" else "-" for c in str(identity["name"]).split("@")[0])
    return f"{readable}-{digest}"
