"""``pairs_manifest.json``: what a folder of pair shards was mined from and how.

Written once before the first pair shard (atomically) and read by every later stage: the
corpus (:func:`demind.pairs.corpus.corpus_record`: shard paths and content digest), the frozen
CLIP's identity (:func:`demind.embedding_cache.cache_identity`: architecture, weights digest,
precision) and the second encoder's, the signals with their windows, K, H, the ranker and the
whole recipe. A rerun into the same folder with another recipe, corpus or backbone is refused
(naming what differs) unless ``--overwrite``, which mines every shard again: pair shards are
never a mixture of two recipes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from demind.errors import DemindError, InputError
from demind.io import write_json_atomic

class CorpusMismatchError(DemindError, ValueError):
    """Pairs or triplets made from another corpus (or backbone, or recipe) than the one given."""


PAIRS_MANIFEST = "pairs_manifest.json"
PAIRS_FORMAT = "demind-pairs/1"


def manifest_path(folder: str | Path) -> Path:
    return Path(folder) / PAIRS_MANIFEST


def read_pairs_manifest(where: str | Path) -> dict[str, Any]:
    """The manifest of a pair-shard folder (or the manifest file itself); a missing or damaged one
    is an :class:`~demind.errors.InputError` naming it."""
    path = Path(where)
    path = path if path.name == PAIRS_MANIFEST else manifest_path(path)
    if not path.is_file():
        raise InputError(f"{path} does not exist: {path.parent} is not a folder of pair shards "
                         f"(make one with demind-mine-pairs)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is not a readable pairs manifest ({e}); mine the pairs again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PAIRS_FORMAT:
        raise InputError(f"{path} is not a pairs manifest of format {PAIRS_FORMAT}; mine the pairs again")
    return manifest


def write_pairs_manifest(folder: str | Path, manifest: dict[str, Any]) -> Path:
    return write_json_atomic(manifest_path(folder), {"format": PAIRS_FORMAT, **manifest}, indent=1)


def _difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first dotted key where two JSON values differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if found:
                return found
        return None
    return None if a == b else f"{prefix.rstrip('.')} ({a!r} -> {b!r})"


def check_same_recipe(folder: str | Path, manifest: dict[str, Any],
                      keys: tuple[str, ...] = ("backbone", "second_encoder", "recipe")) -> None:
    """Refuse to add shards to ``folder`` when its manifest records another corpus, or another of
    ``keys`` (backbone, second encoder, recipe), than ``manifest`` (the one this run would write)."""
    path = manifest_path(folder)
    if not path.is_file():
        return
    old = read_pairs_manifest(path)
    fix = f"write to another --output, or add --overwrite to mine every shard of {folder} again"
    if old["corpus"].get("digest") != manifest["corpus"].get("digest"):
        raise CorpusMismatchError(f"{folder} holds pairs mined from corpus {old['corpus'].get('spec')!r} but this "
                                  f"run mines {manifest['corpus'].get('spec')!r} (another content digest); {fix}")
    for key in keys:
        diff = _difference(old.get(key), manifest.get(key))
        if diff:
            raise CorpusMismatchError(f"{folder} holds pairs mined with another {key}: differs in {diff}; {fix}")
