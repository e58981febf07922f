"""Toy intent shards: data_gen's schema, readable with webdataset and by the trainer's reader."""

from __future__ import annotations

import io
import json

import webdataset as wds
from PIL import Image

from toy_helpers import read_scene
from toyworld.intent_data import ToyShardConfig, make_toy_sample, write_toy_shards
from toyworld.world import SHAPES

FIELDS = {"__key__", "__url__", "jpg", "txt", "rew.txt", "int.txt", "json"}


def _read(paths):
    return list(wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False))


def test_shards_have_the_intent_schema(tmp_path):
    cfg = ToyShardConfig(num_samples=12, samples_per_shard=5)
    paths = write_toy_shards(tmp_path, cfg, show_progress=False)
    assert [p.name for p in paths] == ["00000.tar", "00001.tar", "00002.tar"]
    for i in range(3):
        stats = json.loads((tmp_path / f"{i:05d}_stats.json").read_text())
        assert stats["written"] == (5 if i < 2 else 2)
    samples = _read(paths)
    assert len(samples) == 12
    assert len({s["__key__"] for s in samples}) == 12
    for s in samples:
        assert set(s) - {"__local_path__"} == FIELDS
        assert "." not in s["__key__"]
        image = Image.open(io.BytesIO(s["jpg"]))
        assert image.size == (64, 64) and image.mode == "RGB"
        caption, rew, intent = (s[k].decode() for k in ("txt", "rew.txt", "int.txt"))
        assert caption and rew and intent
        meta = json.loads(s["json"])
        assert meta["key"] == s["__key__"] and meta["caption"] == caption
        assert {"engine", "model", "prompt_version", "flags"} <= set(meta["generation"])
        scene = read_scene(meta)
        # T_rew names every object of the ground-truth scene
        assert all(o.shape in rew for o in scene.objects)
        assert any(sh in rew for sh in SHAPES)


def test_same_config_same_bytes_in_one_or_two_processes_and_rerun_skips_done_shards(tmp_path):
    cfg = ToyShardConfig(num_samples=6, samples_per_shard=3)
    a = write_toy_shards(tmp_path / "a", cfg, show_progress=False, workers=1)
    b = write_toy_shards(tmp_path / "b", cfg, show_progress=False, workers=2)
    samples_a, samples_b = _read(a), _read(b)
    for x, y in zip(samples_a, samples_b):
        assert all(x[k] == y[k] for k in ("__key__", "jpg", "txt", "rew.txt", "int.txt", "json"))

    mtimes = [p.stat().st_mtime_ns for p in a]
    (tmp_path / "a" / "00001_stats.json").unlink()  # as if killed before the done-marker
    write_toy_shards(tmp_path / "a", cfg, show_progress=False)
    assert a[0].stat().st_mtime_ns == mtimes[0]        # finished shard untouched
    assert (tmp_path / "a" / "00001_stats.json").is_file()  # unfinished shard redone
    assert [s["jpg"] for s in _read(a)] == [s["jpg"] for s in samples_b]


def test_other_stream_gives_other_samples():
    cc3m = make_toy_sample(0, ToyShardConfig(), "k")
    web = make_toy_sample(0, ToyShardConfig(stream="web"), "k")
    assert cc3m.image_jpeg != web.image_jpeg


def test_trainer_reader_accepts_toy_shards(tmp_path):
    from demind.data import ReaderStats, read_tar_samples

    paths = write_toy_shards(tmp_path, ToyShardConfig(num_samples=4, samples_per_shard=4), show_progress=False)
    stats = ReaderStats()
    samples = list(read_tar_samples(str(paths[0]), "error", stats))
    assert len(samples) == 4 and not stats.take()
    first = samples[0]
    assert first["image"][:2] == b"\xff\xd8"  # JPEG
    assert first["original"] and first["rewritten"] and first["intent"]


# ------------------------------------------------------------------ controlled noise

def _noise_and_texts(cfg, n):
    out = []
    for i in range(n):
        s = make_toy_sample(i, cfg, f"k{i}")
        out.append((s.meta["noise"], s.caption, s.rewritten, s.intent, s.image_jpeg))
    return out


