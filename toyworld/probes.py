"""What the toy CLIP sees: the pair probe, and the ceilings of the R@10 attribute probes.

The pair probe: for each held-out scene and each attribute, render the scene
and the same scene with that one attribute edited (:func:`toyworld.world.apply_edit`)
with the same nuisance seed and per-part nuisance streams (``render_scene(...,
per_part=True)``), so the two photographs differ only where the edit shows. Both are
scored against the scene's full description; the probe is the share of scenes whose own
image scores higher (ties count half). Chance is 50 %, a model that sees the attribute
scores near 100 %, and no text ambiguity caps it.

The R@10 probes of :func:`toyworld.clip_eval.evaluate_toy_clip` (texts naming one
attribute only) are capped by ambiguity: "a photo on grass" is true of many scenes. A
perfect model ranks every scene the text is true of first, in no particular order, so its
expected R@10 for a query is min(1, 10 / #scenes the text is true of): :func:`probe_ceiling`.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .render import render_scene
from .texts import full_description
from .world import Scene, apply_edit, scene_from_seed, stream_seed
from demind.seeding import derive_seed

PAIR_PROBE_ATTRIBUTES = ("shape", "colour", "size", "position", "background", "style")
PAIR_PROBE_STREAM = "web_eval"  # held out from the backbone's training scenes

# score(images (N, H, W, 3) uint8, texts: N strings) -> (N,) similarity of image i to text i
PairScorer = Callable[[np.ndarray, list[str]], torch.Tensor]


@dataclass(frozen=True)
class PairCase:
    """One held-out scene, its description, and its one-attribute edits (attribute -> scene)."""

    index: int
    scene: Scene
    description: str
    nuisance_seed: int
    edited: dict[str, Scene]


def pair_probe_cases(num_scenes: int, attributes: tuple[str, ...] = PAIR_PROBE_ATTRIBUTES) -> list[PairCase]:
    """Scenes ``0..num_scenes-1`` of the held-out stream with one edit per attribute.

    Every edit is seeded by (attribute, scene index), so the cases do not depend on which
    attributes are probed or in what order.
    """
    cases = []
    for i in range(num_scenes):
        scene = scene_from_seed(stream_seed(PAIR_PROBE_STREAM, i))
        description = full_description(scene, random.Random(derive_seed("pair-probe", "text", i)))
        edited = {a: apply_edit(scene, a, random.Random(derive_seed("pair-probe", a, i))) for a in attributes}
        cases.append(PairCase(i, scene, description, derive_seed("pair-probe", "nuisance", i), edited))
    return cases


def render_pair(case: PairCase, attribute: str, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(own image, edited image), each (H, W, 3) uint8, same nuisance seed, per-part streams."""
    own = render_scene(case.scene, case.nuisance_seed, image_size, per_part=True).image
    edited = render_scene(case.edited[attribute], case.nuisance_seed, image_size, per_part=True).image
    return own, edited


def pair_wins(own_scores: torch.Tensor, edited_scores: torch.Tensor) -> torch.Tensor:
    """(N,), (N,) scores -> (N,) 1 where the own image scores higher, 0.5 on a tie, 0 otherwise."""
    if own_scores.shape != edited_scores.shape or own_scores.numel() == 0:
        raise ValueError(f"a pair probe needs two equal, non-empty score vectors, got "
                         f"{tuple(own_scores.shape)} and {tuple(edited_scores.shape)}")
    return (own_scores > edited_scores).float() + 0.5 * (own_scores == edited_scores).float()


def pair_accuracy(own_scores: torch.Tensor, edited_scores: torch.Tensor) -> float:
    """Share (in %) of cases whose own image scores higher; ties count half. (N,), (N,) -> float."""
    return 100.0 * float(pair_wins(own_scores, edited_scores).mean())


def score_pairs(score: PairScorer, cases: list[PairCase], image_size: int,
                attributes: tuple[str, ...] = PAIR_PROBE_ATTRIBUTES) -> dict[str, torch.Tensor]:
    """attribute -> (N,) wins of ``score`` on each case (:func:`pair_wins`): the own image and the
    one-attribute edit, both against the case's description."""
    texts = [c.description for c in cases]
    own = np.stack([render_scene(c.scene, c.nuisance_seed, image_size, per_part=True).image for c in cases])
    own_scores = score(own, texts)
    wins = {}
    for attribute in attributes:
        edited = np.stack([render_scene(c.edited[attribute], c.nuisance_seed, image_size, per_part=True).image
                           for c in cases])
        wins[attribute] = pair_wins(own_scores, score(edited, texts))
    return wins


def probe_accuracies(wins: dict[str, torch.Tensor]) -> dict[str, float]:
    """attribute -> pair-probe accuracy in % (chance 50), rounded to 0.01, from :func:`score_pairs`' wins."""
    return {attribute: round(100.0 * float(w.mean()), 2) for attribute, w in wins.items()}


def run_pair_probes(score: PairScorer, cases: list[PairCase], image_size: int,
                    attributes: tuple[str, ...] = PAIR_PROBE_ATTRIBUTES) -> dict[str, float]:
    """attribute -> pair-probe accuracy in % (chance 50) of ``score`` over ``cases``."""
    return probe_accuracies(score_pairs(score, cases, image_size, attributes))


# the scene properties a pair probe's wins are broken down by: where a toy CLIP fails, and where the
# world itself hides an edit (a sculpture shows only half of its paint, so its colours show less)
BREAKDOWN_PROPERTIES: dict[str, Callable[[Scene], str]] = {
    "style": lambda scene: scene.style,
    "objects": lambda scene: str(len(scene.objects)),
    "theme": lambda scene: scene.theme or "none",
}


def pair_probe_breakdown(wins: dict[str, torch.Tensor], cases: list[PairCase],
                         properties: tuple[str, ...] = tuple(BREAKDOWN_PROPERTIES)
                         ) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """attribute -> property -> value -> {"n": cases, "accuracy": % (ties half)}, from the (N,) wins
    of :func:`score_pairs` on ``cases`` and each case's unedited scene."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for attribute, w in wins.items():
        for prop in properties:
            groups: dict[str, list[float]] = {}
            for case, win in zip(cases, w.tolist()):
                groups.setdefault(BREAKDOWN_PROPERTIES[prop](case.scene), []).append(win)
            out.setdefault(attribute, {})[prop] = {
                value: {"n": len(v), "accuracy": round(100.0 * sum(v) / len(v), 2)} for value, v in sorted(groups.items())}
    return out


def probe_key(scene: Scene, attribute: str) -> tuple:
    """What a one-attribute probe text says of ``scene``: the style and the multiset of the
    attribute's values (object order in the text carries no meaning). Scenes with equal keys
    are indistinguishable to a model that reads that attribute perfectly."""
    if attribute == "background":
        return scene.style, scene.background
    return (scene.style, *sorted(getattr(o, attribute) for o in scene.objects))


def probe_ceiling(scenes: list[Scene], attribute: str, k: int = 10) -> float:
    """Expected R@k (fraction) of a perfect model on the probe texts of ``scenes``: the mean
    over queries of min(1, k / #scenes whose probe text says the same)."""
    counts = Counter(probe_key(s, attribute) for s in scenes)
    return float(np.mean([min(1.0, k / counts[probe_key(s, attribute)]) for s in scenes]))
