"""demind-train-triplets and the benchmark readers against a new user's mistakes: a rerun with another
recipe, data checks before any model loads, CSV quotes, limits, shared caches, duplicate ids."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import TINY_CLIP, write_cirr_layout


def png(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(path)
    return path


def write_triplets(folder: Path, n: int = 16, hard: bool = True) -> Path:
    rows = []
    for i in range(n):
        png(folder / "img" / f"{i}.png", (37 * i) % 255)
        row = {"reference": f"img/{i}.png", "modification": f"make it shade {i % 5}", "target": f"img/{(i + 1) % n}.png"}
        if hard:
            row["hard_modification"] = f"make it shade {(i + 2) % 5}"
        rows.append(row)
    path = folder / "triplets.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(folder: Path, out: Path, **extra) -> list[str]:
    return [f"backbone.name={TINY_CLIP}", "backbone.pretrained=null", "data.source=file",
            f"data.path={folder / 'triplets.jsonl'}", f"data.cache_dir={folder / 'cache'}", f"run.output_dir={out}",
            "run.device=cpu", "run.progress=false", "optim.epochs=2", "optim.batch_size=8",
            "model.projection_dim=16", "model.hidden_dim=16", "run.detection=false",
            *[f"{k}={v}" for k, v in extra.items()]]


def config(folder: Path, out: Path, **extra):
    from demind.config import load_config
    from demind.triplets.config import TripletTrainConfig

    return load_config(TripletTrainConfig, None, overrides(folder, out, **extra))


def no_model_loads(monkeypatch):
    """Any backbone build or accelerator start fails the test: the check must come first."""
    import demind.backbone
    import demind.triplets.train as train_module

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the data were checked")

    monkeypatch.setattr(demind.backbone, "build_backbone", loaded)
    monkeypatch.setattr(train_module, "make_accelerator", loaded)


# --------------------------------------------------------------------------- a rerun with another recipe


def test_a_killed_run_rerun_with_another_recipe_is_refused_naming_the_keys(tmp_path, monkeypatch, capsys,
                                                                          one_thread_and_fresh_accelerator):
    import demind.triplets.train as train_module
    from demind.cli.train_triplets import main
    from demind.trainkit import ResumeError

    write_triplets(tmp_path)
    out = tmp_path / "run"
    real_save = train_module.save_train_state

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt  # killed right after epoch 1's state reached the disk

    monkeypatch.setattr(train_module, "save_train_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_module.train_triplets(config(tmp_path, out))
    monkeypatch.setattr(train_module, "save_train_state", real_save)
    assert (out / "state.safetensors").is_file()

    # another model size: one line, not a size-mismatch traceback
    with pytest.raises(ResumeError, match=r"model\.hidden_dim \(16 -> 32\)"):
        train_module.train_triplets(config(tmp_path, out, **{"model.hidden_dim": 32}))
    # another mode or lr: refused, never resumed under the new recipe
    with pytest.raises(ResumeError, match=r"optim\.lr \(0\.001 -> 0\.01\).*robust\.mode \('none' -> 'gfq'\)"):
        train_module.train_triplets(config(tmp_path, out, **{"robust.mode": "gfq", "optim.lr": 0.01,
                                                             "optim.warmup_epochs": 1}))
    # other triplets under the same path
    kept = (tmp_path / "triplets.jsonl").read_text()
    (tmp_path / "triplets.jsonl").write_text(kept.replace("make it shade 3", "make it shade 9"))
    with pytest.raises(ResumeError, match="the triplets read from data.path"):
        train_module.train_triplets(config(tmp_path, out))
    (tmp_path / "triplets.jsonl").write_text(kept)
    # the command says it in one line
    assert main(overrides(tmp_path, out, **{"optim.lr": 0.01})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot reuse") and "optim.lr" in err[0]

    # where it runs and what it logs may change: the run resumes and finishes
    path = train_module.train_triplets(config(tmp_path, out, **{"run.log_every": 2, "data.encode_batch_size": 3}))
    assert path.is_file() and len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # a finished run is not silently reused under another recipe either
    with pytest.raises(ResumeError, match=r"optim\.epochs \(2 -> 3\)"):
        train_module.train_triplets(config(tmp_path, out, **{"optim.epochs": 3}))
    assert train_module.train_triplets(config(tmp_path, out)) == path


# --------------------------------------------------------------------------- checks before any model loads


def test_hard_noise_without_hard_texts_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from demind.cli.train_triplets import main

    write_triplets(tmp_path, hard=False)
    no_model_loads(monkeypatch)
    args = overrides(tmp_path, tmp_path / "run", **{"noise.kind": "hard", "noise.rate": 0.5})
    # a backbone that would be downloaded (offline: a download error) is never reached
    args = [a for a in args if not a.startswith("backbone.")] + ["backbone.name=ViT-B-32", "backbone.pretrained=openai"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hard_modification" in err[0]


def test_an_unwritable_output_dir_is_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    from demind.cli.train_triplets import main

    write_triplets(tmp_path)
    no_model_loads(monkeypatch)
    (tmp_path / "a-file").write_text("x")
    for bad, key in (("/proc/x", "run.output_dir"), (str(tmp_path / "a-file"), "run.output_dir")):
        assert main(overrides(tmp_path, Path(bad))) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"'{key}'" in err[0] and "Traceback" not in err[0]
    args = overrides(tmp_path, tmp_path / "run") + [f"data.cache_dir={tmp_path / 'a-file' / 'cache'}"]
    assert main(args) == 2
    assert "'data.cache_dir'" in capsys.readouterr().err


# --------------------------------------------------------------------------- CSV quotes


def test_a_csv_quote_left_open_is_refused_at_the_line_that_opened_it(tmp_path):
    from demind.errors import InputError
    from demind.triplets.readers import read_triplet_file

    for i in range(5):
        png(tmp_path / f"{i}.png", 40 * i)
    head = "reference,modification,target\n0.png,make it red,1.png\n"
    # an open quote on line 3, a stray closing quote on line 5: three rows would become one text
    (tmp_path / "a.csv").write_text(head + '1.png,"make it blue,2.png\n2.png,make it green,3.png\n'
                                           '3.png,make it pink",4.png\n4.png,x,0.png\n')
    with pytest.raises(InputError, match=r"a\.csv:3: .*quote"):
        read_triplet_file(tmp_path / "a.csv")
    # unterminated to the end of the file: still the line that opened it
    (tmp_path / "b.csv").write_text(head + '1.png,"make it blue,2.png\n2.png,make it green,3.png\n'
                                           '3.png,make it pink,4.png\n')
    with pytest.raises(InputError, match=r"b\.csv:3: "):
        read_triplet_file(tmp_path / "b.csv")
    # quotes closed on their line are CSV as usual; a row of the wrong width names its line
    (tmp_path / "c.csv").write_text(head + '1.png,"make it blue, then red",2.png\n3.png,x\n')
    with pytest.raises(InputError, match=r"c\.csv:4: 2 fields"):
        read_triplet_file(tmp_path / "c.csv")
    (tmp_path / "c.csv").write_text(head + '1.png,"make it blue, then ""red""",2.png\n')
    assert [t.modification for t in read_triplet_file(tmp_path / "c.csv").triplets] == [
        "make it red", 'make it blue, then "red"']


