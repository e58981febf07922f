"""A feature cache written before shard images were decoded with their EXIF orientation.

Its records have no ``decode``. A shard none of whose images is stored rotated is reused as it
is (no image encoded; ``decode`` recorded, so the next run reads no header); a shard with a
rotated image was encoded sideways and is rebuilt, only that shard, to what an upright decoding
gives. The trainer applies the same rule: it never trains on sideways features.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import demind.data
import demind.features.cache_upgrade
from toyworld.synthetic import write_intent_shard
from demind.cli import features as features_cli
from demind.config import load_config
from demind.data import decode_to_tensor
from demind.embedding_cache import cache_identity
from demind.features import DECODE, FeatureCacheError, ShardFeatureCache, build_feature_cache
from demind.imaging import decode_image
from demind.training import TrainConfig, build_modules
from demind.training.batches import batch_embeddings
from helpers import one_process_data

pytestmark = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")

ROTATED_KEY = "k1_1"


def photo(seed: int, orientation: int | None = None) -> bytes:
    """A 40 x 24 noise JPEG (not square: turning it changes what the backbone sees)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    out, options = io.BytesIO(), {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif
    Image.fromarray(pixels).save(out, "JPEG", quality=95, **options)
    return out.getvalue()


def write_shards(folder: Path) -> list[str]:
    """00000: three upright images (one tagged orientation 1); 00001: two upright, one tagged 6 (90 degrees)."""
    images = {"k0_0": photo(0), "k0_1": photo(1, orientation=1), "k0_2": photo(2),
              "k1_0": photo(3), ROTATED_KEY: photo(4, orientation=6), "k1_2": photo(5)}
    for shard in range(2):
        keys = [k for k in images if k.startswith(f"k{shard}_")]
        write_intent_shard(folder / f"0000{shard}.tar", [
            {"key": k, "jpg": images[k], "txt": f"photo {k}", "rew.txt": f"a photo {k}", "int.txt": f"make {k}"}
            for k in keys])
    return [str(folder / "00000.tar"), str(folder / "00001.tar")]


def unoriented_decode(data: bytes, transform) -> torch.Tensor:
    """How shard images were decoded before: as stored, EXIF orientation ignored."""
    return transform(decode_image(data))


def make_old_cache(monkeypatch, build, root: Path) -> None:
    """Run ``build`` with the old decoding, then strip ``decode`` from the records under ``root``."""
    with monkeypatch.context() as patch:
        patch.setattr(demind.data, "decode_to_tensor", unoriented_decode)
        build()
    records = sorted(root.rglob("*.json"))
    assert len(records) >= 1
    for record_path in records:
        record = json.loads(record_path.read_text())
        assert record.pop("decode") == DECODE
        record_path.write_text(json.dumps(record))


def count_calls(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` by a wrapper that appends its first argument's length (or 1) per call."""
    calls, original = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(len(args[0]) if hasattr(args[0], "__len__") else 1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_only_the_shard_with_a_rotated_image_is_rebuilt_and_a_rerun_reads_no_header(
        tmp_path, tiny_backbone, monkeypatch, caplog):
    shards = write_shards(tmp_path / "shards")
    directory = tmp_path / "cache"

    def build() -> dict:
        return build_feature_cache(shards, directory, tiny_backbone, batch_size=4, num_workers=0, progress=False)

    make_old_cache(monkeypatch, build, directory)
    old = {name: load_file(str(directory / f"{name}.safetensors")) for name in ("00000", "00001")}
    mtime = (directory / "00000.safetensors").stat().st_mtime_ns
    encoded = count_calls(monkeypatch, tiny_backbone, "encode_image")
    headers = count_calls(monkeypatch, demind.features.cache_upgrade, "orientation_changes_pixels")

    with caplog.at_level(logging.INFO, logger="demind.features"):
        summary = build()
    assert summary["shards_built"] == 1 and summary["shards_skipped"] == 1
    assert sum(encoded) == 3  # the three images of 00001, none of 00000
    assert len(headers) == 6  # every cached image's header, once
    assert "2 cached shards checked for EXIF orientation: 1 reused, 1 rebuilt (rotated images)" in caplog.text
    assert "feature cache of 00001 is rebuilt" in caplog.text and "encoded sideways there: 1 of 3" in caplog.text

    # 00000 is reused bit for bit, only its record gains the field
    assert (directory / "00000.safetensors").stat().st_mtime_ns == mtime
    assert all(torch.equal(v, old["00000"][k]) for k, v in load_file(str(directory / "00000.safetensors")).items())
    assert all(json.loads((directory / f"{n}.json").read_text())["decode"] == DECODE for n in ("00000", "00001"))

    # 00001 now holds the upright image's features, equal to a fresh build (fidelities too)
    fresh = tmp_path / "fresh"
    build_feature_cache(shards[1:], fresh, tiny_backbone, batch_size=4, num_workers=0, progress=False)
    rebuilt, expected = load_file(str(directory / "00001.safetensors")), load_file(str(fresh / "00001.safetensors"))
    assert rebuilt.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(rebuilt[name], value, rtol=1e-5, atol=1e-6, msg=name)
    keys = json.loads((directory / "00001.json").read_text())["keys"]
    row = keys.index(ROTATED_KEY)
    import webdataset as wds

    raw = {r["__key__"]: r["jpg"] for r in wds.WebDataset(shards[1], shardshuffle=False)}
    upright = tiny_backbone.encode_image(decode_to_tensor(raw[ROTATED_KEY], tiny_backbone.preprocess)[None])[0]
    sideways = tiny_backbone.encode_image(unoriented_decode(raw[ROTATED_KEY], tiny_backbone.preprocess)[None])[0]
    torch.testing.assert_close(rebuilt["image_emb"][row], upright, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(old["00001"]["image_emb"][row], sideways, rtol=1e-5, atol=1e-6)
    assert (upright - sideways).abs().max() > 1e-2  # the old row was really another image's
    others = [i for i, k in enumerate(keys) if k != ROTATED_KEY]
    torch.testing.assert_close(rebuilt["image_emb"][others], old["00001"]["image_emb"][others], rtol=1e-5, atol=1e-6)

    # a rerun reads no header and encodes nothing; the trainer's check reads none either
    headers.clear(), encoded.clear()
    assert build()["shards_built"] == 0
    assert ShardFeatureCache.find(directory, shards, cache_identity(tiny_backbone), required=True) is not None
    assert headers == [] and encoded == []


def test_a_shard_cached_before_with_no_rotated_image_is_reused_by_the_trainer_and_recorded(
        tmp_path, tiny_backbone, monkeypatch):
    shards = write_shards(tmp_path / "shards")[:1]
    directory = tmp_path / "cache"
    make_old_cache(monkeypatch, lambda: build_feature_cache(shards, directory, tiny_backbone, batch_size=4,
                                                            num_workers=0, progress=False), directory)
    headers = count_calls(monkeypatch, demind.features.cache_upgrade, "orientation_changes_pixels")
    cache = ShardFeatureCache.find(directory, shards, cache_identity(tiny_backbone), required=True)
    assert cache is not None and len(headers) == 3
    assert json.loads((directory / "00000.json").read_text())["decode"] == DECODE
    assert not [p.name for p in directory.iterdir() if p.suffix not in (".json", ".safetensors")]  # no temp left
    headers.clear()
    assert ShardFeatureCache.find(directory, shards, cache_identity(tiny_backbone), required=True) is not None
    assert headers == []


def test_a_cache_that_cannot_be_written_is_still_used_and_checked_again(tmp_path, tiny_backbone, monkeypatch, caplog):
    """A read-only copy of an old cache: the upright shard is used; the record stays as it was."""
    from demind.errors import OutputLocationError

    shards = write_shards(tmp_path / "shards")[:1]
    directory = tmp_path / "cache"
    make_old_cache(monkeypatch, lambda: build_feature_cache(shards, directory, tiny_backbone, batch_size=4,
                                                            num_workers=0, progress=False), directory)
    before = (directory / "00000.json").read_bytes()

    def read_only(path, obj):
        raise OutputLocationError(f"cannot write {path}: read-only file system; choose another output location")

    monkeypatch.setattr(demind.features.cache_upgrade, "write_json_atomic", read_only)
    headers = count_calls(monkeypatch, demind.features.cache_upgrade, "orientation_changes_pixels")
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="demind.features"):
            assert ShardFeatureCache.find(directory, shards, cache_identity(tiny_backbone), required=True) is not None
    assert len(headers) == 6 and (directory / "00000.json").read_bytes() == before
    assert "could not record in" in caplog.text and "read-only file system" in caplog.text


def test_a_record_decoded_another_way_is_rebuilt(tmp_path, tiny_backbone):
    shards = write_shards(tmp_path / "shards")[:1]
    directory = tmp_path / "cache"
    build_feature_cache(shards, directory, tiny_backbone, batch_size=4, num_workers=0, progress=False)
    record = json.loads((directory / "00000.json").read_text())
    (directory / "00000.json").write_text(json.dumps({**record, "decode": "as-stored"}))
    with pytest.raises(FeatureCacheError, match=r"00000: its images were decoded 'as-stored', not 'exif-oriented'"):
        ShardFeatureCache.find(directory, shards, cache_identity(tiny_backbone), required=True)


# --------------------------------------------------------------------------- training


def smoke_args(repo_root: Path, shards: Path, *extra: str) -> list[str]:
    return [f"data.shards={shards}", f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}",
            "data.cache_dtype=float32", *extra]


def first_rotated_row(loader) -> tuple[dict, int]:
    """The first batch holding the rotated image, and its row."""
    for _, batch in zip(range(20), loader):
        if ROTATED_KEY in batch["keys"]:
            return batch, batch["keys"].index(ROTATED_KEY)
    raise AssertionError(f"{ROTATED_KEY} not drawn in 20 batches")


def test_the_trainer_never_trains_on_sideways_features(repo_root, tmp_path, monkeypatch, caplog):
    shards = tmp_path / "shards"
    write_shards(shards)
    smoke = str(repo_root / "configs/train/smoke.yaml")

    def build() -> None:
        assert features_cli.main(["--config", smoke, *smoke_args(repo_root, shards), "--plot", "none"]) == 0

    make_old_cache(monkeypatch, build, shards / "features")
    directory = next(shards.glob("features/*"))

    def config(features: str) -> TrainConfig:
        return load_config(TrainConfig, Path(smoke), smoke_args(repo_root, shards, f"data.features={features}"))

    backbone, _ = build_modules(config("auto"), torch.device("cpu"))
    # named explicitly: one error naming the shard and why; auto: decode images instead
    with pytest.raises(FeatureCacheError, match=r"lacks 1 of 2 shards \(e\.g\. 00001: cached before EXIF orientation"):
        one_process_data(config(str(directory)), backbone)
    with caplog.at_level(logging.WARNING, logger="demind.features"):
        _, cache = one_process_data(config("auto"), backbone)
    assert cache is None and "decoding images instead" in caplog.text

    build()  # rebuilds 00001
    batches = {}
    for mode in ("auto", "null"):
        backbone, _ = build_modules(config(mode), torch.device("cpu"))
        loader, cache = one_process_data(config(mode), backbone)
        assert (cache is not None) == (mode == "auto")
        batch, row = first_rotated_row(loader)
        batches[mode] = (batch["keys"], batch_embeddings(batch, backbone)[0][row])
    (cached_keys, cached), (raw_keys, raw) = batches["auto"], batches["null"]
    assert cached_keys == raw_keys
    torch.testing.assert_close(cached, raw, rtol=1e-5, atol=1e-5)
