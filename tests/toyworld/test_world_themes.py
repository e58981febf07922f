"""The toy world (World v2.1, the one world): byte-identical to what it was, redundant detail,
visible themes, rare edit phrasing in the backbone's text, T_int that spells out a theme, implicit
toy-CIRR queries and per-type recall that reports them; caches written before its settings were
removed still count."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re

import numpy as np
import pytest

from toyworld.render import render_scene
from toyworld.texts import (
    alt_text, annotator_text, full_description, hypothetical_source, pseudo_manipulation, web_text,
)
from toyworld.world import (
    BACKGROUNDS, COLOURS, DETAIL_KINDS, EDIT_KINDS, IMPLICIT, THEMES, apply_edit, apply_theme, edit_is_possible,
    WORLD_VERSION, modification_type, scene_diff, scene_from_seed, stream_seed, strip_theme,
)


def _h(x) -> str:
    data = x if isinstance(x, bytes) else json.dumps(x, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _fingerprint(seed: int) -> dict[str, str]:
    """Hashes of what the toy world makes from one seed: scene, texts, pixels, a CIRR set, a sample."""
    from toyworld.cirr import build_cirr_set
    from toyworld.intent_data import ToyShardConfig, make_toy_sample

    scene = scene_from_seed(stream_seed("web", seed))
    rng = random.Random(seed)
    texts = [web_text(scene, rng) for _ in range(20)]
    source = hypothetical_source(scene, random.Random(seed + 1))
    texts += [alt_text(scene, rng), full_description(scene, rng), pseudo_manipulation(source, scene, rng),
              annotator_text(source, scene, rng)]
    images = render_scene(scene, seed).image.tobytes() + render_scene(scene, seed, per_part=True).image.tobytes()
    cirr_set = build_cirr_set(random.Random(stream_seed("cirr", seed)), 0.2)
    sample = make_toy_sample(seed, ToyShardConfig(), key=f"k{seed}")
    return {"scene": _h(scene.to_dict()), "canonical": _h(repr(scene.canonical())), "texts": _h(texts),
            "images": _h(images), "cirr_set": _h([m.to_dict() for m in cirr_set.members]),
            # generation.model names the module that wrote the texts, which moved into its own package
            "sample": _h([sample.caption, sample.rewritten, sample.intent,
                          {**sample.meta, "generation": {k: v for k, v in sample.meta["generation"].items()
                                                         if k != "model"}}])}


# Computed with the same function (passing world v2, then a setting) before the world setting and
# world v1 were removed: the one world left makes the same scenes, texts and pixels.
WORLD_FINGERPRINTS = {
    0: {"scene": "b73934ba1f3755f0", "canonical": "47c6cd0600298a60", "texts": "0332e6ebbbda1b93",
        "images": "713c6e098be1ae1e", "cirr_set": "a89310310139b1a5", "sample": "6fb1e9a5040bc437"},
    7: {"scene": "863c9677dd5c1bb6", "canonical": "096b9cbf5bbf3a22", "texts": "cbad7388f77900ef",
        "images": "dc594d0ab7bdde34", "cirr_set": "65688b37a419bfeb", "sample": "716619544947ecd1"},
    12345: {"scene": "4a871a6e84a1acc9", "canonical": "e6091281ef472e5a", "texts": "04bdf31b1cbe8c64",
            "images": "8e0938b5c805895c", "cirr_set": "cc91c924e880da3d", "sample": "b3a209964331af8c"},
}


@pytest.mark.parametrize("seed", sorted(WORLD_FINGERPRINTS))
def test_the_world_is_byte_identical_to_world_v2_1(seed):
    assert _fingerprint(seed) == WORLD_FINGERPRINTS[seed]


# ------------------------------------------------------------------ (c) redundant detail

def test_scenes_carry_redundant_detail_that_every_edit_keeps():
    scenes = [scene_from_seed(stream_seed("web", i)) for i in range(300)]
    assert all(2 <= len(s.details) <= 3 for s in scenes)
    assert all(len({d.kind for d in s.details}) == len(s.details) for s in scenes)
    themed = sum(s.theme is not None for s in scenes)
    assert 0.15 * 300 < themed < 0.35 * 300  # P_THEME = 0.25
    rng = random.Random(0)
    for scene in scenes[:60]:
        for kind in EDIT_KINDS + (IMPLICIT,):
            if edit_is_possible(scene, kind):
                assert apply_edit(scene, kind, rng).details == scene.details, kind
    # round trip through the shards' json
    from toyworld.world import Scene
    assert all(Scene.from_dict(json.loads(json.dumps(s.to_dict()))) == s for s in scenes[:50])


def test_details_are_named_in_full_descriptions_only_never_in_modification_texts():
    rng = random.Random(1)
    detail_words = re.compile(r"\b(" + "|".join(DETAIL_KINDS) + r")\b")
    for i in range(200):
        target = scene_from_seed(stream_seed("cirr", i))
        assert all(d.kind in full_description(target, rng) for d in target.details)
        source = hypothetical_source(target, rng)
        for text in (pseudo_manipulation(source, target, rng), annotator_text(source, target, rng)):
            assert not detail_words.search(text), text


def test_details_show_in_pixels():
    scene = scene_from_seed(stream_seed("web", 3))
    bare = dataclasses.replace(scene, details=())
    a = render_scene(scene, 5, per_part=True).image.astype(int)
    b = render_scene(bare, 5, per_part=True).image.astype(int)
    assert (np.abs(a - b).sum(-1) > 30).sum() >= 20


def _object_pixels(scene, colour: str) -> np.ndarray:
    """(n, 3) pixels of ``scene``'s one object recoloured to ``colour`` (same nuisance seed)."""
    recoloured = dataclasses.replace(scene, objects=(dataclasses.replace(scene.objects[0], colour=colour),))
    rendered = render_scene(recoloured, 5, per_part=True)
    return rendered.image[rendered.masks[0]].astype(float)


