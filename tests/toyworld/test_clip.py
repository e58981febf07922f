"""Toy CLIP: trains a couple of steps, is cached by config, reloads through FrozenCLIP."""

from __future__ import annotations

import json
import logging
import math
import random

import numpy as np
import open_clip
import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_TOY_CLIP
from toyworld import clip_cache, clip_data, clip_eval, clip_train
from toyworld.clip import build_toy_model, images_to_tensor, model_name
from toyworld.clip_config import TAG_VALUES, ToyBackboneConfig
from toyworld.clip_cache import cached_paths, ensure_toy_backbone, state_path_of
from toyworld.clip_eval import text_to_image_recall
from toyworld.render import render_scene
from toyworld.world import scene_from_seed
from demind.seeding import derive_seed

TINY_CNN = {  # the convnet tower (toyworld/towers.py), with BatchNorm
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "timm_model_name": "demind_toy_convnet", "timm_model_pretrained": False,
                   "timm_pool": "max", "timm_proj": "linear"},
    "text_cfg": {"context_length": 56, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 1},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("toyclip")
    model_json = root / "toy-clip-test.json"
    model_json.write_text(json.dumps(TINY_TOY_CLIP))
    cfg = ToyBackboneConfig(model_config=str(model_json), steps=2, batch_size=8, warmup_steps=1,
                            num_train_images=16, num_eval_scenes=20, num_pair_probe_scenes=8,
                            pretrain_steps=2, pretrain_first_steps=1)  # the default recipe's two stages, tiny
    weights, report = ensure_toy_backbone(cfg, root / "cache", progress=False)
    return cfg, root, weights, report


def test_training_writes_weights_and_report(trained):
    cfg, root, weights, report = trained
    assert weights.is_file() and weights == cached_paths(cfg, root / "cache")[0]
    assert report["config"]["steps"] == 2 and np.isfinite(report["final_loss"])
    assert set(report["heldout_text_to_image"]) == {"full_description", "alt_text", "probe:shape", "probe:colour",
                                                    "probe:position", "probe:background"}
    for texts in report["heldout_text_to_image"]:
        assert set(report["heldout_text_to_image"][texts]) == {"R@1", "R@5", "R@10"}
        assert all(0.0 <= v <= 1.0 for v in report["heldout_text_to_image"][texts].values())
    assert set(report["pair_probes"]) == {"shape", "colour", "size", "position", "background", "style"}
    assert all(0.0 <= v <= 100.0 for v in report["pair_probes"].values()) and report["pair_probe_scenes"] == 8
    assert set(report["heldout_probe_ceiling_R@10"]) == {"probe:shape", "probe:colour", "probe:position",
                                                         "probe:background"}
    text = clip_eval.format_backbone_report(report)
    assert "pair probes" in text and "ceiling" in text
    # training moved the weights away from the seeded random init
    torch.manual_seed(cfg.seed)
    init, _, _ = build_toy_model(cfg)
    saved = load_file(str(weights))
    assert not torch.equal(saved["visual.conv1.weight"], init.state_dict()["visual.conv1.weight"])


def test_cache_is_reused_and_keyed_by_config(trained, monkeypatch):
    cfg, root, weights, report = trained

    def no_training(*args, **kwargs):
        raise AssertionError("cached backbone should have been reused")

    monkeypatch.setattr(clip_cache, "train_toy_clip", no_training)
    again, report2 = ensure_toy_backbone(cfg, root / "cache", progress=False)
    assert report2["pair_probes"] == report["pair_probes"]
    assert again == weights and report2 == report
    other = ToyBackboneConfig(**{**cfg.__dict__, "seed": 1})
    assert cached_paths(other, root / "cache")[0] != weights


def test_open_clip_and_frozen_clip_load_the_saved_file(trained):
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig

    cfg, root, weights, _ = trained
    name = model_name(cfg.model_config)
    direct = open_clip.create_model(name, pretrained=str(weights)).eval()
    saved = load_file(str(weights))
    for key, value in direct.state_dict().items():
        assert torch.equal(value, saved[key]), key

    frozen = FrozenCLIP(BackboneConfig(name=cfg.model_config, pretrained=str(weights)))
    assert frozen.embed_dim == 32 and frozen.context_length == 56
    image = render_scene(scene_from_seed(3), 3).pil()
    ours = images_to_tensor(np.asarray(image)[None])
    theirs = frozen.preprocess(image).unsqueeze(0)
    assert torch.allclose(ours, theirs, atol=1e-5)  # same pixels, same normalisation
    with torch.no_grad():
        expected = direct.encode_image(ours)
    assert torch.allclose(frozen.encode_image(theirs), expected, atol=1e-5)
    out = frozen.encode_text(["make the circle red"])
    with torch.no_grad():
        ref = direct.encode_text(frozen.tokenize(["make the circle red"]))
    assert torch.allclose(out.pooled, ref, atol=1e-5)


