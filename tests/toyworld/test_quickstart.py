"""The quickstart end to end on a tiny setting: every stage runs, outputs are written, reruns reuse."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from demind.checkpoint import read_checked_tensors

from toyworld.clip_config import ToyBackboneConfig
from toyworld.benchmarks import ToyBenchmarkConfig
from toy_helpers import per_type_recall
from toyworld.intent_data import ToyShardConfig
from toyworld.pipeline import QuickstartConfig, ToyRunConfig, run_quickstart

TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 1, "width": 32, "head_width": 8, "patch_size": 16},
    "text_cfg": {"context_length": 56, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 1},
}
TINY_TRAIN = ["optim.max_steps=2", "optim.warmup_steps=1", "optim.global_batch_size=8", "data.shuffle_buffer=8",
              "data.shards_per_group=1", "model.num_blocks=1", "model.num_heads=4", "model.mapping_hidden=32",
              "run.save_every=100"]


def tiny_config(tmp_path, **kw) -> QuickstartConfig:
    model_json = tmp_path / "toy-clip-tiny.json"
    model_json.write_text(json.dumps(TINY_CLIP))
    return QuickstartConfig(
        workdir=str(tmp_path / "qs"), train_overrides=TINY_TRAIN, run=ToyRunConfig(progress=False), eval_batch_size=32,
        shards=ToyShardConfig(num_samples=24, samples_per_shard=12),
        toy_benchmarks=ToyBenchmarkConfig(cirr_sets=4, imgnet_queries_per_class=1, imgnet_targets_per_domain=1,
                                          imgnet_distractors_per_class=1, coco_images=4, exclusion_queries=2),
        backbone=ToyBackboneConfig(model_config=str(model_json), steps=2, batch_size=8, warmup_steps=1,
                                   num_train_images=16, num_eval_scenes=10, pretrain_steps=2, pretrain_first_steps=1),
        **kw,
    )


def test_quickstart_runs_every_stage_and_reuses_them(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path)
    summary = run_quickstart(cfg)
    qs = tmp_path / "qs"
    assert (qs / "results.json").is_file() and (qs / "recall_at_k.png").is_file()
    exports = list((qs / "train").glob("*/demind-seed0*/demind.safetensors"))
    assert len(exports) == 1
    # the run folder names the training overrides (by hash): another recipe never reuses this model
    from toyworld.pipeline import run_name

    assert exports[0].parent.name == run_name(cfg, "demind", 0) != "demind-seed0"
    other = dataclasses.replace(cfg, train_overrides=TINY_TRAIN + ["optim.gate_lr=1e-2"])
    assert run_name(other, "demind", 0) != run_name(cfg, "demind", 0)
    assert run_name(dataclasses.replace(cfg, train_overrides=[]), "demind", 0) == "demind-seed0"
    # what demind-serve --quickstart serves, read without the toy package
    from demind.search.run_manifest import read_search_manifest

    assert read_search_manifest(qs) == {"checkpoint": exports[0], "images": qs / "benchmarks" / "cirr" / "dev",
                                        "index": qs / "search-index"}
    rows = summary["rows"]
    family = {"osrcir", "cirevl", "demind+mllm"}  # the query-time MLLM family, on toy CIRR only
    assert set(rows) == {"demind", "mapping-only", "image+text", "image-only", "text-only",
                         "demind+deo", "mapping-only+deo", "image+text+deo", "text-only+deo", "oracle"} | family
    for label, row in rows.items():
        keys = ("cirr:R@1", "cirr:R@10") + (() if label in family else ("exclusion:mAP@10",)) + (
            () if label == "oracle" or label in family else ("imagenet-r:average/R@10", "coco:R@1"))
        for key in keys:
            mean, std = row["metrics"][key]
            assert 0.0 <= mean <= 100.0 and std == 0.0
        assert row["per_type"]["all"]["n"] == 2 * 4
    assert "coco:R@1" not in rows["oracle"]["metrics"]
    # results.json: the fields a script reads (README "results.json")
    saved = json.loads((qs / "results.json").read_text())
    assert set(saved["backbone_probes"]) == {"shape", "colour", "size", "position", "background", "style"}
    assert saved["backbone_probes"] == summary["backbone"]["pair_probes"]
    for bench, key in (("cirr", "R@10"), ("exclusion", "mAP@10"), ("coco", "R@1")):
        for method in rows:
            if (method == "oracle" and bench == "coco") or (method in family and bench != "cirr"):
                assert method not in saved["metrics"][bench]
                continue
            cell = saved["metrics"][bench][method][key]
            assert cell["mean"] == pytest.approx(rows[method]["metrics"][f"{bench}:{key}"][0])
            assert cell["per_seed"] == {"0": cell["mean"]} and cell["std"] == 0.0
    export = next((qs / "train").glob("*/demind-seed0*/demind.safetensors"))
    assert saved["gate"] == {"demind": {"0": pytest.approx(math.tanh(float(read_checked_tensors(export)["gate"])))}}
    assert saved["paired"]["0"]["mapping-only"]["R@10"]["p"] == summary["paired"][0]["mapping-only"]["R@10"]["p"]
    assert "demind" in summary["table"] and "text-only" in summary["table"]
    # paired comparison: discordant counts differ exactly by the recall difference
    paired = summary["paired"][0]
    assert set(paired) == set(rows) - {"demind"}
    for other, by_k in paired.items():
        for k in ("R@5", "R@10"):
            diff = rows["demind"]["per_type"]["all"][k][0] - rows[other]["per_type"]["all"][k][0]
            assert by_k[k]["only_demind"] - by_k[k]["only_other"] == round(diff * 8 / 100)
            assert 0.0 <= by_k[k]["p"] <= 1.0
    assert "sign-test" in summary["paired_table"]
    assert all(f"{m} " in summary["paired_table"] for m in family) and "osrcir" in summary["table"]

    # the family's own pairs: discordant counts differ exactly by the recall difference, as above
    pairs = summary["family_paired"][0]
    assert set(pairs) == {"demind+mllm vs osrcir", "osrcir vs cirevl"} and "MLLM family" in summary["family_table"]
    for pair, by_k in pairs.items():
        a, b = pair.split(" vs ")
        for k in ("R@5", "R@10"):
            diff = rows[a]["per_type"]["all"][k][0] - rows[b]["per_type"]["all"][k][0]
            assert by_k[k]["only_a"] - by_k[k]["only_b"] == round(diff * 8 / 100) and 0.0 <= by_k[k]["p"] <= 1.0
    assert saved["family_paired"]["0"] == json.loads(json.dumps(pairs))

    # the toy MLLM's noise model and level are recorded; its answers were generated once and stored
    toy = saved["toy_mllm"]
    assert toy["noise"] == {"p_ignore": 0.2, "p_drop": 0.1, "p_garble": 0.05} == dataclasses.asdict(cfg.mllm.noise)
    assert sum(toy["outcomes"].values()) == 8 and set(toy["outcomes"]) == {"target", "ignore", "drop", "garble"}
    assert toy["methods"] == sorted(family, key=["osrcir", "cirevl", "demind+mllm"].index)
    described = toy["runs"]["0"]
    assert described["model"] == toy["model"] and described["model_loaded"] is True
    assert {d: (v["records"], v["generated_now"]) for d, v in described["describers"].items()} == {
        "osrcir": (8, 8), "cirevl": (8, 8)}
    # osrcir falls back (to the modification text) exactly on the garbled answers
    assert described["describers"]["osrcir"]["fallback"] == toy["outcomes"]["garble"]

    # DEO against its base: the exclusion set's queries all hold a cue, so the per-query AP
    # comparison covers them; on toy CIRR, queries without a cue keep the base ranking exactly.
    deo = summary["deo"][0]
    bases = {"demind", "mapping-only", "image+text", "text-only"}
    assert set(deo["exclusion"]["deo_paired"]) == {b + "+deo" for b in bases}
    for v in deo["exclusion"]["deo_paired"].values():
        assert v["AP@10"]["only_deo"] + v["AP@10"]["only_base"] <= 2 and 0.0 <= v["AP@10"]["p"] <= 1.0
    touched = deo["cirr"]["deo_touched"]
    assert touched["queries"] == 8 and 0 <= touched["touched"] <= 8
    assert touched["untouched_ranking_changed"] == {b + "+deo": 0 for b in bases}
    assert "DEO vs its base" in summary["deo_table"]

    # Second run: nothing is retrained.
    import toyworld.clip_cache as clip_cache
    import demind.training as training

    def fail(*a, **k):
        raise AssertionError("should have been reused")

    import demind.eval

    monkeypatch.setattr(clip_cache, "train_toy_clip", fail)
    monkeypatch.setattr(training, "train", fail)
    monkeypatch.setattr(demind.eval, "evaluate", fail)  # the evaluation is reused too
    again = run_quickstart(cfg)
    assert again["rows"] == rows and again["paired"] == summary["paired"] and again["deo"] == summary["deo"]
    # what a user needs next: the checkpoint (and its training curves), a query to search with
    assert again["checkpoint"] == str(exports[0]) == summary["checkpoint"]
    assert again["training_plot"] == str(exports[0].parent / "training.png")
    assert (exports[0].parent / "training.png").read_bytes()[:4] == b"\x89PNG"
    example = again["search_example"]
    assert (qs / "benchmarks" / "cirr" / "dev").joinpath(example["image"].rsplit("/", 1)[1]).is_file()
    assert example["text"]

    # evaluated again, the family reads its stored descriptions: no toy MLLM is built, same numbers
    monkeypatch.undo()
    import toyworld.describer as describer

    built = []
    monkeypatch.setattr(describer.ToySceneEngine, "generate", lambda self, r: built.append(r) or fail())
    third = run_quickstart(dataclasses.replace(cfg, reevaluate=True))
    assert built == [] and third["rows"] == rows and third["paired"] == summary["paired"]
    for d in third["toy_mllm"]["runs"][0]["describers"].values():
        assert (d["records"], d["generated_now"], d["model_loaded"]) == (8, 0, False)
    assert third["toy_mllm"]["runs"][0]["model_loaded"] is False
    # another noise level is another toy MLLM: the stored results and descriptions do not stand for it
    from toyworld.pipeline import evaluation_stamp

    noisier = dataclasses.replace(cfg, mllm=dataclasses.replace(cfg.mllm, p_ignore=0.4))
    assert evaluation_stamp(noisier, exports[0], ["osrcir"]) != evaluation_stamp(cfg, exports[0], ["osrcir"])
    assert evaluation_stamp(noisier, exports[0], ["demind"]) == evaluation_stamp(cfg, exports[0], ["demind"])

    # asked to, it evaluates again; a retrained checkpoint (other bytes) is never served stale results
    monkeypatch.setattr(clip_cache, "train_toy_clip", fail)
    monkeypatch.setattr(training, "train", fail)
    calls = []
    monkeypatch.setattr(demind.eval, "evaluate", lambda *a, **k: calls.append(a[0]) or fail())
    with pytest.raises(AssertionError, match="reused"):
        run_quickstart(dataclasses.replace(cfg, reevaluate=True))
    assert calls == ["cirr"]
    from toyworld.pipeline import STAMP_NAME, reusable_results

    stamp_file = next((qs / "eval").glob(f"*/demind-seed0*/cirr/{STAMP_NAME}"))
    stamp = json.loads(stamp_file.read_text())
    assert reusable_results(stamp_file.parent, stamp) is not None
    assert reusable_results(stamp_file.parent, {**stamp, "checkpoint_sha256": "0" * 64}) is None


def test_ablations_are_paired_against_the_full_model_of_their_seed(tmp_path):
    """Each Table 5 variant's discordant counts against the full model differ exactly by their
    recall difference on the same queries, and the table names every variant."""
    summary = run_quickstart(tiny_config(tmp_path, ablations=True, benchmarks=["cirr"]))
    paired = summary["ablation_paired"]
    assert set(paired) == {"only-original", "no-distil", "no-gate", "no-global"}
    rows = summary["rows"]
    for variant, by_seed in paired.items():
        assert set(by_seed) == {0}
        label = f"demind [{variant}]"
        for k in ("R@5", "R@10"):
            diff = rows["demind"]["per_type"]["all"][k][0] - rows[label]["per_type"]["all"][k][0]
            cell = by_seed[0][k]
            assert cell["only_full"] - cell["only_variant"] == round(diff * 8 / 100)
            assert 0.0 <= cell["p"] <= 1.0
        assert variant in summary["ablation_table"]
    saved = json.loads((tmp_path / "qs" / "results.json").read_text())
    assert saved["ablation_paired"]["no-gate"]["0"]["R@10"] == paired["no-gate"][0]["R@10"]


def test_per_type_recall_by_hand(tmp_path):
    root = tmp_path / "cirr"
    (root / "captions").mkdir(parents=True)
    caps = [{"pairid": 0, "target_hard": "a", "toy_type": "colour"},
            {"pairid": 1, "target_hard": "b", "toy_type": "colour"},
            {"pairid": 2, "target_hard": "c", "toy_type": "remove"}]
    (root / "captions" / "cap.rc2.val.json").write_text(json.dumps(caps))
    ranking = {"0": ["a", "x"], "1": ["x", "y", "b"], "2": ["x"]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(ranking))
    out = per_type_recall(root, {"m": str(path)}, ks=(1, 3))["m"]
    assert out["colour"] == {"R@1": 50.0, "R@3": 100.0, "n": 2}
    assert out["remove"] == {"R@1": 0.0, "R@3": 0.0, "n": 1}
    assert out["all"]["R@3"] == pytest.approx(200 / 3)


def test_quickstart_command_prints_probes_ceilings_and_gate(monkeypatch, capsys):
    import toyworld.pipeline as pipeline
    from toyworld.cli.quickstart import main

    summary = {"world_version": "toy-world-2.1", "table": "TABLE", "per_type_table": "", "paired_table": "", "deo_table": "", "timings_s": {"train": 1.0}, "plot": None,
               "gate": {"demind": {0: 0.0912}},
               "backbone": {"pair_probes": {"shape": 55.5, "colour": 94.7}, "pair_probe_scenes": 600,
                            "heldout_probe_ceiling_R@10": {"probe:background": 0.3},
                            "heldout_text_to_image": {"probe:background": {"R@1": 0.02, "R@5": 0.1, "R@10": 0.2}}}}
    monkeypatch.setattr(pipeline, "run_quickstart", lambda cfg: summary)
    assert main(["run.progress=false"]) == 0
    out = capsys.readouterr().out
    assert "shape 55.5  colour 94.7" in out and "600 held-out scenes" in out
    assert "2.0 / 10.0 / 20.0   (ceiling 30.0)" in out
    assert "tanh(gate) [demind]: seed 0 0.091" in out
    assert "results:" in out and "try search:" not in out  # no checkpoint in this summary, no search commands


def test_the_end_of_the_quickstart_names_the_checkpoint_and_the_search_commands():
    from toyworld.cli.quickstart import next_steps

    ckpt = "runs/qs/train/abc/demind-seed0/demind.safetensors"
    text = next_steps(QuickstartConfig(workdir="runs/qs"), {
        "checkpoint": ckpt, "plot": "runs/qs/recall_at_k.png", "training_plot": "runs/qs/train/abc/training.png",
        "search_example": {"image": "runs/qs/benchmarks/cirr/dev/dev-0-1-img0.png", "text": "the circle's red"}})
    assert f"checkpoint:      {ckpt}" in text and "training curves: runs/qs/train/abc/training.png" in text
    assert "demind-serve --quickstart runs/qs" in text
    assert f"demind-index --images runs/qs/benchmarks/cirr/dev --index runs/qs/search-index --checkpoint {ckpt}" in text
    assert "--image runs/qs/benchmarks/cirr/dev/dev-0-1-img0.png --text 'the circle'\"'\"'s red'" in text


def test_common_keys_and_training_overrides_are_accepted(tmp_path):
    """run.seed / run.device as in every command; training overrides as a YAML list (docs/quickstart.md)."""
    from demind.config import ConfigError, load_config

    cfg = load_config(QuickstartConfig, None, ["run.seed=1", "run.device=cpu",
                                               "train_overrides=[optim.max_steps=500,optim.lr=1e-4]"])
    assert cfg.seed_list == [1] and cfg.run.device == "cpu"
    assert cfg.train_overrides == ["optim.max_steps=500", "optim.lr=1e-4"]
    assert load_config(QuickstartConfig, None, ["seeds=[0,1,2]"]).seed_list == [0, 1, 2]
    with pytest.raises(ConfigError, match="run.seed"):
        load_config(QuickstartConfig, None, ["run.seed=1", "seeds=[0,2]"])
    with pytest.raises(ConfigError, match="run.device"):
        load_config(QuickstartConfig, None, ["run.device=tpu"])


def test_the_quickstart_checkpoint_loads_from_any_folder(tmp_path, monkeypatch):
    """Paths typed relative to the repository, the checkpoint loaded from elsewhere: the quickstart's
    backbone config records absolute model-config and weights paths, and the shipped config
    resolves from any folder."""
    import torch

    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig, ModelConfig
    from demind.checkpoint import load_backbone_and_model, save_checkpoint
    from demind.model import DeMinds
    from toyworld.clip_config import TOY_CLIP_CONFIG, model_config_path
    from toyworld.pipeline import toy_backbone_config

    run_dir = tmp_path / "repo"
    run_dir.mkdir()
    (run_dir / "toy-clip-tiny.json").write_text(json.dumps(TINY_CLIP))
    monkeypatch.chdir(run_dir)
    random_clip = FrozenCLIP(BackboneConfig(name="toy-clip-tiny.json", pretrained=None))
    torch.save(random_clip.model.state_dict(), "weights.pt")
    backbone = FrozenCLIP(toy_backbone_config("toy-clip-tiny.json", "weights.pt"))
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16), backbone)
    checkpoint = save_checkpoint(run_dir / "demind.safetensors", model)
    monkeypatch.chdir(tmp_path)
    loaded_backbone, loaded = load_backbone_and_model(checkpoint)
    assert loaded_backbone.identity == backbone.identity and loaded is not None
    assert model_config_path(TOY_CLIP_CONFIG).is_file()  # the shipped config, from outside the repository


def test_the_default_recipe_is_found_from_any_folder(tmp_path, monkeypatch):
    from toyworld.pipeline import repository_file

    monkeypatch.chdir(tmp_path)
    assert repository_file("configs/train/toy.yaml").is_file()
    (tmp_path / "mine.yaml").write_text("optim: {lr: 1.0e-4}\n")
    assert repository_file("mine.yaml") == tmp_path.joinpath("mine.yaml").relative_to(tmp_path)

