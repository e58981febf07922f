"""De-MINDS checkpoints: trainable weights only (safetensors), config and backbone identity.

The frozen backbone is never saved (ViT-L-14 is 1.7 GB and unchanged); the checkpoint
records which backbone it was trained on, and loading onto another one is an error.
It also records a sha256 of its tensors, checked at load: a corrupted file (a flipped byte
that safetensors cannot notice) and non-finite weights are errors naming the file and tensor,
never believable wrong results.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from demind.backbone import FrozenCLIP, build_backbone, parse_backbone_spec
from demind.schema import BackboneConfig, ModelConfig
from demind.identity import (canonical_identity, identity_difference, model_config_digest, model_config_tag,
                             same_backbone)
from demind.config import ConfigError, from_dict, to_dict
from demind.errors import DemindError
from demind.hubref import is_hub_ref, resolve_hub_folder
from demind.model import DeMinds
from demind.io import atomic_path, write_text_atomic
from demind.tensor_files import load_safetensors_file, read_format_metadata, tensors_sha256

logger = logging.getLogger(__name__)

FORMAT = "demind-checkpoint/1"
CHECKSUM_KEY = "tensors_sha256"

# A published folder (what ``demind-publish`` writes, locally or on the Hub) holds the checkpoint
# under this name, and a copy of the backbone's model-config JSON (when the backbone is one)
# under BACKBONE_DIR, so the folder is complete on any machine.
CHECKPOINT_FILE = "demind.safetensors"
BACKBONE_DIR = "backbone"


class CheckpointError(DemindError, ValueError):
    """A checkpoint that cannot be used as asked."""


def check_finite_tensors(state: dict[str, torch.Tensor], where: str) -> None:
    """Raise CheckpointError naming the first tensor that holds NaN or infinity."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{where}: tensor {name!r} holds {bad} non-finite value(s) (NaN/inf); "
                                  "the file is corrupted or the run diverged; use an earlier checkpoint")


def save_checkpoint(path: str | Path, model: DeMinds) -> Path:
    """Write ``model``'s trainable weights and metadata to ``path`` (tmp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    check_finite_tensors(state, f"refusing to save checkpoint {path}")
    meta = {"model_config": to_dict(model.cfg), "backbone_identity": model.backbone.identity,
            "backbone_config": to_dict(model.backbone.cfg),
            BACKBONE_FILES_KEY: backbone_files_record(model.backbone.cfg, path.parent)}
    return write_checkpoint(path, state, meta)


def write_checkpoint(path: str | Path, state: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write ``state`` with the decoded metadata ``meta`` (model_config, backbone_identity,
    backbone_config and optionally the backbone files record) as a checkpoint, atomically."""
    metadata = {CHECKSUM_KEY: tensors_sha256(state), "format": FORMAT,
                **{k: json.dumps(meta[k]) for k in ("model_config", "backbone_identity", "backbone_config",
                                                   BACKBONE_FILES_KEY) if meta.get(k) is not None}}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)
    return Path(path)


# --------------------------------------------------------------------------- the backbone's local files

BACKBONE_FILES_KEY = "backbone_files"
"""Metadata key: the backbone's local files relative to the checkpoint's folder, and the content
of its model-config JSON, so a run folder that moved (or a re-cloned repository) still loads."""


def _relative_to(path: str, folder: Path) -> str:
    # links kept (abspath, not resolve): a Hugging Face snapshot's file is a link to a blob named by hash
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(folder))).as_posix()


def backbone_files_record(cfg: BackboneConfig, folder: Path) -> dict | None:
    """{"name", "pretrained"}: the backbone's model-config JSON and weights file as paths relative
    to ``folder`` (None where not a local file), and "model_config": the JSON's text. None when the
    backbone has no local file (an open_clip name with a pretrained tag)."""
    name = cfg.name if cfg.name.endswith(".json") and Path(cfg.name).is_file() else None
    weights = cfg.pretrained if cfg.pretrained and Path(cfg.pretrained).is_file() else None
    if name is None and weights is None:
        return None
    return {"name": _relative_to(name, folder) if name else None,
            "pretrained": _relative_to(weights, folder) if weights else None,
            "model_config": Path(name).read_text(encoding="utf-8") if name else None}


def _find_local_file(recorded: str | None, relative: str | None, folder: Path) -> Path | None:
    """The first existing file of: the path as recorded (a relative one read from the checkpoint's
    folder first, then the current folder), the recorded relative path from the checkpoint's
    folder, and a copy in the folder's backbone/ (what demind-publish writes)."""
    candidates = []
    for path in (recorded, relative):
        if path:
            candidates += [Path(path)] if Path(path).is_absolute() else [folder / path, Path(path)]
    if recorded:
        candidates.append(folder / BACKBONE_DIR / Path(recorded).name)
    # absolute, links kept: a Hugging Face snapshot links NAME.json to a blob named by its hash,
    # and open_clip registers a model config under its file name
    return next((Path(os.path.abspath(c)) for c in candidates if c.is_file()), None)