def test_recall_against_hand_made_embeddings():
    """An oracle model (text i embeds like image i) gets recall 1; a shuffled one does not."""

    class Oracle(torch.nn.Module):
        def __init__(self, perm):
            super().__init__()
            self.perm = perm

        def encode_image(self, x, normalize=True):
            return torch.nn.functional.normalize(x.flatten(1)[:, :16], dim=-1)

        def encode_text(self, tokens, normalize=True):
            return self.table[tokens[:, 0]]

    images = np.random.default_rng(0).integers(0, 255, size=(6, 64, 64, 3), dtype=np.uint8)
    img_emb = torch.nn.functional.normalize(images_to_tensor(images).flatten(1)[:, :16], dim=-1)
    tokenizer = lambda texts: torch.tensor([[int(t)] for t in texts])  # noqa: E731 - text i -> row i
    oracle = Oracle(None)
    oracle.table = img_emb
    assert text_to_image_recall(oracle, tokenizer, images, [str(i) for i in range(6)], ks=(1,)) == {"R@1": 1.0}
    oracle.table = img_emb[[1, 0, 3, 2, 5, 4]]  # every text points at its neighbour's image
    assert text_to_image_recall(oracle, tokenizer, images, [str(i) for i in range(6)], ks=(1,)) == {"R@1": 0.0}



def test_trimmed_text_encoding_equals_open_clip(trained):
    from toyworld.clip import encode_text_trimmed

    cfg, *_ = trained
    torch.manual_seed(0)
    model, tokenizer, _ = build_toy_model(cfg)
    texts = ["red circle", "a photo of a large blue square at the top left and a small green star on the right, "
             "on a grass background.", "remove the triangle", "make it a cartoon", "x"]
    tokens = tokenizer(texts)
    with torch.no_grad():
        expected = model.encode_text(tokens)
        for chunks in (1, 2, 3, 8):
            assert torch.allclose(encode_text_trimmed(model, tokens, chunks), expected, atol=1e-5)
    encode_text_trimmed(model, tokens).sum().backward()  # gradients reach the text tower
    assert model.token_embedding.weight.grad is not None and model.transformer.resblocks[0].mlp.c_fc.weight.grad is not None


RESUME_CASES = {
    "no pre-training": {"pretrain_steps": 0},
    # state saved on the last pre-training step: the contrastive stage must start a fresh optimizer
    "saved at the stage boundary": {"pretrain_steps": 2, "pretrain_first_steps": 1},
    "saved inside pre-training": {"pretrain_steps": 3, "pretrain_first_steps": 1},
}


@pytest.mark.parametrize("extra", list(RESUME_CASES.values()), ids=list(RESUME_CASES))
def test_killed_training_resumes_where_it_stopped(tmp_path, monkeypatch, extra):
    """Bit-equal weights after a kill and rerun, the tag heads' and the stage's optimizer state
    included (without them, the resumed image tower would receive different gradients)."""
    model_json = tmp_path / "toy-clip-resume.json"
    model_json.write_text(json.dumps(TINY_TOY_CLIP))
    cfg = ToyBackboneConfig(model_config=str(model_json), steps=4, batch_size=8, warmup_steps=1,
                            num_train_images=16, num_eval_scenes=20, **extra)
    reference, _ = clip_train.train_toy_clip(cfg, progress=False)

    real_check, state, seen = clip_train.check_finite_terms, tmp_path / "toy.state.safetensors", []

    def killed_at_step_3(terms, step, **kwargs):  # the trainer checks every step's loss: kill it there
        if step == 3:
            raise KeyboardInterrupt("killed")
        real_check(terms, step, **kwargs)

    def recording(terms, step, **kwargs):
        seen.append(step)
        real_check(terms, step, **kwargs)

    monkeypatch.setattr(clip_train, "check_finite_terms", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        clip_train.train_toy_clip(cfg, progress=False, state_path=state, save_every=2)
    assert state.is_file()
    monkeypatch.setattr(clip_train, "check_finite_terms", recording)
    resumed, _ = clip_train.train_toy_clip(cfg, progress=False, state_path=state, save_every=2)
    assert seen == list(range(2, cfg.pretrain_steps + cfg.steps))  # only the steps after the state
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value)


