"""Backbone identity, by content: what makes two frozen CLIPs the same (architecture and weights).

Feature caches, checkpoints and ExclMM exports record the identity of the backbone they were
made with and refuse another one; the identity never depends on a file's name or place.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Protocol

import open_clip
import torch
import torch.nn as nn

from demind.io import file_version

logger = logging.getLogger(__name__)


class ModelSpec(Protocol):
    """What an identity reads of a backbone config (:class:`demind.schema.BackboneConfig`)."""

    name: str
    pretrained: str | None


_FILE_HASHES: dict[tuple[str, str], str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, memoised per path and :func:`demind.io.file_version` since checkpoints can be GBs."""
    path = Path(path)
    key = (str(path.resolve()), file_version(path.stat()))
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


ACTIVATIONS = ("gelu", "quick_gelu")


def tag_activation(model_name: str, tag: str | None) -> str | None:
    """The activation an open_clip pretrained tag's weights were trained with (``quick_gelu`` or
    ``gelu``); None when ``tag`` is not a pretrained tag of ``model_name`` (a file, random init).

    open_clip marks such tags with ``quick_gelu`` in their pretrained config (from 2.29 on; it
    then builds the *model config's* activation and only warns on a mismatch). Releases before
    that do not mark them: there the QuickGELU tags are the ones listed under the model's
    ``-quickgelu`` name, and ``openai`` weights went through a loader that always built QuickGELU.
    """
    if not tag:
        return None
    pretrained_cfg = open_clip.get_pretrained_cfg(model_name, tag)
    if not pretrained_cfg:
        return None
    if "quick_gelu" in pretrained_cfg:
        return "quick_gelu" if pretrained_cfg["quick_gelu"] else "gelu"
    quick = (tag.lower() == "openai" or model_name.endswith("-quickgelu")
             or open_clip.is_pretrained_cfg(f"{model_name}-quickgelu", tag))
    return "quick_gelu" if quick else "gelu"


def config_activation(model_cfg: dict | None) -> str:
    """The activation an open_clip model config builds (its ``quick_gelu`` field)."""
    return "quick_gelu" if (model_cfg or {}).get("quick_gelu", False) else "gelu"


def implied_activation(name: str, pretrained: str | None) -> str | None:
    """The activation an identity's name and pretrained field imply, for records written before
    the activation was part of the identity; None when the record itself pins it (a model-config
    JSON is identified by its content hash, which covers its ``quick_gelu`` field)."""
    if "@" in name:
        return None
    if pretrained and not pretrained.startswith(("sha256:", "random:")):
        activation = tag_activation(name, pretrained)
        if activation is not None:
            return activation
    model_cfg = open_clip.get_model_config(name)
    return config_activation(model_cfg) if model_cfg else None


def model_config_digest(data: bytes) -> str:
    """``SHA256[:12]`` of a model-config JSON's bytes, the one definition of that hash."""
    return hashlib.sha256(data).hexdigest()[:12]


def model_config_tag(path: str | Path) -> str:
    """``@SHA256[:12]`` of a model-config JSON's bytes: a backbone identity names such a config
    ``STEM@SHA256[:12]`` (:func:`backbone_identity`), so an edited file is another backbone."""
    return "@" + model_config_digest(Path(path).read_bytes())


def backbone_identity(cfg: ModelSpec, model: nn.Module | None = None,
                      activation: str | None = None) -> dict[str, str | None]:
    """What makes two backbones the same: architecture and weights, by content, never by file name.

    A model-config JSON is identified by its content hash, a local checkpoint by the sha256
    of its bytes (the same weights under another name are the same backbone), a tag by
    itself, and random initialisation by a fingerprint of the weights (``model``).
    ``activation`` (``gelu`` / ``quick_gelu``, what the towers were built with) is recorded
    too: OpenAI's weights under GELU load without error and give wrong features.
    """
    name = cfg.name
    if name.endswith(".json"):
        name = Path(name).stem + model_config_tag(name)
    pretrained = cfg.pretrained
    if pretrained and Path(pretrained).is_file():
        pretrained = f"sha256:{file_sha256(pretrained)[:16]}"
    elif not pretrained and model is not None:
        pretrained = f"random:{weights_fingerprint(model)[:16]}"
    identity = {"name": name, "pretrained": pretrained}
    if activation is not None:
        identity["activation"] = activation
    return identity


