"""Pair mining (demind-mine-pairs): the neighbour selection on hand-made lists, then the command on a
small corpus with the tiny random CLIP (and a tiny random DINOv2): pair shards and their schema, the
manifest, rerun skips, a kill leaves no half shard, bad input (an empty window, a changed recipe,
another corpus, corrupt images), and the corpus found again by key."""

from __future__ import annotations

import json
import random
import tarfile
from pathlib import Path

import pytest
import torch

from helpers import make_sample, shard_writer_killed_at, write_input_shard

WORDS = ["dog", "cat", "car", "tree", "house", "boat", "bird", "lamp", "chair", "cup", "red", "blue", "green",
         "small", "big"]
TINY = ["--config", "configs/pairs/tiny-cpu.yaml", "run.progress=false"]


def write_corpus(root: Path, shards: int = 3, per_shard: int = 16, corrupt: str | None = None) -> Path:
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        samples = [make_sample(f"0000{s}{i:04d}", 100 * s + i, " ".join(rng.sample(WORDS, 4)))
                   for i in range(per_shard)]
        for sample in samples:
            if sample["__key__"] == corrupt:
                sample["jpg"] = b"\xff\xd8\xff not a jpeg"
        write_input_shard(root / f"0000{s}.tar", samples)
    return root


def read_pair_shard(path: Path) -> list[dict]:
    with tarfile.open(path) as tar:
        return [json.loads(tar.extractfile(m).read()) for m in tar.getmembers()]


def mine(argv: list[str], repo_root: Path, monkeypatch) -> int:
    from demind.cli.mine_pairs import main

    monkeypatch.chdir(repo_root)
    return main(argv)


# ---------------------------------------------------------------- selection


def lists(*rows):
    """(1, n) scores and rows of one query from (row, score) pairs."""
    return torch.tensor([[s for _, s in rows]]), torch.tensor([[r for r, _ in rows]])


def test_selection_keeps_the_window_drops_near_duplicates_and_takes_turns():
    from demind.pairs.select import select_pairs

    found = {"image": lists((1, 0.99), (2, 0.9), (3, 0.85), (4, 0.5)),
             "caption": lists((5, 0.95), (2, 0.93), (1, 0.9), (6, 0.7))}
    windows = {"image": (0.8, 0.96), "caption": (0.8, 0.96)}
    [selection] = select_pairs(found, windows, k=3, h=5)
    # row 1 is a near-duplicate by image (0.99 >= 0.96): neither a target nor a hard negative, although
    # caption's window holds it; the signals take turns: image's 2, caption's 5, image's 3
    assert [t[0] for t in selection.targets] == [2, 5, 3]
    # a target found by both signals is one pair carrying both scores
    assert selection.targets[0][1:] == (["image", "caption"], {"image": 0.9, "caption": 0.93})
    # hard negatives: the rest of the lists, hardest first, no target, no near-duplicate
    assert selection.hard_negatives == [6, 4]
    [one] = select_pairs(found, windows, k=1, h=1)
    assert [t[0] for t in one.targets] == [2] and one.hard_negatives == [5]  # in-window but beyond K


def test_selection_removes_the_query_itself():
    from demind.pairs.select import select_pairs, without_self

    scores, rows = without_self(*lists((7, 1.0), (2, 0.9)), torch.tensor([7]))
    [selection] = select_pairs({"image": (scores, rows)}, {"image": (0.8, 0.96)}, k=3, h=3)
    assert [t[0] for t in selection.targets] == [2] and selection.hard_negatives == []


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def mined(tmp_path_factory, repo_root):
    from demind.cli.mine_pairs import main

    root = tmp_path_factory.mktemp("pairs")
    corpus = write_corpus(root / "corpus", corrupt="000010003")
    out = root / "pairs"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo_root)
        assert main(["--input", str(corpus), "--output", str(out), *TINY, "second.enabled=true"]) == 0
    return corpus, out


def test_pair_shards_follow_the_schema(mined):
    corpus, out = mined
    assert sorted(p.name for p in out.iterdir()) == [
        "pairs-00000.tar", "pairs-00000_stats.json", "pairs-00001.tar", "pairs-00001_stats.json",
        "pairs-00002.tar", "pairs-00002_stats.json", "pairs_manifest.json"]
    keys = {f"0000{s}{i:04d}" for s in range(3) for i in range(16)} - {"000010003"}
    found_by = set()
    for shard in range(3):
        records = read_pair_shard(out / f"pairs-0000{shard}.tar")
        assert records
        for record in records:
            assert record["reference"].startswith(f"0000{shard}")
            assert 1 <= len(record["targets"]) <= 3 and len(record["hard_negatives"]) <= 5
            targets = [t["key"] for t in record["targets"]]
            assert len(set(targets)) == len(targets) and record["reference"] not in targets
            assert not set(targets) & set(record["hard_negatives"])
            assert set(targets) | set(record["hard_negatives"]) <= keys  # the corrupt image is never paired
            for target in record["targets"]:
                assert target["signals"] and set(target["scores"]) == set(target["signals"])
                found_by.update(target["signals"])
    assert found_by == {"image", "caption", "second"}
    stats = json.loads((out / "pairs-00001_stats.json").read_text())
    assert stats["skipped"]["skipped_corrupt_image"] == 1 and stats["queries"] == 15
    assert stats["pairs"] == sum(len(r["targets"]) for r in read_pair_shard(out / "pairs-00001.tar"))
    assert set(stats["similarity_quantiles"]) == {"image", "caption", "second"}