def test_a_locked_image_tower_keeps_its_pretrained_weights(tmp_path):
    """LiT: the contrastive stage trains the text tower only; the image tower (weights and
    BatchNorm statistics) is the pre-trained one, however long the contrastive stage runs."""
    model_json = tmp_path / "toy-clip-lit.json"
    model_json.write_text(json.dumps(TINY_CNN))
    base = dict(model_config=str(model_json), batch_size=8, warmup_steps=1, num_train_images=16,
                pretrain_steps=2, pretrain_first_steps=1)
    short, _ = clip_train.train_toy_clip(ToyBackboneConfig(**base, steps=1), progress=False)
    long, _ = clip_train.train_toy_clip(ToyBackboneConfig(**base, steps=3), progress=False)
    torch.manual_seed(0)
    init, _, _ = build_toy_model(ToyBackboneConfig(**base))
    init, short, long = init.state_dict(), short.state_dict(), long.state_dict()
    visual = [n for n in init if n.startswith("visual.")]
    assert any("running_mean" in n for n in visual)  # the convnet's BatchNorm statistics are compared too
    for name in visual:
        torch.testing.assert_close(long[name], short[name])
    assert any(not torch.equal(short[n], init[n]) for n in visual if init[n].is_floating_point())  # pre-trained
    text = [n for n in init if not n.startswith("visual.") and init[n].is_floating_point()]
    assert any(not torch.equal(long[n], short[n]) for n in text)  # the text tower kept training


def test_pretraining_asks_for_the_first_tags_only_during_its_first_steps(tmp_path):
    """The tag loss of a first-phase step has no gradient on the other tags' head rows; after
    ``pretrain_first_steps`` every tag's rows get one."""
    from toyworld.clip import tag_columns
    from toyworld.clip_train import _pretrain_loss

    model_json = tmp_path / "toy-clip-tags.json"
    model_json.write_text(json.dumps(TINY_CNN))
    cfg = ToyBackboneConfig(model_config=str(model_json), batch_size=6, pretrain_steps=4, pretrain_first_steps=2)
    model, _, size = build_toy_model(cfg)
    scenes = [scene_from_seed(100 + i) for i in range(6)]
    images = np.stack([render_scene(s, i, size).image for i, s in enumerate(scenes)])
    head = torch.nn.Linear(model.text_projection.shape[1], sum(len(TAG_VALUES[t]) for t in cfg.pretrain_tags))
    columns = tag_columns(cfg.pretrain_tags)
    for step, asked in ((1, {"shape"}), (2, set(cfg.pretrain_tags))):
        head.zero_grad()
        _pretrain_loss(model, head, cfg, step, scenes, images, random.Random(0)).backward()
        for tag, rows in columns.items():
            assert bool(head.weight.grad[rows].abs().sum() > 0) == (tag in asked), (step, tag)


def test_the_schedule_is_constant_in_pretraining_then_warms_up_and_decays(tmp_path):
    """Each stage's optimizer and schedule (the engine's build_adamw and build_lr_scheduler): the
    tag head and image tower, then everything but the image tower; decay on matrices only."""
    model_json = tmp_path / "toy-clip-schedule.json"
    model_json.write_text(json.dumps(TINY_TOY_CLIP))
    cfg = ToyBackboneConfig(model_config=str(model_json), lr=1.0, pretrain_steps=6, pretrain_first_steps=2, steps=10,
                            warmup_steps=2)
    model, _, _ = build_toy_model(cfg)
    heads = {"tag_head": torch.nn.Linear(32, 5)}
    names = {id(p): n for n, p in [*model.named_parameters(), *heads["tag_head"].named_parameters(prefix="tag_head")]}
    lrs = []
    for pretraining, steps in ((True, cfg.pretrain_steps), (False, cfg.steps)):
        optim, sched = clip_train.stage_optimizer(model, cfg, pretraining, heads)
        trained = {names[id(p)] for g in optim.param_groups for p in g["params"]}
        assert all(n.startswith(("visual.", "tag_head.")) == pretraining for n in trained)
        assert "tag_head.weight" in trained if pretraining else "logit_scale" in trained
        for group in optim.param_groups:  # CLIP's rule: no decay on gains, biases, embeddings, the scale
            assert all((p.ndim >= 2 and "embedding" not in names[id(p)]) == (group["weight_decay"] == 0.1)
                       for p in group["params"])
        for _ in range(steps):
            assert len({g["lr"] for g in optim.param_groups}) == 1
            lrs.append(optim.param_groups[0]["lr"])
            optim.step()
            sched.step()
    assert lrs[:6] == [1.0] * 6  # both pre-training phases: constant
    assert lrs[6] == 0.5 and lrs[7] == 1.0  # warm-up of 2 steps
    # then a half cosine over the remaining 8 steps, ending above 0
    assert lrs[8:] == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)])