# --------------------------------------------------------------------------- FashionIQ: limit, json/


def write_fashioniq_train(root: Path, folder: str = "captions") -> None:
    for name, v in (("B001", 10), ("B002", 20), ("B003", 30)):
        png(root / "images" / f"{name}.png", v)
    (root / folder).mkdir(parents=True)
    entry = {"target": "B002", "candidate": "B001", "captions": ["is darker", "has long sleeves"]}
    for category in ("dress", "shirt"):
        (root / folder / f"cap.{category}.train.json").write_text(json.dumps([entry] * 3))


def test_fashioniq_limit_has_one_meaning_and_json_captions_are_read(tmp_path):
    from demind.config import config_keys
    from demind.triplets.config import TripletTrainConfig
    from demind.triplets.readers import read_fashioniq_train

    write_fashioniq_train(tmp_path / "a")
    data = read_fashioniq_train(tmp_path / "a", ("dress", "shirt"), limit=2)
    assert [t.qid for t in data.triplets] == ["dress:0", "dress:1", "shirt:0", "shirt:1"]
    help_text = dict((k, h) for k, _, h in config_keys(TripletTrainConfig))["data.limit"]
    assert "each category" in help_text  # the help says what the reader does
    # the evaluation reader's json/ folder (Pic2Word's layout) is the training reader's too
    write_fashioniq_train(tmp_path / "b", folder="json")
    assert len(read_fashioniq_train(tmp_path / "b", ("dress",)).triplets) == 3


