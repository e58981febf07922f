"""Image-feature caches written before the one embedding cache, read as current ones: the one home
of their formats (:class:`demind.retrieval.ImageFeatureCache` calls in here and nowhere else knows them).

* A part ``part-NNNNN.pt`` (torch.save of {"names", "keys", "features" (n, D)}) is read as a part
  (:func:`read_part`); the next rewrite of its role (the search index compacts it) writes it in
  the current form and deletes it.
* A gallery folder named ``<identity>-<precision>`` (before the one key rule) is read where the
  current folder does not exist (:func:`readable_slug`), so its images are not encoded again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from demind.embedding_cache import EmbeddingCacheError
from demind.tensor_files import load_torch_file

log = logging.getLogger(__name__)

EARLIER_PART_SUFFIX = ".pt"  # torch.save parts, written before the one cache
PART_KEYS = ("names", "keys", "features")


def is_earlier_part(path: Path) -> bool:
    """Whether ``path`` is a part of the earlier form (read by :func:`read_part`)."""
    return path.suffix == EARLIER_PART_SUFFIX


def read_part(part: Path, error: type[EmbeddingCacheError] = EmbeddingCacheError) -> dict:
    """One ``part-*.pt`` file -> {"names", "keys", "features" (n, D)}; ``error`` (the cache's
    damaged-part error) naming it otherwise."""
    data = load_torch_file(part, error, "feature part")
    if (not isinstance(data, dict) or any(k not in data for k in PART_KEYS)
            or not isinstance(data["features"], torch.Tensor)
            or not len(data["names"]) == len(data["keys"]) == len(data["features"])):
        raise error(f"feature part {part} is not a part of names, keys and features")
    return data


def legacy_image_slug(backbone: Any) -> str:
    """The folder name evaluation galleries used before the one key rule (``<identity>-<precision>``)."""
    return f"{backbone.identity_str}-{backbone.cfg.precision}"


def readable_slug(root: Path, slug: str, backbone: Any, rest: tuple[str, ...]) -> str:
    """The backbone folder to read ``root/<slug>/<rest>`` from: ``slug`` (the one key rule), or the
    earlier folder name when only that one exists, so galleries encoded before are not encoded again."""
    earlier = legacy_image_slug(backbone)
    if not Path(root, slug, *rest).exists() and Path(root, earlier, *rest).is_dir():
        log.info("reading image features encoded before the one cache key from %s", Path(root, earlier, *rest))
        return earlier
    return slug