_OLD_FILE_IDENTITY = re.compile(r"^file:.*@(sha256:[0-9a-f]+)$")


def canonical_identity(identity: dict[str, str | None]) -> dict[str, str | None]:
    """An identity as :func:`backbone_identity` writes it today; older records named the
    file (``file:NAME@sha256:HEX``), which now reads ``sha256:HEX`` so they still match.

    Records written before the activation was recorded have none: they read as the activation
    their name and tag imply (:func:`implied_activation`). That is what the tag's weights were
    trained with and what this version builds, so checkpoints and caches of those versions keep
    loading; a record that *says* another activation is refused. (Earlier versions on open_clip
    >= 2.29 built GELU for QuickGELU tags; an old record cannot say which it ran, and refusing
    them all would also refuse those made on older open_clip, which were right.)
    """
    out = dict(identity)
    match = _OLD_FILE_IDENTITY.match(str(out.get("pretrained") or ""))
    if match:
        out["pretrained"] = match.group(1)
    if "activation" not in out and out.get("name"):
        activation = implied_activation(str(out["name"]), out.get("pretrained"))
        if activation is not None:
            out["activation"] = activation
            _warn_if_ambiguous(str(out["name"]), out.get("pretrained"), activation)
    return out


@functools.lru_cache(maxsize=None)  # once per backbone and process: records are compared often
def _warn_if_ambiguous(name: str, pretrained: str | None, activation: str) -> None:
    """Warn where an old record cannot say which activation it ran: a QuickGELU tag on a GELU model
    config (``ViT-L-14`` + ``openai``), which versions of this project on open_clip >= 2.29 built
    with GELU."""
    model_cfg = open_clip.get_model_config(name)
    if activation == "quick_gelu" and model_cfg and config_activation(model_cfg) == "gelu":
        logger.warning("a checkpoint or feature cache of %s:%s records no activation (written before demind "
                       "recorded it); it is read as QuickGELU, what the weights were trained with, but if it "
                       "was made on open_clip >= 2.29 it may have run GELU: re-export or rebuild it to be sure",
                       name, pretrained)


def same_backbone(a: dict[str, str | None], b: dict[str, str | None]) -> bool:
    """Whether two recorded identities name the same backbone (architecture + weights + activation)."""
    a, b = canonical_identity(a), canonical_identity(b)
    if ("activation" in a) != ("activation" in b):
        # an old record of a model-config JSON: its content hash already pins the activation
        a.pop("activation", None)
        b.pop("activation", None)
    return a == b


def identity_difference(recorded: dict[str, str | None], current: dict[str, str | None]) -> str:
    """``key recorded != current`` for each field in which two identities differ (for messages)."""
    a, b = canonical_identity(recorded), canonical_identity(current)
    return ", ".join(f"{key} {a.get(key)} != {b.get(key)}" for key in sorted(set(a) | set(b))
                     if a.get(key) != b.get(key)) or "none"


def identity_slug(identity: dict[str, str | None]) -> str:
    """A short, file-name-safe string for an identity (cache folders, logs).

    The activation enters only where it differs from what the name and tag imply (never, for
    backbones this version builds), so cache folders written before it was recorded keep their names.
    """
    identity = dict(identity)
    implied = implied_activation(str(identity["name"]), identity.get("pretrained"))
    if implied is None or identity.get("activation") == implied:
        identity.pop("activation", None)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    readable = "".join(c if c.isalnum() or c in "-_" else "-" for c in str(identity["name"]).split("@")[0])
    return f"{readable}-{digest}"
