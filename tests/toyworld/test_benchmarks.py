"""Toy benchmarks: official on-disk formats, ground truth by construction, and the eval readers."""

from __future__ import annotations

import dataclasses

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from toy_helpers import load_exclusion_json
import random

from toyworld.benchmarks import ToyBenchmarkConfig, write_benchmarks
from toyworld.cirr import CIRR_DESIGNS, build_cirr_set
from toyworld.world import DOMAINS, EDIT_KINDS, IMPLICIT, SHAPES, modification_type, scene_diff

SMALL = ToyBenchmarkConfig(cirr_sets=6, imgnet_queries_per_class=2, imgnet_targets_per_domain=2,
                           imgnet_distractors_per_class=1, coco_images=6, exclusion_queries=4,
                           exclcoco_train_images=40, exclcoco_test_images=30)


@pytest.fixture(scope="module")
def bench_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("toybench")
    write_benchmarks(root, SMALL, progress=False)
    return root


def test_cirr_files_have_the_official_structure(bench_root):
    captions = json.loads((bench_root / "cirr/captions/cap.rc2.val.json").read_text())
    split = json.loads((bench_root / "cirr/image_splits/split.rc2.val.json").read_text())
    per_set = 6 + CIRR_DESIGNS[SMALL.cirr_version].lookalikes  # members + gallery look-alikes
    assert len(captions) == 2 * SMALL.cirr_sets and len(split) == per_set * SMALL.cirr_sets
    for name, rel in split.items():
        assert rel == f"./dev/{name}.png" and (bench_root / "cirr" / rel).is_file()
    for e in captions:
        assert {"pairid", "reference", "target_hard", "target_soft", "caption", "img_set", "toy_type"} <= set(e)
        members = e["img_set"]["members"]
        assert len(members) == 6 and e["reference"] in members and e["target_hard"] in members
        assert members[e["img_set"]["reference_rank"]] == e["reference"]
        assert members[e["img_set"]["target_rank"]] == e["target_hard"]
        assert e["toy_type"] in EDIT_KINDS + ("multi", IMPLICIT)  # implicit: a theme
        assert isinstance(e["caption"], str) and e["caption"]
    assert len({e["pairid"] for e in captions}) == len(captions)


def test_cirr_sets_are_distinct_with_the_designed_distractors():
    import random

    for seed in range(30):
        cset = build_cirr_set(random.Random(seed))
        base, target, n1, n2, n3, n4 = cset.members
        assert len({m.canonical() for m in cset.members}) == 6
        assert len(scene_diff(base, target)) == 1             # one edit
        assert len(scene_diff(target, n2)) == 1               # target + an unmentioned change
        assert cset.queries == [(0, 1), (4, 1)]


@pytest.mark.parametrize("version", ["cirr-2", "cirr-3"])
def test_calibrated_cirr_sets_name_one_change_of_a_target_that_differs_more(version):
    """cirr-2 and cirr-3 (the default: cirr-2 without gallery look-alikes): the text is written from
    U = B + unnamed edits to T = U + the named edit, so it names one
    change; B -> T also holds the unnamed ones (on other objects or the scene); the copies of the
    named change on the reference (N4, the gallery look-alikes) fit the text as the target does."""
    from toyworld.cirr import CIRR_DESIGNS, cirr_set
    from toyworld.texts import modification_text

    design = CIRR_DESIGNS[version]
    assert SMALL.cirr_version == "cirr-3"
    assert CIRR_DESIGNS["cirr-3"] == dataclasses.replace(CIRR_DESIGNS["cirr-2"], lookalikes=0)
    kinds = []
    for set_id in range(40):
        cset, _ = cirr_set(version, set_id, 0.2)
        base, target, n1, n2, n3, n4 = cset.members
        (source, text_target), second = cset.texts
        assert text_target is target and second == (source, target)
        named = scene_diff(source, target)
        assert len(named) == 1                                 # the text names one change
        kinds.append(named[0].kind)
        assert base.canonical() != source.canonical()          # ... and the target differs by more
        assert len(scene_diff(base, target)) >= 2 or named[0].kind == IMPLICIT
        assert len(cset.extras) == design.lookalikes
        if design.edited_references:                           # N4 = B + the named change
            assert modification_type(scene_diff(base, n4)) == named[0].kind
            assert [c.kind for c in scene_diff(n4, target)] != []
        for extra in cset.extras:
            assert extra.canonical() not in {m.canonical() for m in cset.members}
        assert len({m.canonical() for m in cset.members + cset.extras}) == 6 + design.lookalikes
        text = modification_text(source, target, random.Random(set_id), "annotator", design.p_description,
                                 design.p_keep, design.p_background, design.p_context)
        assert text
    assert len(set(kinds)) >= 6  # every kind of edit is named somewhere