def _materialised_model_config(text: str, stem: str) -> Path:
    """The model-config JSON a checkpoint carries, as a file open_clip can register (same name
    and bytes, so the backbone's identity is unchanged)."""
    # the folder is named by the same hash as the identity's tag, so one text has one folder
    digest = model_config_digest(text.encode("utf-8"))
    path = Path(tempfile.gettempdir()) / "demind-model-configs" / digest / f"{stem}.json"
    if not path.is_file():
        write_text_atomic(path, text)
    return path


def resolve_backbone_files(meta: dict, file: str | Path) -> BackboneConfig:
    """The backbone config ``meta`` records, its local files found on this machine.

    A model-config JSON and a weights file are looked for as recorded, relative to the
    checkpoint ``file``'s folder, and in its ``backbone/`` (a published folder); a model config
    that is nowhere is rebuilt from the copy the checkpoint carries. Identity checks are by
    content, so a file found this way is still checked. A weights file that is nowhere is a
    CheckpointError naming it and the fix."""
    folder = Path(file).parent
    cfg = from_dict(BackboneConfig, meta["backbone_config"])
    files = meta.get(BACKBONE_FILES_KEY) or {}
    if cfg.name.endswith(".json"):
        found = _find_local_file(cfg.name, files.get("name"), folder)
        recorded = str(meta["backbone_identity"].get("name", ""))  # STEM@SHA256[:12] of the JSON's bytes
        if files.get("model_config") and (found is None or not recorded.endswith(model_config_tag(found))):
            # gone, or edited since (a re-cloned repository): the copy the checkpoint carries
            found = _materialised_model_config(files["model_config"], Path(cfg.name).stem)
        cfg.name = str(found) if found is not None else cfg.name  # missing: the backbone names the file
    if str(canonical_identity(meta["backbone_identity"]).get("pretrained") or "").startswith("sha256:"):
        found = _find_local_file(cfg.pretrained, files.get("pretrained"), folder)
        if found is None:
            raise CheckpointError(
                f"checkpoint {file} was trained on the backbone weights file {cfg.pretrained} "
                f"({meta['backbone_identity']['pretrained']}), which is neither there nor beside the checkpoint "
                f"(nor in its {BACKBONE_DIR}/); give --backbone NAME:PATH naming that file (its sha256 is checked), "
                f"or load a folder written by demind-publish, which carries it")
        cfg.pretrained = str(found)
    return cfg


def read_checkpoint_metadata(path: str | Path) -> dict:
    """The checkpoint's metadata, decoded: format, model_config, backbone_identity, backbone_config."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")

    raw = read_format_metadata(path, FORMAT, CheckpointError, "checkpoint",
                               "a De-MINDS checkpoint is the demind.safetensors a training run exports")
    return {k: (v if k in ("format", CHECKSUM_KEY) else json.loads(v)) for k, v in raw.items()}


def read_checked_tensors(path: str | Path, meta: dict | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, after checking their recorded sha256 and that they are finite.

    ``meta``: its metadata when the caller already read it (:func:`read_checkpoint_metadata`)."""
    meta = meta if meta is not None else read_checkpoint_metadata(path)
    state = load_safetensors_file(path, CheckpointError, "checkpoint")
    expected = meta.get(CHECKSUM_KEY)
    if expected is None:
        logger.warning("checkpoint %s has no tensor checksum (written before checksums were recorded); "
                       "its integrity cannot be verified", path)
    elif tensors_sha256(state) != expected:
        raise CheckpointError(f"checkpoint {path} is corrupted: the sha256 of its tensors does not match the one "
                              "recorded when it was saved; restore it from a copy or re-export it from the run's "
                              "last training checkpoint")
    check_finite_tensors(state, f"checkpoint {path}")
    return state


def checkpoint_backbone_config(path: str | Path) -> BackboneConfig:
    """The backbone config the checkpoint was trained with (to rebuild it for evaluation), its
    local files found as :func:`resolve_backbone_files` does."""
    return resolve_backbone_files(read_checkpoint_metadata(path), path)