def test_sculptures_are_painted_and_a_bare_scene_keeps_stone_grey():
    """World v2.1: a sculpture's object shows its colour (half paint, half stone); a hand-built scene
    without details or theme keeps the grey whose shade alone depends on the colour. Measured on this
    scene: painted chroma (max - min channel) 80-86 for red / blue and 184 apart in mean RGB; bare
    about 10 and 4.3."""
    scene = dataclasses.replace(scene_from_seed(stream_seed("web", 3), style="sculpture", num_objects=1),
                                theme=None, decor=())  # no theme: its palette and cast would recolour the scene
    bare = dataclasses.replace(scene, details=())
    for scene, painted in ((bare, False), (scene, True)):
        red, blue = _object_pixels(scene, "red"), _object_pixels(scene, "blue")
        chroma = min((px.max(-1) - px.min(-1)).mean() for px in (red, blue))
        apart = np.abs(red.mean(0) - blue.mean(0)).sum()
        if painted:
            assert chroma > 40 and apart > 100, (chroma, apart)
        else:
            assert chroma < 15 and apart < 10, (chroma, apart)


# ---------------------------------------------------------------- (b) implicit intents

def _unthemed(i: int):
    return strip_theme(scene_from_seed(stream_seed("cirr", i)), random.Random(i))


@pytest.mark.parametrize("theme", sorted(THEMES))
def test_a_theme_shows_in_pixels_outside_the_objects(theme):
    """Same scene with and without the theme, same nuisance seed and per-part streams: the
    images differ, and they differ outside every object (background, decor, colour cast)."""
    for i in range(3):
        plain = _unthemed(i)
        themed = apply_theme(plain, theme, random.Random(i))
        a = render_scene(plain, 11, per_part=True)
        b = render_scene(themed, 11, per_part=True)
        outside = ~np.any(np.stack(list(a.masks.values()) + list(b.masks.values())), axis=0)
        diff = np.abs(a.image.astype(int) - b.image.astype(int)).sum(-1)
        # mean over the pixels outside every object, summed over RGB; measured: festive (decor
        # and a mild cast, no background) 14-45, every other theme 35-570; a re-render with
        # another nuisance seed would differ everywhere, so the seed is the same on both sides
        assert diff[outside].mean() > 8, (theme, i)
        assert (diff[outside] > 60).sum() >= 15, (theme, i)
        # the decor alone is visible too
        no_decor = render_scene(dataclasses.replace(themed, decor=()), 11, per_part=True).image.astype(int)
        assert (np.abs(b.image.astype(int) - no_decor).sum(-1) > 40).sum() >= 10, (theme, i)


