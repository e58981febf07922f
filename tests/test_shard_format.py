"""The shard format's one home: naming, shard lists, the writer (commit / abandon / kill), the done-marker."""

from __future__ import annotations

import gc
import json
import os
import signal
from pathlib import Path

import pytest
import webdataset as wds

from demind.shard_format import (
    CAPTION_FIELD, IMAGE_FIELDS, INTENT_FIELD, JSON_FIELD, REWRITTEN_FIELD, ShardListError, ShardOutput, ShardWriter,
    encode_sample, resolve_shards, sample_key, shard_filename, shard_name, stats_path,
)
from toyworld.synthetic import write_synthetic_shards

def jpeg(seed: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (seed * 40 % 256, 10, 200)).save(buf, format="JPEG")
    return buf.getvalue()


def records(n: int) -> list[dict]:
    return [encode_sample(sample_key(3, i, 4), "jpg", jpeg(i), f"a cat {i}", f"a black cat {i}", f"make it black {i}",
                          {"key": sample_key(3, i, 4), "note": "ünïcode"}) for i in range(n)]


def test_naming_helpers():
    assert shard_filename(42) == "00042.tar" and shard_filename(123456) == "123456.tar"
    assert shard_name("shards/cc3m/00012.tar") == "00012" and shard_name(Path("/x/00012.tar")) == "00012"
    assert stats_path("shards/cc3m/00012.tar") == Path("shards/cc3m/00012_stats.json")
    assert sample_key(42, 17, 4) == "000420017" and sample_key(0, 3, 5) == "0000000003"
    out = ShardOutput.for_id("/d", 7)
    assert (out.tar, out.stats) == (Path("/d/00007.tar"), Path("/d/00007_stats.json"))
    assert (out.tmp_tar, out.tmp_stats) == (Path("/d/00007.tar.tmp"), Path("/d/00007_stats.json.tmp"))
    assert ShardOutput.for_input(Path("/in/00009.tar"), Path("/out")) == ShardOutput.of("/out/00009.tar")
    assert (IMAGE_FIELDS[0], CAPTION_FIELD, REWRITTEN_FIELD, INTENT_FIELD, JSON_FIELD) == (
        "jpg", "txt", "rew.txt", "int.txt", "json")


def test_write_then_read_back_with_webdataset_and_both_readers(tmp_path):
    from demind.data import ReaderStats, read_tar_samples
    from demind.gen.reader import RawSample, iter_shard

    written = records(3)
    with ShardWriter(tmp_path / "00003.tar") as writer:
        for record in written:
            writer.write(record)
    assert writer.count == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["00003.tar"]

    read = list(wds.WebDataset(str(tmp_path / "00003.tar"), shardshuffle=False, empty_check=False))
    assert [{k: v for k, v in r.items() if not k.startswith("__") or k == "__key__"} for r in read] == written
    assert json.loads(read[0]["json"]) == {"key": "000030000", "note": "ünïcode"}

    # the trainer's reader and data_gen's input reader see the same fields
    stats = ReaderStats()
    trainer = list(read_tar_samples(str(tmp_path / "00003.tar"), "error", stats))
    assert [(s["key"], s["original"], s["rewritten"], s["intent"]) for s in trainer] == [
        (sample_key(3, i, 4), f"a cat {i}", f"a black cat {i}", f"make it black {i}") for i in range(3)]
    assert trainer[1]["image"] == jpeg(1) and not stats.counts
    inputs = list(iter_shard(tmp_path / "00003.tar"))
    assert all(isinstance(s, RawSample) for s in inputs)
    assert [(s.image_ext, s.caption, s.meta["note"]) for s in inputs] == [("jpg", f"a cat {i}", "ünïcode") for i in range(3)]


