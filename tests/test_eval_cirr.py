"""CIRR through the real command: the real val/test1 annotation files (vendored under
tests/fixtures/cirr with their MIT licence), generated images, the tiny backbone and a tiny
De-MINDS checkpoint."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from demind.cli.evaluate import main as evaluate_main
from helpers import FIXTURES, run_eval_command

CIRR_FIXTURES = FIXTURES / "cirr"


def load_fixture(name: str):
    path = CIRR_FIXTURES / name
    if not path.is_file():
        pytest.fail(f"the real CIRR annotation file {path} is missing from the checkout (see tests/fixtures/cirr)")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def cirr_root(tmp_path_factory) -> Path:
    """The official layout: real captions and splits, an 8x8 random PNG for every listed image."""
    root = tmp_path_factory.mktemp("cirr")
    rng = np.random.default_rng(0)
    for split in ("val", "test1"):
        for folder, name in (("captions", f"cap.rc2.{split}.json"), ("image_splits", f"split.rc2.{split}.json")):
            (root / folder).mkdir(exist_ok=True)
            (root / folder / name).write_text(json.dumps(load_fixture(f"{folder}/{name}")))
        for relpath in load_fixture(f"image_splits/split.rc2.{split}.json").values():
            path = root / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)
    return root


def cirr_args(root: Path, ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["--benchmark", "cirr", "--data-root", str(root), "--checkpoint", str(ckpt), "--out", str(out),
            "--num-workers", "0", "--batch-size", "512", "run.progress=false", *extra]


def run(root: Path, ckpt: Path, out: Path, *extra: str) -> dict:
    return run_eval_command(cirr_args(root, ckpt, out, *extra))


@pytest.fixture(scope="module")
def val_run(cirr_root, tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("val")
    return run(cirr_root, tiny_checkpoint, out, "--methods", "image-only"), out


def test_val_every_query_is_ranked_without_its_reference(val_run):
    results, out = val_run
    captions = load_fixture("captions/cap.rc2.val.json")
    split_names = set(load_fixture("image_splits/split.rc2.val.json"))
    assert results["counts"]["all"]["queries"] == len(captions) == 4181
    assert results["counts"]["all"]["gallery"] == len(split_names)
    rankings = json.loads((out / "rankings" / "image-only.json").read_text())
    assert set(rankings) == {str(c["pairid"]) for c in captions}
    for c in captions:
        names = rankings[str(c["pairid"])]
        assert len(names) == 50 and len(set(names)) == 50 and set(names) <= split_names
        assert c["reference"] not in names


def test_val_metrics_can_be_recomputed_from_the_rankings(val_run):
    results, out = val_run
    captions = load_fixture("captions/cap.rc2.val.json")
    for method in ("image-only",):
        rankings = json.loads((out / "rankings" / f"{method}.json").read_text())
        for k in (1, 5, 10, 50):
            hits = sum(c["target_hard"] in rankings[str(c["pairid"])][:k] for c in captions)
            assert results["methods"][method][f"R@{k}"] == pytest.approx(100.0 * hits / len(captions))
        for k in (1, 2, 3):
            assert 0.0 <= results["methods"][method][f"Rsubset@{k}"] <= 100.0
    # random images and a random backbone: Recall_subset@3 is near 3 of 5 members, far from 0 or 100
    assert 40.0 < results["methods"]["image-only"]["Rsubset@3"] < 80.0
    table = (out / "table.md").read_text()
    assert "| Image-only |" in table and "Rs@3" in table


def test_second_run_reuses_the_gallery_cache_and_matches(val_run, cirr_root, tiny_checkpoint, tmp_path):
    first, first_out = val_run
    assert first["encoding"]["gallery"] == {"images": 2297, "cached": 0, "encoded": 2297}
    results = run(cirr_root, tiny_checkpoint, tmp_path, "--limit", "150",
                  "--cache-dir", str(first_out / "feature_cache"))
    assert results["encoding"]["gallery"] == {"images": 2297, "cached": 2297, "encoded": 0}
    assert results["limit"] == 150 and results["counts"]["all"]["evaluated"] == 150
    assert set(results["methods"]) == {"image-only", "text-only", "image+text", "mapping-only", "demind"}
    cached = json.loads((tmp_path / "rankings" / "image-only.json").read_text())
    uncached = json.loads((first_out / "rankings" / "image-only.json").read_text())
    assert cached == {qid: uncached[qid] for qid in cached}
    assert "LIMITED RUN" in (tmp_path / "table.md").read_text()


def check_cirr_submission(folder: Path, method: str, n_queries: int, prefix: str = "") -> None:
    """The two official test-server files: rc2, the metric, top-50 of the split without the
    reference, and top-3 of img_set.members without the reference."""
    captions = {str(c["pairid"]): c for c in load_fixture("captions/cap.rc2.test1.json")[:n_queries]}
    split_names = set(load_fixture("image_splits/split.rc2.test1.json"))
    recall = json.loads((folder / "submission" / f"{prefix}cirr_test1_{method}_recall.json").read_text())
    subset = json.loads((folder / "submission" / f"{prefix}cirr_test1_{method}_recall_subset.json").read_text())
    if prefix:  # a --limit run: named and marked as partial
        assert recall.pop("partial").startswith("PARTIAL") and subset.pop("partial").startswith("PARTIAL")
    assert (recall.pop("version"), recall.pop("metric")) == ("rc2", "recall")
    assert (subset.pop("version"), subset.pop("metric")) == ("rc2", "recall_subset")
    assert set(recall) == set(subset) == set(captions)
    for pairid, c in captions.items():
        members = set(c["img_set"]["members"]) - {c["reference"]}
        assert len(recall[pairid]) == 50 and len(set(recall[pairid])) == 50 and set(recall[pairid]) <= split_names
        assert c["reference"] not in recall[pairid]
        assert len(subset[pairid]) == 3 and set(subset[pairid]) <= members


def test_test1_submission_files_are_valid(cirr_root, tiny_checkpoint, tmp_path):
    # every test1 query (cheap method), then the De-MINDS query on the first 300 (same cache)
    full = run(cirr_root, tiny_checkpoint, tmp_path / "full", "--split", "test", "--methods", "image-only")
    assert full["split"] == "test1" and full["methods"] == {"image-only": {}}
    assert full["counts"]["all"]["queries"] == 4148
    check_cirr_submission(tmp_path / "full", "image-only", 4148)
    run(cirr_root, tiny_checkpoint, tmp_path / "demind", "--split", "test", "--methods", "demind", "--limit", "300",
        "--cache-dir", str(tmp_path / "full" / "feature_cache"))
    check_cirr_submission(tmp_path / "demind", "demind", 300, prefix="partial-first300_")


def test_missing_image_folder_names_the_expected_path(cirr_root, tiny_checkpoint, tmp_path, capsys):
    root = tmp_path / "cirr"
    shutil.copytree(cirr_root / "captions", root / "captions")
    shutil.copytree(cirr_root / "image_splits", root / "image_splits")
    assert evaluate_main(cirr_args(root, tiny_checkpoint, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert re.search(r"^error: .*dev.*does not exist(.|\n)*captions/cap.rc2", err, flags=re.M)
    assert "Traceback" not in err
    # --debug: the same line under the traceback, which names the error type
    assert evaluate_main(cirr_args(tmp_path / "nowhere", tiny_checkpoint, tmp_path / "out", "--debug")) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "DataLayoutError" in err and "cap.rc2.val.json" in err
