"""Pair probes, per-part nuisance streams and the R@10 probe ceilings."""

import dataclasses

import numpy as np
import pytest
import torch

from toyworld.probes import (PAIR_PROBE_ATTRIBUTES, pair_accuracy, pair_probe_cases, probe_ceiling,
                               run_pair_probes)
from toyworld.render import render_scene
from toyworld.world import SEED_STREAMS, Scene, ToyObject, apply_edit, scene_from_seed
import random

SIZE = 32


def _dilate(mask: np.ndarray, steps: int) -> np.ndarray:
    out = mask.copy()
    for _ in range(steps):
        grown = out.copy()
        grown[1:] |= out[:-1]; grown[:-1] |= out[1:]; grown[:, 1:] |= out[:, :-1]; grown[:, :-1] |= out[:, 1:]
        out = grown
    return out


def test_default_render_keeps_one_shared_stream():
    scene = scene_from_seed(11)
    assert np.array_equal(render_scene(scene, 5).image, render_scene(scene, 5, per_part=False).image)
    # the per-part streams are another photograph of the same scene
    assert not np.array_equal(render_scene(scene, 5).image, render_scene(scene, 5, per_part=True).image)


def test_per_part_render_ignores_object_order():
    # an "edit" that changes nothing (the same objects, listed in another order) gives identical pixels
    scene = Scene((ToyObject(0, "circle", "red", "small", "top left"), ToyObject(1, "star", "blue", "large", "bottom right")),
                  "grass", "origami")
    swapped = dataclasses.replace(scene, objects=scene.objects[::-1])
    assert np.array_equal(render_scene(scene, 9, per_part=True).image, render_scene(swapped, 9, per_part=True).image)


@pytest.mark.parametrize("style", ["photo", "cartoon", "origami", "toy", "sculpture"])
def test_per_part_object_edit_changes_only_that_object(style):
    a = ToyObject(0, "square", "red", "small", "top left")
    b = ToyObject(1, "heart", "blue", "large", "bottom right")
    scene = Scene((a, b), "sand", style)
    for edited in (dataclasses.replace(a, colour="green"), dataclasses.replace(a, shape="triangle"),
                   dataclasses.replace(a, size="large"), dataclasses.replace(a, position="top")):
        other = Scene((edited, b), "sand", style)
        r1, r2 = render_scene(scene, 4, 64, per_part=True), render_scene(other, 4, 64, per_part=True)
        differs = (r1.image != r2.image).any(axis=-1)
        assert differs.any()
        # only where object 0 is in either image (plus its anti-aliased edge, outline and shadow)
        allowed = _dilate(r1.masks[0] | r2.masks[0], 3)
        assert not (differs & ~allowed).any()
    # with the default shared stream a size edit changes the drawing order, so object 1's jitter
    # changes too (why the pair probe needs per-part streams)
    grown = Scene((dataclasses.replace(a, size="large"), b), "sand", style)
    r1, r2 = render_scene(scene, 4, 64), render_scene(grown, 4, 64)
    assert ((r1.image != r2.image).any(axis=-1) & ~_dilate(r1.masks[0] | r2.masks[0], 3)).any()


def test_pair_accuracy_counts_ties_half():
    own = torch.tensor([1.0, 0.2, 0.5, 0.0])
    edited = torch.tensor([0.0, 0.9, 0.5, 0.0])
    assert pair_accuracy(own, edited) == pytest.approx(100 * (1 + 0 + 0.5 + 0.5) / 4)
    with pytest.raises(ValueError, match="equal, non-empty"):
        pair_accuracy(torch.zeros(3), torch.zeros(2))


def test_pair_cases_edit_one_attribute_and_are_stable():
    cases = pair_probe_cases(30)
    again = pair_probe_cases(30, attributes=("style", "shape"))
    for case, other in zip(cases, again):
        assert case.edited["shape"] == other.edited["shape"] and case.description == other.description
        assert case.edited["background"].background != case.scene.background
        assert case.edited["style"].style != case.scene.style
        for attr in ("shape", "colour", "size", "position"):
            changed = [(o, e) for o, e in zip(case.scene.objects, case.edited[attr].objects) if o != e]
            assert len(changed) == 1 and getattr(changed[0][0], attr) != getattr(changed[0][1], attr)


def _lookup_scorer(cases, seeing: set[str]):
    """A hand-built scorer that decodes each image to its scene (by its bytes) and each text to
    the scene it describes, and counts the agreeing attributes among ``seeing``."""
    by_text = {c.description: c.scene for c in cases}
    by_image = {}
    for c in cases:
        for scene in (c.scene, *c.edited.values()):
            by_image[render_scene(scene, c.nuisance_seed, SIZE, per_part=True).image.tobytes()] = scene

    def agree(a: Scene, b: Scene) -> float:
        total = 0.0
        for attr in seeing:
            if attr in ("background", "style"):
                total += getattr(a, attr) == getattr(b, attr)
            else:
                total += sorted(getattr(o, attr) for o in a.objects) == sorted(getattr(o, attr) for o in b.objects)
        return total

    def score(images, texts):
        return torch.tensor([agree(by_image[im.tobytes()], by_text[t]) for im, t in zip(images, texts)])

    return score


