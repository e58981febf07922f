"""Readers the toy-world tests share: a sample's scene and texts, per-type recall, the exclusion file."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from demind.eval.exclusion import check_exclusion
from toyworld.results import load_cirr_truth_and_rankings, recall_by_type
from toyworld.texts import alt_text, full_description, hypothetical_source, pseudo_manipulation
from toyworld.world import Scene


def read_scene(meta: dict[str, Any]):
    """The ground-truth ``toyworld.world.Scene`` stored in a toy intent sample's json."""
    return Scene.from_dict(meta["toy"]["scene"])


def intent_texts(scene, rng: random.Random) -> dict[str, str]:
    """The three texts of a toy intent sample: ``txt`` (T_ori), ``rew`` (T_rew), ``int`` (T_int),
    drawn in the order ``toyworld.intent_data.make_toy_sample`` draws them."""
    return {
        "txt": alt_text(scene, rng),
        "rew": full_description(scene, rng),
        "int": pseudo_manipulation(hypothetical_source(scene, rng), scene, rng),
    }


def per_type_recall(cirr_root: Path, rankings: dict[str, str], ks: tuple[int, ...] = (1, 5, 10)
                    ) -> dict[str, dict[str, dict[str, float]]]:
    """method -> modification type -> {"R@k": percent, "n": count}, from the toy CIRR captions
    under ``cirr_root`` and ``rankings`` (method -> rankings/<method>.json)."""
    return recall_by_type(*load_cirr_truth_and_rankings(cirr_root, rankings), ks)


def load_exclusion_json(path: str | Path) -> dict[str, Any]:
    """Load and check a toy exclusion file with the checks of :mod:`demind.eval.exclusion`
    (whose ``read_exclusion`` turns the folder into queries for the evaluation harness)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the exclusion benchmark ({e})") from None
    check_exclusion(data, path)
    return data