def test_imagenet_lists_follow_pic2word(bench_root):
    queries = (bench_root / "imgnet/imgnet_real_query.txt").read_text().splitlines()
    targets = (bench_root / "imgnet/imgnet_targets.txt").read_text().splitlines()
    assert len(queries) == len(SHAPES) * 2
    assert len(targets) == len(SHAPES) * (len(DOMAINS) * 2 + 1)
    labels = set()
    for line in queries + targets:
        path, label = line.split()
        assert line.endswith(" ") and (bench_root / path).is_file()
        labels.add(int(label))
    for c in range(len(SHAPES)):
        for d, domain in enumerate(DOMAINS):
            assert c + 1000 * d in labels
        assert c + 6000 in labels
    first_target = targets[0].split()[0]
    assert first_target.startswith("imgnet/imagenet-r/circle/cartoon_")


def test_coco_csv_and_masked_images(bench_root):
    with (bench_root / "coco/coco_eval.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["id", "query_regions", "query_class", "classes"]
    for name, region, query_class, classes in rows[1:]:
        x1, y1, x2, y2 = (int(v) for v in region.strip().split(";"))
        area = (x2 - x1) * (y2 - y1)
        assert 0.05 * 64 * 64 < area < 0.5 * 64 * 64
        assert query_class in SHAPES and all(c in SHAPES and c != query_class for c in classes.split(";"))
        masked = np.asarray(Image.open(bench_root / "coco/val2017_masked" / name))
        full = np.asarray(Image.open(bench_root / "coco/val2017" / name))
        assert masked.shape == full.shape == (64, 64, 3)
        outside = np.ones((64, 64), bool)
        outside[y1:y2, x1:x2] = False
        assert masked[outside].mean() > 245  # white outside the query object (JPEG noise aside)


def test_exclusion_file_is_consistent(bench_root):
    data = load_exclusion_json(bench_root / "exclusion/exclusion.json")
    assert len(data["queries"]) == SMALL.exclusion_queries
    for q in data["queries"]:
        ex = q["excluded"]
        assert f"{ex['colour']} {ex['shape']}" in q["text"] and f"{ex['colour']} {ex['shape']}" in q["modification"]
        assert q["reference"] in q["hard_negatives"] and q["target"] in q["positives"]
        assert not set(q["positives"]) & set(q["hard_negatives"])


def test_exclusion_reader_rejects_bad_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="x.json"):
        load_exclusion_json(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="expected format"):
        load_exclusion_json(bad)


def test_rerun_skips_finished_benchmarks(bench_root):
    marker = bench_root / "cirr/toy_benchmark.json"
    before = marker.stat().st_mtime_ns
    write_benchmarks(bench_root, SMALL, which=("cirr",), progress=False)
    assert marker.stat().st_mtime_ns == before



def test_one_toy_benchmark_is_written_again_unless_its_marker_records_this_config_and_design(tmp_path):
    """The toy CIRR that the full-size benchmark and the lab scripts use: a folder with the files but
    no marker (as they once checked), another set count or another design is written again."""
    from toyworld.benchmarks import write_benchmark

    folder = tmp_path / "cirr"
    captions = folder / "captions" / "cap.rc2.val.json"
    small = ToyBenchmarkConfig(cirr_sets=2)
    write_benchmark(folder, "cirr", small, progress=False)
    queries = len(json.loads(captions.read_text()))
    (folder / "toy_benchmark.json").unlink()  # files present, provenance unknown: written again
    captions.write_text("[]")
    write_benchmark(folder, "cirr", small, progress=False)
    assert len(json.loads(captions.read_text())) == queries
    written = captions.stat().st_mtime_ns
    write_benchmark(folder, "cirr", small, progress=False)  # same config: skipped
    assert captions.stat().st_mtime_ns == written
    write_benchmark(folder, "cirr", dataclasses.replace(small, cirr_sets=3), progress=False)
    assert len(json.loads(captions.read_text())) == queries * 3 // 2
    other = dataclasses.replace(CIRR_DESIGNS["cirr-3"], p_description=1.0)
    three = dataclasses.replace(small, cirr_sets=3)
    before = captions.read_text()
    write_benchmark(folder, "cirr", three, progress=False, design=CIRR_DESIGNS["cirr-3"])  # the version's own design
    assert captions.read_text() == before
    write_benchmark(folder, "cirr", three, progress=False, design=other)
    assert captions.read_text() != before
    written = captions.stat().st_mtime_ns
    write_benchmark(folder, "cirr", three, progress=False, design=other)  # its design read back from JSON: skipped
    assert captions.stat().st_mtime_ns == written
    with pytest.raises(ValueError, match="only cirr takes one"):
        write_benchmark(tmp_path / "coco", "coco", small, design=other)