def test_a_write_in_progress_or_abandoned_leaves_no_tar(tmp_path):
    writer = ShardWriter(tmp_path / "00000.tar")
    writer.write(records(1)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.tar.tmp"]
    with pytest.raises(ShardListError, match="no .tar shards found"):
        resolve_shards(str(tmp_path))  # readers never take the tmp for a shard
    writer.abandon()
    writer.abandon()  # twice is harmless
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(tmp_path / "00001.tar") as writer:
            writer.write(records(1)[0])
            raise KeyboardInterrupt  # Ctrl-C mid-shard
    assert list(tmp_path.iterdir()) == []

    writer = ShardWriter(tmp_path / "00001.tar")
    writer.write(records(1)[0])
    del writer
    gc.collect()
    assert list(tmp_path.iterdir()) == []  # dropped without a commit: abandoned

    assert ShardWriter(tmp_path / "00002.tar").commit() == tmp_path / "00002.tar"  # an empty shard is a valid tar
    assert list(wds.WebDataset(str(tmp_path / "00002.tar"), shardshuffle=False, empty_check=False)) == []


def test_a_killed_write_leaves_only_the_tmp_which_readers_skip_and_the_plan_redoes(tmp_path):
    pid = os.fork()  # the child writes part of a shard and is killed: no Python cleanup runs
    if pid == 0:
        writer = ShardWriter(tmp_path / "00000.tar")
        for record in records(3):
            writer.write(record)
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.tar.tmp"]
    output = ShardOutput.for_id(tmp_path, 0)
    assert not output.is_done() and output.stray_files() == [output.tmp_tar]
    write_synthetic_shards(tmp_path / "other", num_shards=1, samples_per_shard=1)
    with pytest.raises(ShardListError, match="no .tar shards found"):
        resolve_shards(str(tmp_path))
    assert output.remove(include_done=False) == [output.tmp_tar] and list(tmp_path.glob("0*")) == []


def test_done_marker_is_written_last_and_checked(tmp_path):
    output = ShardOutput.for_id(tmp_path, 4)
    with ShardWriter(output.tar) as writer:
        writer.write(records(1)[0])
    assert not output.is_done() and output.stray_files() == [output.tar]  # tar renamed, stats not yet written
    assert output.load_stats() is None
    output.mark_done({"written": 1, "note": "ünïcode"})
    assert output.is_done() and output.stray_files() == [] and not output.tmp_stats.exists()
    assert output.load_stats() == {"written": 1, "note": "ünïcode"}
    output.stats.write_text("{not json")
    assert output.load_stats() is None  # unreadable stats: callers treat the shard as not done
    assert output.remove(include_done=True) == [output.tar, output.stats] and list(tmp_path.iterdir()) == []


def test_missing_shard_is_an_error_naming_the_spec_and_the_first_missing_path(tmp_path):
    write_synthetic_shards(tmp_path, num_shards=2, samples_per_shard=1)
    assert resolve_shards(str(tmp_path)) == [str(tmp_path / "00000.tar"), str(tmp_path / "00001.tar")]
    assert resolve_shards(str(tmp_path / "{00000..00001}.tar")) == resolve_shards(str(tmp_path))
    spec = str(tmp_path / "{00000..00003}.tar")
    with pytest.raises(ShardListError) as info:
        resolve_shards(spec)
    assert str(info.value) == (f"2 of 4 shards from data.shards={spec!r} do not exist, "
                               f"e.g. {tmp_path / '00002.tar'}; check the pattern")
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(ShardListError, match=r"--input=.*do not exist"):
        resolve_shards(spec, setting="--input")
    with pytest.raises(ShardListError, match="data.shards is empty"):
        resolve_shards("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardListError, match="no .tar shards found at data.shards="):
        resolve_shards(str(tmp_path / "empty"))
    assert resolve_shards("https://example.com/{00000..00001}.tar") == [
        "https://example.com/00000.tar", "https://example.com/00001.tar"]  # remote shards are not checked


def test_encode_sample_names_a_bad_image_extension():
    with pytest.raises(ValueError, match=r"sample 'k1': image extension 'gif'"):
        encode_sample("k1", "gif", b"", "a", "b", "c", {})