def test_noise_corrupts_the_chosen_share_keeps_image_and_alt_text_and_records_ground_truth():
    import pytest

    from toyworld.world import Scene, scene_diff

    n = 40
    clean = _noise_and_texts(ToyShardConfig(num_samples=n), n)
    hard = _noise_and_texts(ToyShardConfig(num_samples=n, noise_kind="hard", noise_rate=0.5), n)
    easy = _noise_and_texts(ToyShardConfig(num_samples=n, noise_kind="easy", noise_rate=0.5), n)
    low = _noise_and_texts(ToyShardConfig(num_samples=n, noise_kind="hard", noise_rate=0.2), n)
    assert all(c[0] is None for c in clean)
    noisy_hard = {i for i, h in enumerate(hard) if h[0] is not None}
    noisy_easy = {i for i, e in enumerate(easy) if e[0] is not None}
    noisy_low = {i for i, h in enumerate(low) if h[0] is not None}
    assert noisy_hard == noisy_easy and noisy_low < noisy_hard  # same samples; 20 % inside 50 %
    assert 12 <= len(noisy_hard) <= 28 and 2 <= len(noisy_low) <= 14
    for i in range(n):
        c, h, e = clean[i], hard[i], easy[i]
        assert c[1] == h[1] == e[1] and c[4] == h[4] == e[4]  # T_ori and the image stay true
        if i not in noisy_hard:
            assert c[2:4] == h[2:4] == e[2:4]
            continue
        assert h[0]["kind"] == "hard" and e[0]["kind"] == "easy"
        # hard: the look-alike differs from the true scene by exactly the recorded attribute
        true_scene = Scene.from_dict(make_toy_sample(i, ToyShardConfig(num_samples=n), "k").meta["toy"]["scene"])
        changes = scene_diff(true_scene, Scene.from_dict(h[0]["scene"]))
        assert [ch.kind for ch in changes] == [h[0]["edit"]]
        assert h[2] != c[2]
        # easy: the donor's own texts
        donor = e[0]["donor"]
        assert donor != i and 0 <= donor < n and e[2:4] == clean[donor][2:4]
    with pytest.raises(ValueError, match="noise_rate"):
        ToyShardConfig(noise_rate=1.5)
    with pytest.raises(ValueError, match="noise_kind"):
        ToyShardConfig(noise_kind="medium")


def test_noise_settings_are_part_of_the_shard_identity_and_counted(tmp_path):
    clean_cfg = ToyShardConfig(num_samples=8, samples_per_shard=8)
    noisy_cfg = ToyShardConfig(num_samples=8, samples_per_shard=8, noise_kind="hard", noise_rate=0.5)
    path = write_toy_shards(tmp_path, clean_cfg, show_progress=False, workers=1)[0]
    clean_rew = [s["rew.txt"] for s in _read([path])]
    write_toy_shards(tmp_path, noisy_cfg, show_progress=False, workers=1)  # same folder: redone, not reused
    samples = _read([path])
    stats = json.loads((tmp_path / "00000_stats.json").read_text())
    noisy = [json.loads(s["json"])["noise"] for s in samples]
    assert stats["noise"]["noisy"] == sum(x is not None for x in noisy) > 0
    assert sum(stats["noise"]["by_edit"].values()) == stats["noise"]["noisy"]
    assert [s["rew.txt"] for s in samples] != clean_rew


def test_shards_written_before_the_noise_option_count_as_clean_not_stale(tmp_path):
    cfg = ToyShardConfig(num_samples=3, samples_per_shard=3)
    path = write_toy_shards(tmp_path, cfg, show_progress=False, workers=1)[0]
    stats_path = tmp_path / "00000_stats.json"
    stats = json.loads(stats_path.read_text())
    for key in ("noise_kind", "noise_rate"):
        del stats["config"][key]  # as an older version wrote it
    stats_path.write_text(json.dumps(stats))
    mtime = path.stat().st_mtime_ns
    write_toy_shards(tmp_path, cfg, show_progress=False, workers=1)
    assert path.stat().st_mtime_ns == mtime  # reused
    write_toy_shards(tmp_path, ToyShardConfig(num_samples=3, samples_per_shard=3, noise_kind="easy", noise_rate=0.5),
                     show_progress=False, workers=1)
    assert json.loads(stats_path.read_text())["config"]["noise_kind"] == "easy"  # a noisy config rewrites it
