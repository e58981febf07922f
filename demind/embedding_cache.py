"""The one embedding cache: every frozen-encoder output written to disk lives by these rules.

Four uses share it: the training feature cache (:mod:`demind.features`, one entry per shard),
evaluation galleries and the search index's parts (:class:`demind.retrieval.ImageFeatureCache`,
one entry per part) and ExclMM's features (:mod:`demind.exclmm.features`, one entry per run).

* **Key rule** (:func:`cache_identity`, :func:`cache_slug`): what the stored vectors depend on is
  the backbone's identity (architecture, weights, activation: :mod:`demind.identity`) plus the
  precision its towers ran in (added only when not fp32, so caches written before precisions
  existed keep their folder names), plus *what was encoded*, which names the entry (a shard, a
  benchmark/split/role part, an index part, a run). Every entry records the identity; the folder
  that holds a backbone's entries is named by :func:`cache_slug`.
* **One identity check** (:func:`check_backbone`): a cache of another backbone is refused with one
  message naming both backbones, the fields that differ and the command that rebuilds it.
* **One staleness check** (:func:`stale_reason`): an entry of another format, or whose source
  changed since (a fingerprint recorded at writing), is rebuilt.
* **One writer** (:func:`write_entry`): the tensors as ``<stem>.safetensors`` (atomically), then
  the record as ``<stem>.json`` (atomically) *last*: the json is the done-marker, so a killed
  writer leaves no entry that looks finished.
* **One reader** (:func:`read_record`, :func:`read_tensors`, :func:`map_tensor`): a damaged file
  is one error naming it and saying how to rebuild it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from demind.errors import DemindError
from demind.identity import identity_difference, identity_slug, same_backbone
from demind.io import write_bytes_atomic, write_json_atomic
from demind.tensor_files import load_safetensors_file

FP32 = "fp32"


class EmbeddingCacheError(DemindError, ValueError):
    """A cache entry that cannot be used: another backbone's, damaged, or not a cache entry."""


# --------------------------------------------------------------------------- key rule


def cache_identity(backbone: Any) -> dict[str, Any]:
    """What cached features depend on: ``backbone.identity`` and, unless fp32, the precision its
    towers ran in, so a bf16 cache is never read by an fp32 run (or the reverse)."""
    return with_precision(backbone.identity, backbone.cfg.precision)


def with_precision(identity: dict[str, Any], precision: str | None) -> dict[str, Any]:
    """``identity`` with ``precision`` added unless fp32 (or unknown); how records that store the
    precision beside the identity (search indexes before the one cache) read as a cache identity."""
    identity = dict(identity) if isinstance(identity, dict) else {}
    if precision and precision != FP32 and "precision" not in identity:
        identity["precision"] = precision
    return identity


def cache_slug(backbone: Any) -> str:
    """Folder name of ``backbone``'s cache entries (its identity slug when fp32)."""
    return identity_slug(cache_identity(backbone))


# --------------------------------------------------------------------------- checks


def backbone_mismatch(recorded: dict[str, Any] | None, identity: dict[str, Any]) -> str | None:
    """None when ``recorded`` names the backbone ``identity`` names, else the one description of
    the difference: ``"was made with backbone A but this run uses B (differs in ...)"``."""
    if same_backbone(recorded or {}, identity):
        return None
    return (f"was made with backbone {recorded} but this run uses {identity} "
            f"(differs in {identity_difference(recorded or {}, identity)})")


def check_backbone(recorded: dict[str, Any] | None, identity: dict[str, Any], where: str | Path, rebuild: str,
                   error: type[Exception] = EmbeddingCacheError) -> None:
    """Refuse a cache made by another backbone: ``error("<where> was made with backbone A but this run
    uses B (differs in ...); <rebuild>")``, the one refusal message of every cache."""
    mismatch = backbone_mismatch(recorded, identity)
    if mismatch:
        raise error(f"{where} {mismatch}; {rebuild}")


def stale_reason(record: dict[str, Any], fmt: str | tuple[str, ...], fingerprint: Any = None) -> str | None:
    """Why an entry must be rebuilt, or None: another format than ``fmt`` (one or several readable
    ones), or a source whose ``fingerprint`` differs from the one recorded at writing (checked only
    when given)."""
    formats = (fmt,) if isinstance(fmt, str) else fmt
    if record.get("format") not in formats:
        return f"format {record.get('format')} is not {formats[0]}"
    if fingerprint is not None and record.get("fingerprint", record.get("shard_fingerprint")) != fingerprint:
        return "its source was rewritten since it was cached"
    return None


