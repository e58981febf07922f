"""Toy-world files written by earlier versions: the one home of their forms (the toy world's caches
call in here and nowhere else knows them).

* Toy CLIP weights pickled as ``.pt`` (before safetensors) are not read: the model is trained
  again, said in one log line (:func:`note_pickled_weights`).
* Toy shards' done-markers written before a setting existed read with the value those shards had,
  and settings since removed are dropped (:func:`current_shard_config`), so finished shards stay done;
  a toy benchmark's marker drops them too (:func:`current_benchmark_config`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("toyworld.clip_cache")  # the reader's log: its line reads as it did before

LEGACY_WEIGHTS_SUFFIX = ".pt"  # pickled weights or state of versions before safetensors
# Settings added after shards were first written, with the value older shards had: a shard
# written before the noise option existed is a clean shard, not a stale one.
LATER_SETTINGS = {"noise_kind": "none", "noise_rate": 0.0}
# Settings since removed: the world version in the stats (or marker) says all they said.
RETIRED_SETTINGS = ("world",)


def note_pickled_weights(folder: Path, stem: str) -> None:
    """Log, once, the pickled toy CLIP files ``<stem>-*.pt`` in ``folder``: not read, trained again."""
    legacy = sorted(p.name for p in folder.glob(f"{stem}-*{LEGACY_WEIGHTS_SUFFIX}"))
    if legacy:
        logger.info("toy CLIP: %s in %s: pickle weights or state of an earlier version, not read (the weights "
                    "are safetensors now); training again", ", ".join(legacy), folder)


def current_shard_config(written: dict[str, Any]) -> dict[str, Any]:
    """A toy shard's recorded config as the current settings read it."""
    return {k: v for k, v in {**LATER_SETTINGS, **written}.items() if k not in RETIRED_SETTINGS}


def current_benchmark_config(written: dict[str, Any]) -> dict[str, Any]:
    """A toy benchmark marker's recorded config as the current settings read it."""
    return {k: v for k, v in written.items() if k not in RETIRED_SETTINGS}
