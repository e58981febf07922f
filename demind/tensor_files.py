"""safetensors files of a declared format: the tensors' digest and the metadata read with one error;
``torch.save`` files (the feature-cache parts) read the same way.

De-MINDS checkpoints, ExclMM exports and the training engine's state files are safetensors files
whose metadata names their ``format``; each reader refuses a file that is not readable
safetensors, or is of another format, with one message naming the file.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


def tensors_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def read_format_metadata(path: str | Path, expected: str, error: type[Exception], what: str,
                         fix: str = "") -> dict[str, str]:
    """The metadata of the safetensors file ``path``, whose ``format`` entry must be ``expected``.

    A file that safetensors cannot read (truncated, not safetensors) or of another format raises
    ``error`` with one message: ``what`` names the kind of file ("checkpoint"), ``fix`` (may be
    empty) says what to do."""
    tail = f"; {fix}" if fix else ""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise error(f"{what} {path} is truncated or corrupted ({e}){tail}") from None
    if meta.get("format") != expected:
        raise error(f"{what} {path} is not a {expected} file (format {meta.get('format')!r}){tail}")
    return meta


def load_safetensors_file(path: str | Path, error: type[Exception], what: str, fix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` (on the CPU), with one error.

    A truncated or corrupted file raises ``error``: ``"{what} {path} is truncated or corrupted (...)"``,
    then ``fix``."""
    from safetensors.torch import load_file

    tail = f"; {fix}" if fix else ""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise error(f"{what} {path} is truncated or corrupted ({e}){tail}") from None


def load_torch_file(path: str | Path, error: type[Exception], what: str, fix: str = "") -> Any:
    """``torch.load(path)`` (tensors and plain containers only, onto the CPU) with one error.

    A truncated or corrupted file (torch raises EOFError, RuntimeError from its zip reader, or
    an UnpicklingError) raises ``error`` naming ``what`` and the file, then ``fix``."""
    tail = f"; {fix}" if fix else ""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError) as e:
        # torch's own texts run to paragraphs (the weights_only advice): keep the first clause
        reason = "not a torch.save file" if isinstance(e, pickle.UnpicklingError) else (
            str(e).split(". ")[0] if str(e) else "the file ends early")
        raise error(f"{what} {path} is truncated or corrupted ({reason}){tail}") from None