# --------------------------------------------------------------------------- writing


def entry_paths(stem: str | Path) -> tuple[Path, Path]:
    """(tensor file, record json) of the entry ``stem`` (a path without suffix)."""
    stem = Path(stem)
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def write_entry(stem: str | Path, tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> tuple[Path, Path]:
    """Write an entry: the tensors (each stored exactly, contiguous: a row slice stores its rows
    only) as ``<stem>.safetensors``, then ``record`` as ``<stem>.json``, both atomically; the json
    last is the done-marker. Returns (tensor file, record json)."""
    from safetensors.torch import save

    tensor_path, record_path = entry_paths(stem)
    # .clone() of a view would copy too; contiguous() of an exact slice is already compact in
    # safetensors, which writes only the tensor's own elements (never its whole storage)
    write_bytes_atomic(tensor_path, save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))
    write_json_atomic(record_path, record)
    return tensor_path, record_path


# --------------------------------------------------------------------------- reading


def read_record(path: str | Path, error: type[Exception], fix: str) -> dict[str, Any] | None:
    """The record json at ``path``; None when there is none (the entry is not finished); a file that
    is not a JSON object raises ``error`` naming it, then ``fix``."""
    path = Path(path)
    if not path.is_file():
        return None
    tail = f"; {fix}" if fix else ""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exn:
        raise error(f"cache record {path} is not valid JSON ({exn}){tail}") from None
    if not isinstance(record, dict):
        raise error(f"cache record {path} is not a JSON object{tail}")
    return record


def read_tensors(path: str | Path, error: type[Exception], what: str, fix: str) -> dict[str, torch.Tensor]:
    """Every tensor of an entry's tensor file (in memory, on the CPU); a truncated or corrupted file
    raises ``error``: ``"<what> <path> is truncated or corrupted (...); <fix>"``."""
    return load_safetensors_file(path, error, what, fix)


SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64, "I64": np.int64}


def advise_random_access(tensor: torch.Tensor) -> bool:
    """Tell the OS that a memory-mapped ``tensor`` (:func:`map_tensor`) is read at scattered rows, so
    a page fault reads its page and not the read-ahead window around it. Measured on rows evicted from
    the page cache (BENCHMARKS.md, search): a faiss-ivfpq query 6.7x faster at 100k rows and 10.7x at 1M,
    but a full scan 5.8x slower, so only a ranker that reads a few rows a query asks for it. Returns
    whether the advice was taken (not on Windows; on memory that is not file-backed it changes nothing)."""
    import ctypes
    import mmap

    if not hasattr(mmap, "MADV_RANDOM") or tensor.numel() == 0:
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), ctypes.c_int(mmap.MADV_RANDOM)) == 0


def map_tensor(path: str | Path, name: str, error: type[Exception], what: str, fix: str) -> torch.Tensor:
    """Tensor ``name`` of a safetensors file, memory-mapped: no copy is read until rows are used, and
    the pages are the OS's file cache (shared between processes, dropped under memory pressure).

    The file is mapped copy-on-write, so the returned tensor is writable without touching the file.
    A truncated or corrupted file raises ``error`` as :func:`read_tensors` does."""
    path = Path(path)
    fail = f"{what} {path} is truncated or corrupted"
    fix = fix or "delete it and rerun"
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            if header_len < 2 or 8 + header_len > size:
                raise error(f"{fail} (no safetensors header); {fix}")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, DemindError):
            raise
        raise error(f"{fail} ({e}); {fix}") from None
    spec = header.get(name) if isinstance(header, dict) else None
    dtype = SAFETENSORS_DTYPES.get(spec.get("dtype")) if isinstance(spec, dict) else None
    if dtype is None:
        raise error(f"{fail} (no float tensor {name!r} in it); {fix}")
    begin, end = spec["data_offsets"]
    shape = tuple(spec["shape"])
    count = int(np.prod(shape)) if shape else 1
    if end - begin != count * np.dtype(dtype).itemsize or 8 + header_len + end > size:
        raise error(f"{fail} (tensor {name!r} ends past the file); {fix}")
    if count == 0:
        return torch.zeros(shape, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
    array = np.memmap(path, dtype=dtype, mode="c", offset=8 + header_len + begin, shape=shape)
    return torch.from_numpy(array)