def test_theme_bundle_and_diff():
    rng = random.Random(0)
    for i in range(50):
        plain = _unthemed(i)
        theme = rng.choice(sorted(THEMES))
        themed = apply_theme(plain, theme, rng)
        bundle = THEMES[theme]
        assert all(o.colour in bundle.palette for o in themed.objects)
        assert themed.decor == bundle.decor and themed.theme == theme
        assert themed.background == (bundle.background or plain.background)
        changes = scene_diff(plain, themed)
        assert [c.kind for c in changes] == [IMPLICIT] and modification_type(changes) == IMPLICIT
        assert set(changes[0].colours) == {o.colour for o in themed.objects}
        assert not edit_is_possible(themed, IMPLICIT)
        # another change beside the theme stays its own change
        moved = apply_edit(themed, "style", rng)
        assert [c.kind for c in scene_diff(plain, moved)] == [IMPLICIT, "style"]
    with pytest.raises(ValueError, match="can remove a theme"):
        scene_diff(themed, plain)


def test_t_int_names_the_theme_and_its_realisation_and_annotators_only_the_theme():
    colour_words = re.compile(r"\b(" + "|".join(COLOURS) + r")\b")
    rng = random.Random(2)
    for i in range(60):
        plain = _unthemed(i)
        theme = sorted(THEMES)[i % len(THEMES)]
        themed = apply_theme(plain, theme, rng)
        bundle = THEMES[theme]
        names = (bundle.adjective, *bundle.nouns)
        t_int = pseudo_manipulation(plain, themed, rng)
        assert any(n in t_int for n in names), t_int
        assert all(o.colour in t_int for o in themed.objects), t_int       # the palette as realised
        assert all(d in t_int for d in bundle.decor), t_int                 # the added objects
        if bundle.background:
            assert f"on {bundle.background}" in t_int, t_int
        ann = annotator_text(plain, themed, rng)
        assert any(n in ann or bundle.when in ann for n in names), ann
        assert not colour_words.search(ann) and not any(d in ann for d in bundle.decor), ann


def test_intent_shards_of_themed_images_often_carry_the_theme_as_t_int():
    from toyworld.intent_data import ToyShardConfig, make_toy_sample

    cfg = ToyShardConfig()
    theme_words = [w for t in THEMES.values() for w in (t.adjective, *t.nouns)]
    themed = implicit = 0
    for i in range(120):
        sample = make_toy_sample(i, cfg, key=f"k{i}")
        assert sample.meta["toy"]["world_version"] == WORLD_VERSION == "toy-world-2.1"
        if sample.meta["toy"]["scene"]["theme"] is not None:
            themed += 1
            implicit += any(w in sample.intent for w in theme_words)
    assert themed > 15 and 0.3 * themed < implicit < 0.8 * themed  # P_THEME_SOURCE = 0.5


# ------------------------------------------------------- (a) edit phrasing in web text

EDIT_PHRASING = re.compile(
    r"\b(make|change|turn|replace|swap|remove|without|instead|add|put|place|move|delete|rid|take away|include|"
    r"also show|extra|color the|should be|enlarge|shrink|keep|leave|version|feel like|give it|the same scene)\b")


def _edit_share(n: int = 2000) -> float:
    rng = random.Random(0)
    texts = [web_text(scene_from_seed(stream_seed("web", i)), rng) for i in range(n)]
    return 100.0 * sum(bool(EDIT_PHRASING.search(t)) for t in texts) / n


def test_web_text_edit_share():
    """Designed: 2.5 % edit-form captions. About a fifth of edit-form captions are target
    descriptions ("shows ...") that the detector does not flag, so the expected detected share
    is ~2 % (binomial sd over 2,000: 0.3 points)."""
    from toyworld.texts import WEB_TEXT_MIX

    assert WEB_TEXT_MIX["edit"] == 0.025 and sum(WEB_TEXT_MIX.values()) == 1.0
    assert 1.0 <= _edit_share() <= 4.0