def test_a_damaged_state_file_is_one_error_naming_it_and_the_cache_trains_again(trained, tmp_path, caplog):
    """The trainer raises one DemindError naming the file before any work; the cache deletes its
    own damaged state, says so, and trains again (the same weights as an undisturbed run). Weights
    an earlier version pickled (``.pt``) are not read, with one line saying so."""
    from demind.errors import DemindError
    from demind.trainkit import save_train_state

    cfg, root, weights, _ = trained
    cache = tmp_path / "cache"
    state = state_path_of(cached_paths(cfg, cache)[0])
    save_train_state(state, step=1, modules={"model": torch.nn.Linear(4, 4)})
    state.write_bytes(state.read_bytes()[:-40])  # truncated, as a full disk leaves it
    with pytest.raises(DemindError) as error:
        clip_train.train_toy_clip(cfg, progress=False, state_path=state)
    assert str(state) in str(error.value) and "truncated or corrupted" in str(error.value)

    legacy = cache / f"{weights.stem.rsplit('-', 1)[0]}-0123456789abcdef.pt"
    legacy.write_bytes(b"not a pickle: never read")
    caplog.set_level(logging.INFO, logger="toyworld")
    again, _ = ensure_toy_backbone(cfg, cache, progress=False)
    ours = [r for r in caplog.records if r.name.startswith("toyworld")]
    warnings = [r.getMessage() for r in ours if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(state) in warnings[0] and "training from the first step" in warnings[0]
    assert sum(legacy.name in r.getMessage() and "not read" in r.getMessage() for r in ours) == 1
    assert not state.exists() and again.suffix == ".safetensors"
    fresh, reference = load_file(str(again)), load_file(str(weights))
    assert fresh.keys() == reference.keys() and all(torch.equal(fresh[k], reference[k]) for k in fresh)


@pytest.mark.parametrize("bad, key", [
    ({"pretrain_first_tags": ("position",)}, "pretrain_first_tags"),
    ({"pretrain_steps": 2, "pretrain_first_steps": 3}, "pretrain_first_steps"),
    ({"pretrain_tags": ()}, "pretrain_first_tags"),
])
def test_inconsistent_pretraining_settings_are_refused_by_name(bad, key):
    from demind.config import ConfigError

    with pytest.raises(ConfigError) as error:
        ToyBackboneConfig(**bad)
    assert error.value.key == key


def test_render_pool_gives_the_same_images_in_one_or_two_processes():
    scenes_one, one = clip_data.render_pool("web", 7, 32, progress=False, workers=1, chunk=3)
    scenes_two, two = clip_data.render_pool("web", 7, 32, progress=False, workers=2, chunk=3)
    assert one.shape == (7, 32, 32, 3) and one.dtype == np.uint8
    assert np.array_equal(one, two) and scenes_one == scenes_two
    # scene i's image is render_scene of that scene with its own nuisance seed
    assert np.array_equal(one[4], render_scene(scenes_one[4], derive_seed("web", "nuisance", 4), 32).image)


def test_probe_texts_name_one_attribute_only():
    from toyworld.world import Scene, ToyObject

    scene = Scene(objects=(ToyObject(0, "heart", "red", "small", "top left"),
                           ToyObject(1, "star", "blue", "large", "center")), background="grass", style="origami")
    assert clip_eval.probe_text(scene, "shape") == "an origami of a heart and a star"
    assert clip_eval.probe_text(scene, "colour") == "an origami of a red object and a blue object"
    assert clip_eval.probe_text(scene, "background") == "an origami on grass"
    assert "heart" not in clip_eval.probe_text(scene, "position")


def test_a_resnet_image_tower_config_builds_and_trains(tmp_path):
    """open_clip's ModifiedResNet (CLIP RN50's tower) reports its image size as an int."""
    model_json = tmp_path / "toy-clip-rn-test.json"
    model_json.write_text(json.dumps({**TINY_TOY_CLIP, "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 8,
                                                             "head_width": 32}}))
    cfg = ToyBackboneConfig(model_config=str(model_json), steps=1, batch_size=4, warmup_steps=1, num_train_images=8,
                            pretrain_steps=1, pretrain_first_steps=1)
    model, _, image_size = build_toy_model(cfg)
    assert image_size == 64
    trained, log = clip_train.train_toy_clip(cfg, progress=False)
    assert np.isfinite(log["final_loss"])