def test_the_manifest_records_corpus_backbones_and_windows(mined):
    from demind.pairs import corpus_record, read_pairs_manifest

    corpus, out = mined
    manifest = read_pairs_manifest(out)
    assert manifest["corpus"]["digest"] == corpus_record(str(corpus))["digest"]
    assert manifest["windows"] == {"image": [0.9, 0.999], "caption": [0.3, 0.99], "second": [0.2, 0.99]}
    assert (manifest["k"], manifest["h"]) == (3, 5)
    assert manifest["backbone"]["name"].startswith("tiny-clip@") and manifest["backbone"]["pretrained"].startswith("random:")
    assert manifest["second_encoder"]["name"] == "vit_small_patch14_dinov2.lvd142m"


def test_open_corpus_finds_images_and_captions_by_key(mined):
    from PIL import Image

    from demind.pairs import open_corpus
    from demind.retrieval import ImageReadError

    corpus, out = mined
    lookup = open_corpus(out / "pairs_manifest.json")
    image, caption = lookup("000020005")
    assert isinstance(image, Image.Image) and image.size == (40 + 205, 30)  # make_sample: 40 + seed wide
    with tarfile.open(corpus / "00002.tar") as tar:
        assert caption == tar.extractfile("000020005.txt").read().decode()
    with pytest.raises(ImageReadError):
        lookup.image("000010003")


def test_a_rerun_skips_finished_shards_and_a_killed_shard_leaves_nothing_half(mined, repo_root, monkeypatch,
                                                                            tmp_path):
    corpus, out = mined
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert mine(["--input", str(corpus), "--output", str(out), *TINY, "second.enabled=true"], repo_root,
                monkeypatch) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # a kill while writing shard 1: no pairs-00001.tar, no stats; the rerun mines it alone
    fresh = tmp_path / "pairs"
    with shard_writer_killed_at("pairs-00001.tar", 2), pytest.raises(KeyboardInterrupt):
        mine(["--input", str(corpus), "--output", str(fresh), *TINY, "second.enabled=true"], repo_root, monkeypatch)
    assert (fresh / "pairs-00000_stats.json").is_file()
    assert not (fresh / "pairs-00001.tar").exists() and not (fresh / "pairs-00001_stats.json").exists()
    assert mine(["--input", str(corpus), "--output", str(fresh), *TINY, "second.enabled=true"], repo_root,
                monkeypatch) == 0
    assert read_pair_shard(fresh / "pairs-00001.tar") == read_pair_shard(out / "pairs-00001.tar")
    assert not list(fresh.glob("*.tmp"))


def test_dry_run_prints_the_plan_and_writes_nothing(mined, repo_root, monkeypatch, capsys, tmp_path):
    corpus, _ = mined
    assert mine(["--input", str(corpus), "--output", str(tmp_path / "p"), *TINY, "--dry-run"], repo_root,
                monkeypatch) == 0
    text = capsys.readouterr().out
    assert "image (0.9 < s < 0.999), caption (0.3 < s < 0.99)" in text and "3 to mine" in text
    assert "K = 3" in text and "H = 5" in text
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())  # no manifest, no shard


def test_a_window_that_keeps_no_pair_is_one_line_with_the_similarities(mined, repo_root, monkeypatch, capsys,
                                                                       tmp_path):
    corpus, _ = mined
    code = mine(["--input", str(corpus), "--output", str(tmp_path / "p"), *TINY, "caption.low=0.995",
                 "caption.high=0.999"], repo_root, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: signal caption: the window 0.995 < s < 0.999 keeps no pair")
    assert "5% 0." in err and "95% 0." in err
    assert not list((tmp_path / "p").glob("pairs-*"))


def test_another_recipe_or_corpus_in_the_same_output_is_refused(mined, repo_root, monkeypatch, capsys, tmp_path):
    corpus, out = mined
    assert mine(["--input", str(corpus), "--output", str(out), *TINY, "second.enabled=true", "mining.targets=2"],
                repo_root, monkeypatch) == 2
    assert "differs in mining.targets (3 -> 2)" in capsys.readouterr().err
    other = write_corpus(tmp_path / "other", shards=1)
    assert mine(["--input", str(other), "--output", str(out), *TINY, "second.enabled=true"], repo_root,
                monkeypatch) == 2
    err = capsys.readouterr().err
    assert str(corpus) in err and str(other) in err


def test_open_corpus_refuses_another_corpus_naming_both(mined, tmp_path):
    from demind.pairs import CorpusMismatchError, open_corpus

    corpus, out = mined
    other = write_corpus(tmp_path / "other", shards=1)
    with pytest.raises(CorpusMismatchError, match=f"{corpus}.*{other}"):
        open_corpus(out, corpus=str(other))
    moved = tmp_path / "moved"
    moved.mkdir()
    for tar in corpus.glob("*.tar"):
        (moved / tar.name).write_bytes(tar.read_bytes())
    assert open_corpus(out, corpus=str(moved))("000000001")[1]
