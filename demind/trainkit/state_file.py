"""Resumable training state without pickle: tensors in safetensors, structure in JSON.

A state file is one ``.safetensors`` file: every tensor of the state (module weights,
optimizer moments, RNG bytes) is a safetensors tensor, and everything else (the nesting,
step counts, scheduler fields, Python RNG tuples, config) is one JSON document in the file's
metadata (``__metadata__["state"]``), with a sha256 of the tensors. One file, so a single
``os.replace`` (:func:`demind.io.atomic_path`) makes a save atomic: a killed run leaves the
old state or the new one, never a mix of tensors from one and JSON from the other.
Loading needs no unpickler, so a state file cannot run code, and a truncated or corrupted
file is one :class:`StateFileError` naming the file and the fix.

Used by ExclMM, the triplet trainer and the toy CLIP. De-MINDS resumes through
``accelerator.save_state`` instead (:mod:`demind.training.resume`), because sharded
DeepSpeed/FSDP optimizer states are only written and read by Accelerate. :class:`ResumeError`
is every trainer's refusal to continue a run folder.

    save_train_state(path, step=100, modules={"model": model}, optimizer=opt, scheduler=sched,
                     extra={"phase": "sae"})
    state = load_train_state(path)          # the tree, tensors on the CPU
    step = restore_train_state(state, modules={"model": model}, optimizer=opt, scheduler=sched)
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from demind.errors import DemindError
from demind.io import atomic_path
from demind.tensor_files import load_safetensors_file, read_format_metadata, tensors_sha256

FORMAT = "demind-train-state/1"
TREE_FORMAT = "demind-tree/1"


class StateFileError(DemindError, ValueError):
    """A state or cache file that cannot be read back (truncated, corrupted, or another format)."""


class ResumeError(DemindError, ValueError):
    """A run folder whose checkpoints cannot continue with this config."""


# ------------------------------------------------------------------------ tree <-> (tensors, JSON)

def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of ``value``; its tensors go to ``tensors`` under their path in the tree."""
    if isinstance(value, torch.Tensor):
        # a copy: safetensors refuses tensors that share storage (tied or viewed weights)
        tensors[path] = value.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": path}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        # int keys (an optimizer's state per parameter index) would become strings in JSON
        return {"__items__": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} at {path or '/'} in a state file")


def _decode(value: Any, tensors: dict[str, torch.Tensor] | None) -> Any:
    """Inverse of :func:`_encode`; with ``tensors=None`` a tensor stays ``{"__tensor__": name}``."""
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return value if tensors is None else tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return np.asarray(value["__ndarray__"], dtype=value["dtype"])
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {k: _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def save_tree(path: str | Path, tree: dict[str, Any], kind: str = TREE_FORMAT) -> Path:
    """Write a nested dict of tensors, arrays, lists, tuples and JSON scalars to ``path`` atomically.

    ``kind`` is recorded as the file's format and checked by :func:`load_tree`.
    """
    tensors: dict[str, torch.Tensor] = {}
    document = _encode(tree, "", tensors)
    # allow_nan: an optimizer may hold inf (a scheduler's best value); Python's json reads it back
    metadata = {"format": kind, "state": json.dumps(document, allow_nan=True),
                "tensors_sha256": tensors_sha256(tensors)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def _read_metadata(path: Path, kind: str, fix: str) -> dict[str, str]:
    return read_format_metadata(path, kind, StateFileError, "state file", fix)


def read_tree_json(path: str | Path, kind: str = TREE_FORMAT, fix: str = "delete it and rerun") -> dict[str, Any]:
    """The tree of a state file with its tensors left as ``{"__tensor__": name}``: read from the JSON
    alone, without loading the tensors."""
    path = Path(path)
    return _decode(json.loads(_read_metadata(path, kind, fix)["state"]), None)


def load_tree(path: str | Path, kind: str = TREE_FORMAT, fix: str = "delete it and rerun") -> dict[str, Any]:
    """Read back what :func:`save_tree` wrote (tensors on the CPU), after checking the tensors' sha256.

    A truncated, corrupted or foreign file raises :class:`StateFileError` naming ``path`` and ``fix``.
    """
    path = Path(path)
    meta = _read_metadata(path, kind, fix)
    tensors = load_safetensors_file(path, StateFileError, "state file", fix)
    if tensors_sha256(tensors) != meta.get("tensors_sha256"):
        raise StateFileError(f"{path} is corrupted (the sha256 of its tensors does not match the one saved); {fix}")
    try:
        return _decode(json.loads(meta["state"]), tensors)
    except (KeyError, json.JSONDecodeError) as e:
        raise StateFileError(f"{path} is corrupted (its JSON part does not match its tensors: {e}); {fix}") from None


# ------------------------------------------------------------------------ RNG

def rng_state() -> dict[str, Any]:
    """The global RNG states: Python's ``random``, NumPy's, torch's CPU and (when in use) CUDA generators."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s output (the CUDA states only onto as many devices as saved them)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


# ------------------------------------------------------------------------ training state

RESTART_FIX = "delete it to restart the run from its first step, or restore an intact copy"


def save_train_state(path: str | Path, *, step: int, modules: dict[str, torch.nn.Module],
                     optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                     extra: dict[str, Any] | None = None) -> Path:
    """Everything a killed run needs to continue exactly, in one atomic file at ``path``.

    modules: the trained modules by name (their ``state_dict``s, frozen parts included).
    optimizer, scheduler: the current ones (a trainer with stages saves the current stage's).
    extra: the caller's own JSON-able values (phase, sampler RNG state, loss window, config).
    The global RNG states (:func:`rng_state`) are saved too.
    """
    tree = {"step": int(step), "modules": {name: m.state_dict() for name, m in modules.items()},
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(), "extra": extra or {}}
    return save_tree(path, tree, FORMAT)


def load_train_state(path: str | Path, fix: str = RESTART_FIX) -> dict[str, Any]:
    """The tree :func:`save_train_state` wrote: ``step``, ``modules``, ``optimizer``, ``scheduler``,
    ``rng``, ``extra``. A truncated or corrupted file is a :class:`StateFileError` naming it."""
    return load_tree(path, FORMAT, fix)


def read_train_state_extra(path: str | Path) -> dict[str, Any]:
    """``step`` and ``extra`` of a state file, read from its JSON alone (cheap: no tensors)."""
    tree = read_tree_json(path, FORMAT, RESTART_FIX)
    return {"step": tree["step"], **tree["extra"]}


def restore_train_state(state: dict[str, Any], *, modules: dict[str, torch.nn.Module],
                        optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                        rng: bool = True) -> int:
    """Load ``state`` into the given modules, optimizer and scheduler (and the global RNGs); returns the step.

    Pass ``optimizer=None`` when the saved optimizer belongs to a finished stage (a trainer with
    stages starts the next stage with a fresh one, as an uninterrupted run does).
    """
    for name, module in modules.items():
        module.load_state_dict(state["modules"][name])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if rng:
        set_rng_state(state["rng"])
    return int(state["step"])
