"""Toy-world readers only tests use: :func:`read_scene`, :func:`intent_texts`,
:func:`per_type_recall`, :func:`load_exclusion_json`.

The builders that used to live here moved: synthetic shards and COCO-format data to
:mod:`demind.synthetic`, the tiny LLaVA-NeXT to :mod:`demind.gen.tiny_llava`, test-only
constants to ``tests/helpers.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- toy world


def read_scene(meta: dict[str, Any]):
    """The ground-truth ``demind.toy.world.Scene`` stored in a toy intent sample's json."""
    from demind.toy.world import Scene

    return Scene.from_dict(meta["toy"]["scene"])


def intent_texts(scene, rng: random.Random) -> dict[str, str]:
    """The three texts of a toy intent sample: ``txt`` (T_ori), ``rew`` (T_rew), ``int`` (T_int),
    drawn in the order ``demind.toy.intent_data.make_toy_sample`` draws them."""
    from demind.toy.texts import alt_text, full_description, hypothetical_source, pseudo_manipulation

    return {
        "txt": alt_text(scene, rng),
        "rew": full_description(scene, rng),
        "int": pseudo_manipulation(hypothetical_source(scene, rng), scene, rng),
    }


def per_type_recall(cirr_root: Path, rankings: dict[str, str], ks: tuple[int, ...] = (1, 5, 10)
                    ) -> dict[str, dict[str, dict[str, float]]]:
    """method -> modification type -> {"R@k": percent, "n": count}, from the toy CIRR captions
    under ``cirr_root`` and ``rankings`` (method -> rankings/<method>.json)."""
    from demind.toy.pipeline import load_cirr_truth_and_rankings, recall_by_type

    return recall_by_type(*load_cirr_truth_and_rankings(cirr_root, rankings), ks)


def load_exclusion_json(path: str | Path) -> dict[str, Any]:
    """Load and check a toy exclusion file with the checks of :mod:`demind.eval.exclusion`
    (whose ``read_exclusion`` turns the folder into queries for the evaluation harness)."""
    from demind.eval.exclusion import check_exclusion

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the exclusion benchmark ({e})") from None
    check_exclusion(data, path)
    return data