def test_hard_negative_groups_fill_the_batch_with_one_edit_photographs():
    """A group is one scene photographed with the same nuisances, each other member edited in
    exactly one attribute of ``group_edits``, captioned by its full description; the rest of
    the batch is random web pairs."""
    import random

    from toyworld.clip_data import draw_batch, groups_per_batch, render_group_pool, training_pool
    from toyworld.texts import full_description
    from toyworld.world import scene_diff

    cfg = ToyBackboneConfig(batch_size=10, group_share=0.8, group_edits=("shape", "size", "position"),
                            num_group_scenes=3, num_train_images=6)
    assert groups_per_batch(cfg) == 2  # 2 groups of 4 = 8 of 10; at least one random pair stays
    groups, group_images = render_group_pool(3, cfg.group_edits, 64, progress=False)
    assert group_images.shape == (3, 4, 64, 64, 3)
    for members in groups:
        for kind, edited in zip(cfg.group_edits, members[1:]):
            assert [c.kind for c in scene_diff(members[0], edited)] == [kind]
    # same nuisances: an edit changes only a small part of the photograph
    changed = (np.abs(group_images[:, 1:].astype(int) - group_images[:, :1].astype(int)).sum(-1) > 0).mean()
    assert 0.0 < changed < 0.25

    web = [scene_from_seed(7000 + i) for i in range(6)]
    web_images = np.zeros((6, 64, 64, 3), np.uint8)
    rows, texts, shown = draw_batch(cfg, web, groups, 2, random.Random(0))
    images = training_pool(web_images, group_images)[rows]
    assert images.shape == (10, 64, 64, 3) and len(texts) == len(shown) == 10
    group_texts = texts[2:]
    # each member's caption is its own scene's full description (templates vary, the content not)
    for start in (0, 4):
        block = images[2 + start: 2 + start + 4]
        g = next(i for i in range(3) if np.array_equal(group_images[i], block))
        assert shown[2 + start: 2 + start + 4] == groups[g]
        for scene, text in zip(groups[g], group_texts[start:start + 4]):
            assert all(o.shape in text and o.colour in text for o in scene.objects)
            assert text in {full_description(scene, random.Random(s)) for s in range(50)}


def test_attribute_targets_mark_every_value_the_objects_hold():
    from toyworld.clip import attribute_targets
    from toyworld.world import COLOURS, SHAPES, ToyObject, Scene

    scene = Scene(objects=(ToyObject(0, "heart", "red", "small", "top left"),
                           ToyObject(1, "star", "red", "large", "center")), background="grass", style="photo")
    target = attribute_targets([scene], ("shape", "colour"))
    assert target.shape == (1, len(SHAPES) + len(COLOURS))
    expected = torch.zeros(1, len(SHAPES) + len(COLOURS))
    expected[0, SHAPES.index("heart")] = expected[0, SHAPES.index("star")] = 1
    expected[0, len(SHAPES) + COLOURS.index("red")] = 1  # two red objects: one bit
    torch.testing.assert_close(target, expected)
    # scene tags: one bit each, after the object tags in the order asked
    from toyworld.world import BACKGROUNDS, STYLES
    target = attribute_targets([scene], ("size", "background", "style"))
    assert target.shape == (1, 2 + len(BACKGROUNDS) + 3 + len(STYLES))
    assert target[0].nonzero().flatten().tolist() == [0, 1, 2 + BACKGROUNDS.index("grass"),
                                                      2 + len(BACKGROUNDS) + 3 + STYLES.index("photo")]