def test_web_text_seldom_names_a_theme_but_names_its_parts():
    rng = random.Random(3)
    theme_words = re.compile(r"\b(" + "|".join(w for t in THEMES.values() for w in (t.name, t.adjective)) + r")\b")
    texts = [web_text(scene_from_seed(stream_seed("web", i)), rng) for i in range(2000)]
    assert sum(bool(theme_words.search(t)) for t in texts) / 20 < 2.0  # designed: about 1 %
    decor = sum(any(d in t for th in THEMES.values() for d in th.decor) for t in texts) / 20
    assert decor > 5.0


# ------------------------------------------------------------------------- benchmarks

def test_toy_cirr_has_implicit_queries(tmp_path):
    from toyworld.benchmarks import ToyBenchmarkConfig, is_done, write_benchmarks

    cfg = ToyBenchmarkConfig(cirr_sets=20, cirr_implicit_share=0.5)
    write_benchmarks(tmp_path, cfg, which=("cirr",), progress=False)
    captions = json.loads((tmp_path / "cirr" / "captions" / "cap.rc2.val.json").read_text())
    implicit = [c for c in captions if c["toy_type"] == IMPLICIT]
    assert len(implicit) >= 5
    colour_words = re.compile(r"\b(" + "|".join(COLOURS) + r")\b")
    assert not any(colour_words.search(c["caption"]) for c in implicit)
    marker = json.loads((tmp_path / "cirr" / "toy_benchmark.json").read_text())
    assert marker["world_version"] == "toy-world-2.1"
    assert is_done(tmp_path / "cirr", "cirr", cfg)
    assert not is_done(tmp_path / "cirr", "cirr", dataclasses.replace(cfg, cirr_sets=21))
    # a folder written while the world was a setting is still done (its world version says it all)
    marker["config"]["world"] = "v2"
    (tmp_path / "cirr" / "toy_benchmark.json").write_text(json.dumps(marker))
    assert is_done(tmp_path / "cirr", "cirr", cfg)
    marker["world_version"] = "toy-world-1"
    (tmp_path / "cirr" / "toy_benchmark.json").write_text(json.dumps(marker))
    assert not is_done(tmp_path / "cirr", "cirr", cfg)


def test_cirr_sets_apply_a_theme_to_an_unthemed_reference_and_n1_is_another_theme():
    from toyworld.cirr import build_cirr_set

    for seed in range(20):
        cset = build_cirr_set(random.Random(seed), implicit_share=1.0)
        base, target, n1 = cset.members[:3]
        assert base.theme is None and target.theme is not None and n1.theme not in (None, target.theme)
        assert modification_type(scene_diff(base, target)) == IMPLICIT
        assert len({m.canonical() for m in cset.members}) == 6
    # share 0: no set applies a theme (a target is themed only when its reference already was)
    for seed in range(20):
        base, target = build_cirr_set(random.Random(seed), 0.0).members[:2]
        assert target.theme == base.theme
        assert modification_type(scene_diff(base, target)) != IMPLICIT


def test_other_benchmarks_have_details(tmp_path):
    from toyworld.benchmarks import single_object_scene

    assert single_object_scene(random.Random(0), "star", "toy").details
    assert all(s in BACKGROUNDS for s in (single_object_scene(random.Random(i), "star", "photo").background
                                          for i in range(20)))


# ------------------------------------------------- caches written while the world was a setting

def test_caches_written_before_the_settings_were_removed_still_count(tmp_path):
    from demind.shard_format import ShardOutput
    from toyworld.clip_config import ToyBackboneConfig
    from toyworld.clip_cache import cache_key
    from toyworld.intent_data import ToyShardConfig, _is_current, write_toy_shards

    # the default toy CLIP's key, computed before world, aux_*, pretrain_anneal and lock_image went:
    # its cached weights (minutes of training) are found again
    assert cache_key(ToyBackboneConfig()) == "3995a2d1fc64430a"
    cfg = ToyShardConfig(num_samples=4, samples_per_shard=4)
    write_toy_shards(tmp_path, cfg, show_progress=False, workers=1)
    output = ShardOutput.for_id(tmp_path, 0)
    assert _is_current(output, cfg)
    stats = output.load_stats()
    output.mark_done({**stats, "config": {**stats["config"], "world": "v2"}})  # as the setting wrote it
    assert _is_current(output, cfg)
    output.mark_done({**stats, "world_version": "toy-world-1"})
    assert not _is_current(output, cfg)