# --------------------------------------------------------------------------- a shared data.cache_dir


def test_runs_sharing_a_cache_dir_never_read_each_others_features(tmp_path, tiny_backbone):
    from demind.triplets.features import image_features
    from demind.triplets.readers import read_triplet_file

    # two data folders, same relative names, same sizes and modification times, other pixels
    for folder, shift in (("a", 0), ("b", 100)):
        write_triplets(tmp_path / folder, n=4)
        for i in range(4):
            image = Image.fromarray(np.full((8, 8, 3), (37 * i + shift) % 255, dtype=np.uint8))
            image.save(tmp_path / folder / "img" / f"{i}.png", compress_level=0)  # one size for every value
            os.utime(tmp_path / folder / "img" / f"{i}.png", ns=(10**18, 10**18))
    sizes = {(tmp_path / f / "img" / f"{i}.png").stat().st_size for f in "ab" for i in range(4)}
    a = read_triplet_file(tmp_path / "a" / "triplets.jsonl").triplets
    b = read_triplet_file(tmp_path / "b" / "triplets.jsonl").triplets
    assert [t.reference.name for t in a] == [t.reference.name for t in b] and len(sizes) == 1
    cache = tmp_path / "shared"
    first = image_features(tiny_backbone, a, cache, "file", progress=False)
    parts_a = {p: p.stat().st_mtime_ns for p in cache.rglob("part-*")}
    second = image_features(tiny_backbone, b, cache, "file", progress=False)
    fresh = image_features(tiny_backbone, b, tmp_path / "fresh", "file", progress=False)
    assert torch.equal(second.reference, fresh.reference) and not torch.equal(second.reference, first.reference)
    # run a's parts are untouched (no part-00000 written twice, none added to its folder)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("part-*") if p in parts_a} == parts_a
    assert {p.parent for p in cache.rglob("part-*") if p not in parts_a}.isdisjoint({p.parent for p in parts_a})
    # the same run again reads its own parts
    again = image_features(tiny_backbone, a, cache, "file", progress=False)
    assert torch.equal(again.reference, first.reference)


# --------------------------------------------------------------------------- one id, two contents