def load_checkpoint(path: str | Path, backbone: FrozenCLIP, meta: dict | None = None) -> DeMinds:
    """Rebuild the model saved at ``path`` on ``backbone``; the backbone must be the one it was trained on.

    ``meta``: the checkpoint's metadata when the caller already read it (a load reads the header once)."""
    meta = meta if meta is not None else read_checkpoint_metadata(path)
    if not same_backbone(meta["backbone_identity"], backbone.identity):
        raise CheckpointError(
            f"checkpoint {path} was trained on backbone {meta['backbone_identity']}, "
            f"but the loaded backbone is {backbone.identity} ({backbone.cfg.name}, pretrained "
            f"{backbone.cfg.pretrained}, seed {backbone.cfg.seed}; differs in "
            f"{identity_difference(meta['backbone_identity'], backbone.identity)}); load the backbone it was trained on"
        )
    model = build_model(meta["model_config"], backbone)
    model.load_state_dict(read_checked_tensors(path, meta))
    return model.to(backbone.device).eval()


def build_model(model_config: dict, backbone: FrozenCLIP):
    """The untrained model a checkpoint's recorded config describes: De-MINDS, or a combiner trained on
    triplets (``architecture: combiner``, :mod:`demind.triplets`)."""
    from demind.combiner import is_combiner_config

    if is_combiner_config(model_config):
        from demind.combiner import Combiner
        from demind.schema import CombinerConfig

        return Combiner(from_dict(CombinerConfig, model_config), backbone)
    return DeMinds(from_dict(ModelConfig, model_config), backbone)


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint was found: the file, and the published folder it lies in (or None)."""

    file: Path
    folder: Path | None = None


def resolve_checkpoint(spec: str | Path) -> CheckpointSource:
    """A checkpoint file, a published folder, or ``hf-hub:ORG/NAME[@REVISION]`` -> its file.

    A Hub reference is fetched (or read from the Hugging Face cache) with
    :func:`demind.hubref.resolve_hub_folder`; a folder must hold :data:`CHECKPOINT_FILE`.
    """
    if is_hub_ref(spec):
        folder = resolve_hub_folder(str(spec), "model", "checkpoint")
    elif Path(spec).is_dir():
        folder = Path(spec)
    else:
        return CheckpointSource(Path(spec))
    file = folder / CHECKPOINT_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {spec} is a folder without {CHECKPOINT_FILE}; give the .safetensors "
                              f"file, or a folder written by demind-publish")
    return CheckpointSource(file, folder)


def source_backbone_config(source: CheckpointSource, meta: dict | None = None) -> BackboneConfig:
    """The backbone config the checkpoint records, its local files found on this machine
    (:func:`resolve_backbone_files`: as recorded, beside the checkpoint, in a published folder's
    ``backbone/``, or the model config the checkpoint carries).

    ``meta``: the checkpoint's metadata when the caller already read it."""
    meta = meta if meta is not None else read_checkpoint_metadata(source.file)
    return resolve_backbone_files(meta, source.file)


def load_backbone_and_model(
    checkpoint: str | Path | None = None,
    backbone: str | FrozenCLIP | None = None,
    *,
    precision: str = "fp32",
    device: str | torch.device = "cpu",
) -> tuple[FrozenCLIP, DeMinds | None]:
    """The one place a backbone and a trained model are loaded for use (evaluation, the quickstart).

    checkpoint: a De-MINDS checkpoint (.safetensors), a folder written by ``demind-publish``,
        ``hf-hub:ORG/NAME[@REVISION]`` (:func:`resolve_checkpoint`), or None for the
        backbone-only methods.
    backbone: a loaded FrozenCLIP, a ``NAME:TAG_OR_PATH`` spec (see
        :func:`demind.backbone.parse_backbone_spec`), or None to rebuild the backbone the
        checkpoint records.  With a checkpoint, it must be the backbone the checkpoint was
        trained on (:class:`CheckpointError` otherwise, naming both identities).
    precision, device: for a backbone built here (a loaded one is used as it is).
    Returns (backbone, model or None), the model in eval mode on the backbone's device.
    """
    if checkpoint is None and backbone is None:
        raise ConfigError("give a checkpoint (--checkpoint CKPT), or a backbone (--backbone NAME:TAG_OR_PATH) "
                          "for the backbone-only methods")
    source = resolve_checkpoint(checkpoint) if checkpoint is not None else None
    meta = read_checkpoint_metadata(source.file) if source is not None else None  # the header, read once
    if not isinstance(backbone, FrozenCLIP):
        if backbone is not None:
            cfg = parse_backbone_spec(backbone, precision)
        else:
            cfg = source_backbone_config(source, meta)
            cfg.precision = precision
            cfg.grad_checkpointing = False  # loaded for inference: no gradients
        backbone = build_backbone(cfg, device=device)
    model = load_checkpoint(source.file, backbone, meta) if source is not None else None
    return backbone, model
