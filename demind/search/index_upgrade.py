"""Search indexes of the earlier layout, ``demind-index/1``, read as current ones: the one home of
that format (the index's readers call in here and nowhere else knows it).

Such an index lists its images as ``[name, key]`` pairs and keeps raw float32 rows, found by key, in
parts of the earlier form (``part-*.pt``, read by :mod:`demind.retrieval.cache_upgrade`).
:func:`~demind.search.index_manifest.read_manifest` hands its manifest to :func:`upgrade_manifest`
(checked, then read with the names once and their keys beside them); :func:`~demind.search.index.load_index`
reads its rows with :func:`load_earlier_rows` into one normalised float32 block; the next
``demind-index`` run rewrites the index in the current layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from demind.retrieval import DamagedPartError, ImageFeatureCache, stack_features

LEGACY_FORMAT = "demind-index/1"  # /1: [name, key] pairs, raw float32 parts found by key
EARLIER_FORMATS = (LEGACY_FORMAT,)


def upgrade_manifest(manifest: dict, damaged: Callable[[str], Exception]) -> dict:
    """A ``demind-index/1`` manifest (its common keys already type-checked) as the current reader
    reads it: ``images`` the names in row order, ``keys`` their cache keys. ``damaged(what)`` is the
    error raised when its ``images`` are not [name, key] pairs."""
    if not all(isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e)
               for e in manifest["images"]):
        raise damaged("key 'images' must list [name, key] pairs of strings")
    return {**manifest, "images": [name for name, _ in manifest["images"]],
            "keys": [key for _, key in manifest["images"]]}


def load_earlier_rows(index_dir: Path, manifest: dict, role: str, error: type[Exception],
                      rebuild: str) -> list[torch.Tensor]:
    """[(N, D) normalised float32] rows of an upgraded ``demind-index/1`` manifest, in the order of
    its names (raw rows found by key in the ``role`` parts); ``error`` naming the index otherwise,
    ending with ``rebuild`` where a rebuild fixes it."""
    try:
        stored = ImageFeatureCache.at(index_dir).load(role)
    except DamagedPartError as e:
        raise error(f"index {index_dir}: {e}; {rebuild} (only the damaged part's images are encoded again)") from None
    names, keys = manifest["images"], manifest["keys"]
    stale = [name for name, key in zip(names, keys) if key not in stored.get(name, {})]
    if stale:
        raise error(f"index {index_dir} lacks the embeddings of {len(stale)} listed file(s), e.g. "
                    f"{stale[0]}; rerun demind-index on it")
    features = stack_features({name: stored[name][key] for name, key in zip(names, keys)}, names)
    if not names:
        features = torch.zeros(0, manifest["embed_dim"])
    return [F.normalize(features.float(), dim=-1)]
