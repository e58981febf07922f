"""ExclMM run folders and exports written by earlier versions: the one home of their formats (the
trainer, the features reader and the export loader call in here and nowhere else knows them).

* Features of the single-file form, ``demind-exclmm-features/1`` (one safetensors file with its JSON
  inside, :func:`demind.trainkit.save_tree`, no ``features.json``), are read as current ones
  (:func:`load_earlier_features`, :func:`earlier_record`).
* The pickles ``state.pt`` / ``features.pt`` are refused in one line saying what to do: delete them
  and rerun ``demind-train-exclmm`` (:func:`refuse_pickled_files`); reading a pickle could run code,
  and converting one would have to read it.
* An export whose config predates a form option (``space.contrastive``, ``query.triplet``, ...) reads
  as the form it was trained with (:func:`form_of`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from demind.errors import DemindError
from demind.trainkit import load_tree

LEGACY_FORMAT = "demind-exclmm-features/1"  # /1: one safetensors file through trainkit.state_file
EARLIER_FORMATS = (LEGACY_FORMAT,)
LEGACY_NAMES = ("state.pt", "features.pt")  # pickles written by earlier versions: refused


# what an export written before these options existed was trained with
EARLIER_FORMS = {"space": {"contrastive": "dot", "image_mask": "top_t", "reconstruct": "masked"},
                 "query": {"contrastive": "dot", "triplet": "gt-vs-positive", "triplet_margin": 1.0}}


class LegacyStateError(DemindError, ValueError):
    """A run folder with the pickle state or features of an earlier version."""


def load_earlier_features(path: Path, fix: str) -> dict[str, Any]:
    """The features dict of a ``demind-exclmm-features/1`` file (ragged lists still packed);
    :class:`demind.trainkit.StateFileError` when ``path`` is not one."""
    return load_tree(path, LEGACY_FORMAT, fix)


def earlier_record(feats: dict[str, Any]) -> dict[str, Any]:
    """The record a ``demind-exclmm-features/1`` file would have: its format, backbone and split."""
    return {"format": LEGACY_FORMAT, **{k: feats.get(k) for k in ("backbone", "train")}}


def refuse_pickled_files(run_dir: Path, features_name: str) -> None:
    """A run folder written before states and features moved to safetensors + JSON: refuse it,
    saying what to do (reading those pickles could run code; converting them would need to)."""
    old = [run_dir / name for name in LEGACY_NAMES if (run_dir / name).is_file()]
    if old:
        raise LegacyStateError(
            f"{', '.join(map(str, old))}: pickle file(s) of an earlier demind version, no longer read; delete "
            f"{' and '.join(p.name for p in old)} and rerun the same command "
            f"(demind-train-exclmm --config <your recipe> run.output_dir={run_dir} ...; the training restarts from its "
            f"first step and the features are recomputed into {features_name}), or use another run.output_dir")


def form_of(cfg: dict, section: str, key: str) -> str:
    """``cfg[section][key]`` of an export's config dict, or the earlier form for an export that predates it."""
    return cfg[section].get(key, EARLIER_FORMS[section][key])