def test_the_world_is_no_longer_a_setting(capsys):
    from demind.config import ConfigError, load_config
    from toyworld.cli.quickstart import main
    from toyworld.pipeline import QuickstartConfig

    with pytest.raises(ConfigError, match="world"):
        load_config(QuickstartConfig, None, ["world=v2"])
    for old, new in (("world=v1", "one version"), ("backbone.world=v2", "one version"),
                     ("progress=false", "run.progress"), ("--quiet", "run.progress=false")):
        assert main([old]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and old.split("=")[0] in err[0] and new in err[0]


# -------------------------------------------------------------------- per-type recall

def test_per_type_recall_reports_implicit_by_hand():
    from toyworld.results import per_type_metrics, recall_by_type

    captions = [{"pairid": 0, "target_hard": "a", "toy_type": "implicit"},
                {"pairid": 1, "target_hard": "b", "toy_type": "implicit"},
                {"pairid": 2, "target_hard": "c", "toy_type": "colour"},
                {"pairid": 3, "target_hard": "d", "toy_type": "multi"}]
    seed0 = {"m": {"0": ["a"], "1": ["x", "b"], "2": ["x", "y"], "3": ["d"]}}
    seed1 = {"m": {"0": ["x", "a"], "1": ["x", "y"], "2": ["c"], "3": ["x", "y"]}}
    r0, r1 = recall_by_type(captions, seed0, ks=(1, 2)), recall_by_type(captions, seed1, ks=(1, 2))
    # seed 0: implicit hits a@1, b@2 -> R@1 50, R@2 100; colour misses; multi hits
    assert r0["m"]["implicit"] == {"R@1": 50.0, "R@2": 100.0, "n": 2}
    assert r0["m"]["colour"] == {"R@1": 0.0, "R@2": 0.0, "n": 1}
    assert r0["m"]["all"] == {"R@1": 50.0, "R@2": 75.0, "n": 4}
    # seed 1: implicit a@2 only -> R@1 0, R@2 50
    assert r1["m"]["implicit"] == {"R@1": 0.0, "R@2": 50.0, "n": 2}
    runs = {"demind": {0: {"cirr": {"per_type": r0}}, 1: {"cirr": {"per_type": r1}}},
            "no-gate": {0: {"cirr": {"per_type": r0}}}}
    out = per_type_metrics(runs)
    cell = out["m"]["implicit"]
    assert cell["n"] == 2 and cell["R@2"]["per_seed"] == {0: 100.0, 1: 50.0}
    assert cell["R@2"]["mean"] == 75.0 and cell["R@2"]["std"] == pytest.approx(35.3553, abs=1e-3)
    assert cell["R@1"]["mean"] == 25.0
    assert out["m [no-gate]"]["implicit"]["R@1"] == {"per_seed": {0: 50.0}, "mean": 50.0, "std": 0.0}


# --------------------------------------------------------------- the quickstart, implicit

@pytest.mark.slow
def test_quickstart_reports_implicit(tmp_path):
    """A tiny quickstart with every toy-CIRR set implicit: results.json with the world's version,
    ``per_type`` holding ``implicit``, and the printed per-type table naming it."""
    from test_quickstart import tiny_config

    from toyworld.pipeline import run_quickstart

    cfg = tiny_config(tmp_path, benchmarks=["cirr"])
    cfg.toy_benchmarks.cirr_implicit_share = 1.0
    summary = run_quickstart(cfg)
    qs = tmp_path / "qs"
    assert (qs / "shards").is_dir() and (qs / "benchmarks" / "cirr").is_dir()
    saved = json.loads((qs / "results.json").read_text())
    assert saved["world_version"] == "toy-world-2.1"
    assert saved["per_type"]["demind"]["implicit"]["n"] >= 4
    assert 0.0 <= saved["per_type"]["demind"]["implicit"]["R@10"]["mean"] <= 100.0
    assert "implicit" in summary["per_type_table"]
    report = json.loads(next((qs / "backbone").glob("*.json")).read_text())
    assert report["world_version"] == "toy-world-2.1"