def test_same_config_same_files(tmp_path):
    cfg = ToyBenchmarkConfig(cirr_sets=2, coco_images=2)
    write_benchmarks(tmp_path / "a", cfg, which=("cirr", "coco"), progress=False)
    write_benchmarks(tmp_path / "b", cfg, which=("cirr", "coco"), progress=False)
    for rel in ("cirr/captions/cap.rc2.val.json", "cirr/dev/dev-0-0-img0.png", "coco/coco_eval.csv",
                "coco/val2017/000000000001.jpg"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


# --- through the evaluation readers (demind/eval) ------------------------------------

def test_imagenet_r_reader_loads_toy_lists(bench_root):
    from demind.eval.imagenet_r import read_imagenet_r

    data = read_imagenet_r(bench_root / "imgnet")
    assert [g.name for g in data.groups] == list(DOMAINS)
    group = data.groups[0]
    assert len(group.queries) == len(SHAPES) * 2
    assert all(len(q.targets) == 2 for q in group.queries)  # 2 cartoons of the query's class


def test_coco_reader_loads_toy_csv(bench_root):
    from demind.eval.coco import read_coco

    data = read_coco(bench_root / "coco", csv_path=bench_root / "coco/coco_eval.csv")
    queries = data.groups[0].queries
    assert len(queries) == SMALL.coco_images
    assert "val2017_masked" in str(queries[0].reference.path)


def test_cirr_reader_loads_toy_files(bench_root):
    from demind.eval.cirr import read_cirr

    data = read_cirr(bench_root / "cirr")
    group = data.groups[0]
    per_set = 6 + CIRR_DESIGNS[SMALL.cirr_version].lookalikes
    assert len(group.queries) == 2 * SMALL.cirr_sets and len(group.gallery) == per_set * SMALL.cirr_sets


def test_exclusion_reader_loads_toy_file(bench_root):
    from demind.eval.harness import read_benchmark

    data = read_benchmark("exclusion", bench_root / "exclusion")
    group = data.groups[0]
    raw = load_exclusion_json(bench_root / "exclusion/exclusion.json")
    assert group.metric == "map" and len(group.queries) == SMALL.exclusion_queries
    assert len(group.gallery) == len(raw["images"]) == 5 * SMALL.exclusion_queries
    for q, spec in zip(group.queries, raw["queries"]):
        assert q.targets == tuple(spec["positives"]) and q.exclude == spec["reference"]
        assert q.prompt == f"a photo of * , {spec['modification']}" and q.text == spec["text"]
        assert q.reference.path.is_file()


def test_exclusion_eval_reader_names_the_problem(tmp_path):
    from demind.eval.exclusion import FORMAT, read_exclusion as read_for_eval
    from demind.eval.structures import DataLayoutError

    with pytest.raises(DataLayoutError, match="exclusion.json"):
        read_for_eval(tmp_path)
    query = {"id": 3, "reference": "a", "target": "b", "modification": "without the red square",
             "text": "t", "positives": ["a", "b"], "hard_negatives": []}
    (tmp_path / "exclusion.json").write_text(json.dumps({"format": FORMAT, "images": {"a": "a.png", "b": "b.png"},
                                                         "queries": [query]}))
    with pytest.raises(ValueError, match="query 3: its reference a cannot be a positive"):
        read_for_eval(tmp_path)
    query["positives"] = ["b"]
    (tmp_path / "exclusion.json").write_text(json.dumps({"format": FORMAT, "images": {"a": "a.png", "b": "b.png"},
                                                         "queries": [query]}))
    with pytest.raises(DataLayoutError, match="a.png"):  # images listed but absent
        read_for_eval(tmp_path)


def test_toy_exclcoco_ground_truth_from_the_instances(bench_root):
    from demind.eval.exclcoco import read_exclcoco

    for split in ("train", "test"):
        data = json.loads((bench_root / "exclcoco" / split / "exclcoco.json").read_text())
        inst = json.loads((bench_root / "exclcoco" / "coco" / "annotations" / f"instances_{split}.json").read_text())
        names = {c["id"]: c["name"] for c in inst["categories"]}
        assert len(names) == 64 and names[1] == "red circle"
        shapes = {str(i["id"]): set() for i in inst["images"]}
        for a in inst["annotations"]:
            shapes[str(a["image_id"])].add(names[a["category_id"]])
        assert data["queries"] and data["labels"]["caption_words"] == []
        for q in data["queries"]:
            assert q["ground_truth"] == sorted((i for i, s in shapes.items()
                                               if set(q["include"]) <= s and q["exclude"] not in s), key=int)
        assert len(read_exclcoco(bench_root / "exclcoco" / split).groups[0].gallery) == len(inst["images"])
    train = json.loads((bench_root / "exclcoco" / "coco" / "annotations" / "captions_train.json").read_text())
    test = json.loads((bench_root / "exclcoco" / "coco" / "annotations" / "captions_test.json").read_text())
    # disjoint seed streams: the two splits' scenes (hence captions) differ
    assert {c["caption"] for c in train["annotations"]} != {c["caption"] for c in test["annotations"]}


def test_toy_queries_carry_the_target_description(bench_root):
    from demind.eval.harness import read_benchmark
    import random

    from toyworld.texts import full_description
    from toyworld.cirr import cirr_set
    from demind.seeding import derive_seed

    cirr = read_benchmark("cirr", bench_root / "cirr").groups[0].queries
    captions = json.loads((bench_root / "cirr/captions/cap.rc2.val.json").read_text())
    assert [q.target_description for q in cirr] == [e["target_description"] for e in captions]
    # the description is the target scene's, from its own seed: rebuild set 0's target
    cset, _ = cirr_set(SMALL.cirr_version, 0, SMALL.cirr_implicit_share)
    ref, tgt = cset.queries[0]
    assert cirr[0].target_description == full_description(
        cset.members[tgt], random.Random(derive_seed("cirr", "description", 0, tgt)))
    excl = read_benchmark("exclusion", bench_root / "exclusion").groups[0].queries
    assert all(q.target_description and q.target_description != q.text for q in excl)


def test_oracle_method_embeds_the_description_and_refuses_without_one(bench_root, tiny_backbone, tmp_path):
    import shutil

    import torch.nn.functional as F

    from demind.config import ConfigError
    from demind.eval.harness import evaluate, read_benchmark
    from demind.retrieval import Oracle, parse_method_names

    assert "oracle" not in parse_method_names(None, have_model=True)  # asked for only
    queries = read_benchmark("cirr", bench_root / "cirr").groups[0].queries[:4]
    oracle = Oracle(tiny_backbone)
    texts = oracle.query_texts(queries)
    emb = oracle.embed(None, [q.prompt for q in queries], texts)
    expected = F.normalize(tiny_backbone.encode_text([q.target_description for q in queries]).pooled, dim=-1)
    assert torch_allclose(emb, expected)
    results = evaluate("cirr", bench_root / "cirr", backbone=tiny_backbone, methods="oracle,image-only",
                       progress=False)
    assert set(results["methods"]) == {"oracle", "image-only"}
    # a benchmark without descriptions (real CIRR has none): one clear error
    bare = tmp_path / "cirr"
    shutil.copytree(bench_root / "cirr", bare)
    path = bare / "captions/cap.rc2.val.json"
    captions = json.loads(path.read_text())
    for entry in captions:
        entry.pop("target_description")
    path.write_text(json.dumps(captions))
    with pytest.raises(ConfigError, match="oracle needs each query's target description"):
        evaluate("cirr", bare, backbone=tiny_backbone, methods="oracle", progress=False)


def torch_allclose(a, b) -> bool:
    import torch

    return torch.allclose(a.float().cpu(), b.float().cpu(), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("version, gap, expected", [
    ("cirr-3", 50.0, {"image-only": 31.0, "text-only": 56.5, "image+text": 50.7}),  # the default
    ("cirr-2", 0.0, {"image-only": 24.8, "text-only": 52.5, "image+text": 63.7}),
])
def test_frozen_cirr_baselines_with_the_shipped_toy_clip(tmp_path, version, gap, expected):
    """The calibration records' frozen rows, rerun: the three untrained baselines on the toy CIRR
    (300 sets) with the shipped toy CLIP and its modality gap (docs/lab-notes/calibrated-cirr.md)."""
    from demind.eval.harness import evaluate
    from toyworld.cirr import write_cirr
    from toyworld.clip_config import ToyBackboneConfig
    from toyworld.pipeline import QuickstartConfig, ToyRunConfig, prepare_backbone

    assert (ToyBenchmarkConfig().cirr_version, ToyBackboneConfig().modality_gap) == ("cirr-3", 50.0)
    cfg = ToyBenchmarkConfig(cirr_version=version)
    write_cirr(tmp_path / "cirr", cfg, progress=False)
    backbone, _, _ = prepare_backbone(QuickstartConfig(workdir=str(tmp_path), run=ToyRunConfig(progress=False),
                                                       backbone=ToyBackboneConfig(modality_gap=gap)))
    results = evaluate("cirr", tmp_path / "cirr", backbone=backbone, methods=list(expected), batch_size=256,
                       progress=False)
    for method, r10 in expected.items():
        assert results["methods"][method]["R@10"] == pytest.approx(r10, abs=0.05)