def test_exclcoco_queries_sharing_an_id_are_refused_in_one_line(tmp_path, capsys):
    from demind.cli.evaluate import main
    from demind.errors import InputError
    from demind.eval import read_benchmark

    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    for i in range(1, 5):
        png(root / "images" / f"{i}.png", 40 * i)
    q = {"id": "a", "image_id": "1", "positive_query": "p", "query": "a without b", "include": ["a"],
         "exclude": "b", "ground_truth": ["3"], "hard_negatives": ["2"]}
    queries = [q, {**q, "hard_negatives": ["4"]}]
    (root / "exclcoco.json").write_text(json.dumps(
        {"format": "demind-exclcoco/1", "split": "val", "image_root": "images", "queries": queries,
         "images": {str(i): f"{i}.png" for i in range(1, 5)}}))
    with pytest.raises(InputError, match=r"exclcoco\.json: query id 'a' is used by two"):
        read_benchmark("exclcoco", root)
    assert main(["--benchmark", "exclcoco", "--data-root", str(root), "--out", str(tmp_path / "out"),
                 "--backbone", f"{TINY_CLIP}:none", "--methods", "text-only", "run.device=cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'a'" in err[-1] and "exclcoco.json" in err[-1]
    # the same query twice is not a conflict
    (root / "exclcoco.json").write_text(json.dumps(
        {"format": "demind-exclcoco/1", "split": "val", "image_root": "images", "queries": [q, q],
         "images": {str(i): f"{i}.png" for i in range(1, 5)}}))
    assert len(read_benchmark("exclcoco", root).groups[0].queries) == 2


def test_every_reader_refuses_one_id_with_two_contents(tmp_path):
    from demind.coco_files import load_coco
    from demind.errors import InputError
    from demind.eval import read_benchmark
    from demind.triplets.readers import read_cirr_train, read_triplet_file

    # CIRR (evaluation and training): one pairid, two captions
    names = ["dev-0-img0", "dev-1-img0"]
    entry = {"pairid": 7, "reference": names[0], "target_hard": names[1], "caption": "a dog",
             "img_set": {"id": 0, "members": names}}
    images = {n: png(tmp_path / "x" / f"{n}.png", 9 * i).read_bytes() for i, n in enumerate(names)}
    root = write_cirr_layout(tmp_path / "cirr", "val", "dev", images, [entry, {**entry, "caption": "a cat"}])
    with pytest.raises(InputError, match=r"cap\.rc2\.val\.json: pairid id '7'"):
        read_benchmark("cirr", root)
    root = write_cirr_layout(tmp_path / "cirr-train", "train", "train/34", images, [entry, {**entry, "caption": "x"}])
    with pytest.raises(InputError, match=r"cap\.rc2\.train\.json: pairid id '7'"):
        read_cirr_train(root)
    # CIRCO: one query id, two queries
    circo = tmp_path / "circo"
    (circo / "annotations").mkdir(parents=True)
    (circo / "COCO2017_unlabeled" / "annotations").mkdir(parents=True)
    png(circo / "COCO2017_unlabeled" / "unlabeled2017" / "000000000001.jpg", 5)
    (circo / "COCO2017_unlabeled" / "annotations" / "image_info_unlabeled2017.json").write_text(
        json.dumps({"images": [{"id": 1, "file_name": "000000000001.jpg"}]}))
    query = {"id": 3, "reference_img_id": 1, "relative_caption": "red", "gt_img_ids": [1]}
    (circo / "annotations" / "val.json").write_text(json.dumps([query, {**query, "relative_caption": "blue"}]))
    with pytest.raises(InputError, match=r"val\.json: query id '3'"):
        read_benchmark("circo", circo)
    # COCO annotation files: one image id, two files
    (tmp_path / "instances.json").write_text(json.dumps(
        {"images": [{"id": 1, "file_name": "a.jpg"}, {"id": 1, "file_name": "b.jpg"}]}))
    with pytest.raises(InputError, match=r"instances\.json: images: image id '1'"):
        load_coco(tmp_path / "instances.json", {"images": {"id": int, "file_name": str}})
    # ImageNet-R: one target under two labels
    inr = tmp_path / "imgnet"
    png(inr / "real" / "n1" / "q.JPEG", 3)
    png(inr / "imagenet-r" / "n1" / "cartoon_0.jpg", 4)
    (inr / "imgnet_real_query.txt").write_text("imgnet/real/n1/q.JPEG 0\n")
    (inr / "imgnet_targets.txt").write_text("imgnet/imagenet-r/n1/cartoon_0.jpg 0\nimgnet/imagenet-r/n1/cartoon_0.jpg 5\n")
    with pytest.raises(InputError, match=r"imgnet_targets\.txt: image id 'imgnet/imagenet-r/n1/cartoon_0'"):
        read_benchmark("imagenet-r", inr)
    # a triplet file: one id, two triplets
    png(tmp_path / "t" / "a.png", 1)
    rows = [{"id": "q1", "reference": "a.png", "modification": "x", "target": "a.png"},
            {"id": "q1", "reference": "a.png", "modification": "y", "target": "a.png"}]
    (tmp_path / "t" / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"t\.jsonl: triplet id 'q1'"):
        read_triplet_file(tmp_path / "t" / "t.jsonl")