def test_oracle_scores_100_and_blind_scorer_50():
    cases = pair_probe_cases(12)
    oracle = run_pair_probes(_lookup_scorer(cases, set(PAIR_PROBE_ATTRIBUTES)), cases, SIZE)
    assert oracle == {a: 100.0 for a in PAIR_PROBE_ATTRIBUTES}
    for attr in PAIR_PROBE_ATTRIBUTES:
        blind = run_pair_probes(_lookup_scorer(cases, set(PAIR_PROBE_ATTRIBUTES) - {attr}), cases, SIZE, (attr,))
        assert blind == {attr: 50.0}


def test_breakdown_finds_an_attribute_hidden_in_one_style():
    """A scorer that sees everything except colour in sculpture scenes (as a renderer that drew
    them in bare stone grey would): the colour probe is 50 on sculptures and 100 elsewhere, every other probe 100."""
    from toyworld.probes import pair_probe_breakdown, score_pairs

    cases = pair_probe_cases(40)
    full, blind = _lookup_scorer(cases, set(PAIR_PROBE_ATTRIBUTES)), _lookup_scorer(
        cases, set(PAIR_PROBE_ATTRIBUTES) - {"colour"})
    by_text = {c.description: c.scene for c in cases}

    def score(images, texts):
        seen = full(images, texts)
        hidden = blind(images, texts)
        sculpture = torch.tensor([by_text[t].style == "sculpture" for t in texts])
        return torch.where(sculpture, hidden, seen)

    wins = score_pairs(score, cases, SIZE)
    breakdown = pair_probe_breakdown(wins, cases)
    styles = {c.scene.style for c in cases}
    assert "sculpture" in styles and len(styles) > 1
    for style, group in breakdown["colour"]["style"].items():
        assert group["accuracy"] == (50.0 if style == "sculpture" else 100.0)
        assert group["n"] == sum(c.scene.style == style for c in cases)
    assert all(g["accuracy"] == 100.0 for a in ("shape", "size", "background")
               for g in breakdown[a]["style"].values())
    assert sum(g["n"] for g in breakdown["colour"]["objects"].values()) == len(cases)
    # a quarter of the scenes carry a theme: each is its own group, the rest "none"
    from toyworld.world import THEMES
    assert "none" in breakdown["colour"]["theme"] and set(breakdown["colour"]["theme"]) <= {"none", *THEMES}
    assert sum(g["n"] for g in breakdown["colour"]["theme"].values()) == len(cases)


def test_probe_ceiling_hand_computed():
    def scene(bg, style="photo"):
        return Scene((ToyObject(0, "circle", "red", "small", "top"),), bg, style)
    # 12 scenes on grass (one key), 3 on sand: 12 * 10/12 + 3 * 1 over 15
    scenes = [scene("grass")] * 12 + [scene("sand")] * 3
    assert probe_ceiling(scenes, "background") == pytest.approx((12 * 10 / 12 + 3) / 15)
    # the style is part of every probe text; object order is not
    two = Scene((ToyObject(0, "circle", "red", "small", "top"), ToyObject(1, "star", "blue", "small", "left")),
                "grass", "photo")
    flipped = dataclasses.replace(two, objects=two.objects[::-1])
    assert probe_ceiling([two, flipped] * 6, "shape") == pytest.approx(10 / 12)
    assert probe_ceiling([scene("grass"), scene("grass", "toy")], "background", k=1) == 1.0


def test_clip_scorer_is_the_cosine_of_image_and_text(tmp_path):
    import json

    from toyworld.clip import build_toy_model, encode_toy_images
    from toyworld.clip_config import ToyBackboneConfig
    from toyworld.clip_eval import clip_pair_scorer

    model_json = tmp_path / "toy-clip-probe.json"
    model_json.write_text(json.dumps({
        "embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 16},
        "text_cfg": {"context_length": 56, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}))
    torch.manual_seed(0)
    model, tokenizer, size = build_toy_model(ToyBackboneConfig(model_config=str(model_json)))
    cases = pair_probe_cases(3)
    images = np.stack([render_scene(c.scene, c.nuisance_seed, size, per_part=True).image for c in cases])
    texts = [c.description for c in cases]
    score = clip_pair_scorer(model.eval(), tokenizer)
    got = score(images, texts)
    with torch.no_grad():
        expected = (encode_toy_images(model, images) * model.encode_text(tokenizer(texts), normalize=True)).sum(-1)
    assert torch.allclose(got, expected, atol=1e-5)
    # the second call reuses the encoded descriptions: still image i against text i
    flipped = images[::-1].copy()
    with torch.no_grad():
        expected_flipped = (encode_toy_images(model, flipped) * model.encode_text(tokenizer(texts), normalize=True)).sum(-1)
    assert torch.allclose(score(flipped, texts), expected_flipped, atol=1e-5)
