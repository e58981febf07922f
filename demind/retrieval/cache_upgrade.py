"""Image-feature caches written before the one embedding cache, read as current ones: the one home
of their formats (:class:`demind.retrieval.ImageFeatureCache` calls in here and nowhere else knows them).

* A part ``part-NNNNN.pt`` (torch.save of {"names", "keys", "features" (n, D)}) is read as a part
  (:func:`read_part`); the next rewrite of its role (the search index compacts it) writes it in
  the current form and deletes it.
* A gallery folder named ``<identity>-<precision>`` (before the one key rule) is read where the
  current folder does not exist (:func:`readable_slug`), so its images are not encoded again.
* An entry keyed before EXIF orientation was applied (:func:`unoriented_key`) is reused for every
  image whose orientation changes nothing, and recorded under its current key
  (:func:`adopt_unoriented`); an image stored rotated is encoded again.
* An entry keyed by the file version before it held change time and inode (size and mtime:
  :func:`demind.io.earlier_file_version`) is reused for the file that has that size and mtime now,
  and recorded under its current key (:func:`adopt_earlier_versions`), so a search index is not
  encoded again for the new rule.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from demind.embedding_cache import EmbeddingCacheError
from demind.io import earlier_file_version
from demind.retrieval.refs import ImageRef, orientation_changes
from demind.tensor_files import load_torch_file

log = logging.getLogger("demind.retrieval.cache")  # the reader's log: its lines read as they did before

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


def unoriented_key(ref: ImageRef) -> str:
    """The key of ``ref`` decoded without EXIF orientation (what every key was before ``orient``
    existed): its cached feature still holds when :func:`~demind.retrieval.refs.orientation_changes` is False."""
    return replace(ref, orient=False).cache_key


def adopt_unoriented(cache: Any, role: str, refs: list[ImageRef],
                     holds: Callable[[str, str], bool]) -> list[ImageRef]:
    """The ``refs`` (missing under their own key) whose feature cached before EXIF orientation
    was applied still holds; their entries are recorded under their key in ``cache`` (an
    :class:`~demind.retrieval.ImageFeatureCache`), so the next lookup reads no header.

    That is an ``orient`` ref whose key without orientation is held (``holds(name, key)``) and
    whose file has no orientation tag or 1 (:func:`~demind.retrieval.refs.orientation_changes`):
    decoding it with orientation gives the very pixels that were encoded. An image stored
    rotated (2..8) was encoded sideways and is encoded again."""
    adopted = [r for r in refs if r.orient and holds(r.name, unoriented_key(r)) and not orientation_changes(r)]
    if adopted:
        cache.rekey(role, {r.name: (unoriented_key(r), r.cache_key) for r in adopted})
        log.info("%s: %d images reused from before EXIF orientation was applied (no orientation tag)",
                 cache.dir / role, len(adopted))
    return adopted


def earlier_key_of(ref: ImageRef) -> str | None:
    """The key ``ref`` had when file versions were size and mtime only; None when that is its key."""
    if ref.version is None or earlier_file_version(ref.version) == ref.version:
        return None
    return replace(ref, version=earlier_file_version(ref.version)).cache_key


def adopt_earlier_versions(cache: Any, role: str, refs: list[ImageRef],
                           holds: Callable[[str, str], bool]) -> list[ImageRef]:
    """The ``refs`` (missing under their own key) held under the key their file's version had by the
    earlier rule (:func:`earlier_key_of`: the size and mtime they have now), recorded under their key in ``cache``."""
    adopted = [r for r in refs if earlier_key_of(r) is not None and holds(r.name, earlier_key_of(r))]
    if adopted:
        cache.rekey(role, {r.name: (earlier_key_of(r), r.cache_key) for r in adopted})
        log.info("%s: %d images reused from before file versions held change time and inode", cache.dir / role,
                 len(adopted))
    return adopted
