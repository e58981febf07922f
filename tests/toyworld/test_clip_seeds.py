"""toyworld/lab/clip_seeds.py: the toy CLIP over seeds, its probes and their mean ± std."""

from __future__ import annotations

import dataclasses
import json

from toyworld.lab import clip_seeds as toy_clip_seeds
from toyworld.clip_config import ToyBackboneConfig
from toyworld.clip_cache import ensure_toy_backbone
from toyworld.probes import PAIR_PROBE_ATTRIBUTES

TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 1, "width": 32, "head_width": 8, "patch_size": 16},
    "text_cfg": {"context_length": 56, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 1},
}


def test_each_seed_is_trained_once_and_its_probes_are_read_from_its_report(tmp_path):
    model_json = tmp_path / "toy-clip-seeds-test.json"
    model_json.write_text(json.dumps(TINY))
    base = ToyBackboneConfig(model_config=str(model_json), steps=1, batch_size=4, warmup_steps=1, num_train_images=8,
                             num_eval_scenes=10, num_pair_probe_scenes=4, pretrain_steps=1, pretrain_first_steps=1)
    by_seed = toy_clip_seeds.probes_by_seed(base, [0, 1], tmp_path / "backbone", progress=False)
    for seed in (0, 1):  # the same numbers as the cached report of that seed's toy CLIP
        _, report = ensure_toy_backbone(dataclasses.replace(base, seed=seed), tmp_path / "backbone", progress=False)
        assert {a: by_seed[seed][a] for a in PAIR_PROBE_ATTRIBUTES} == report["pair_probes"]
    assert len(list((tmp_path / "backbone").glob("*.safetensors"))) == 2  # two seeds, two toy CLIPs


def test_the_table_gives_each_seed_and_the_mean_and_sample_std():
    rows = {0: {a: 90.0 for a in PAIR_PROBE_ATTRIBUTES}, 1: {a: 94.0 for a in PAIR_PROBE_ATTRIBUTES}}
    rows[0]["train_seconds"] = rows[1]["train_seconds"] = 1.0
    table = toy_clip_seeds.format_table(rows)
    # mean 92, sample std sqrt(((90-92)^2 + (94-92)^2) / 1) = 2.83
    assert table.splitlines()[-1] == "| mean ± std | " + " | ".join(["92.0 ± 2.8"] * 6) + " | |"
    assert "| 0 | 90.0 |" in table and "| 1 | 94.0 |" in table
