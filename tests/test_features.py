"""Frozen-feature cache: built once per shard, refused for another backbone, and training
on it equals training on decoded images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import demind.data
from demind import features
from demind.cli import features as features_cli
from demind.cli import train
from demind.backbone import build_backbone
from demind.config import load_config
from demind.data import decode_to_tensor
from demind.embedding_cache import cache_slug
from toyworld.synthetic import write_intent_shard, write_synthetic_shards
from demind.features import FeatureCacheError, default_cache_dir
from demind.training import TrainConfig, build_modules, compute_losses
from helpers import one_process_data


pytestmark = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")


def overrides(repo_root: Path, shards: Path, *extra: str) -> list[str]:
    return [f"data.shards={shards}", f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", *extra]


def smoke_config(repo_root: Path, shards: Path, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, repo_root / "configs/train/smoke.yaml", overrides(repo_root, shards, *extra))


def build_cache(repo_root: Path, shards: Path, *extra: str) -> None:
    assert features_cli.main(["--config", str(repo_root / "configs/train/smoke.yaml"),
                          *overrides(repo_root, shards, *extra)]) == 0


def cache_dir_of(cfg: TrainConfig, shards: Path) -> Path:
    torch.manual_seed(cfg.run.seed)
    backbone = build_backbone(cfg.backbone)
    return default_cache_dir([str(shards / "00000.tar")], backbone.identity_str)


def test_cache_holds_the_frozen_embeddings_per_shard_and_rerun_skips(repo_root, tmp_path, capsys):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=6)
    build_cache(repo_root, shards)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["shards_built"] == 2 and summary["samples"] == 12

    cfg = smoke_config(repo_root, shards)
    torch.manual_seed(cfg.run.seed)
    backbone = build_backbone(cfg.backbone)
    directory = default_cache_dir([str(shards / "00000.tar")], backbone.identity_str)
    index = json.loads((directory / "00001.json").read_text())
    assert index["backbone"] == backbone.identity and index["num_samples"] == 6
    assert index["keys"] == [f"00001{i:05d}" for i in range(6)]  # tar order

    import webdataset as wds
    from safetensors.torch import load_file

    raw = list(wds.WebDataset(str(shards / "00001.tar"), shardshuffle=False))
    images = torch.stack([decode_to_tensor(r["jpg"], backbone.preprocess) for r in raw])
    tensors = load_file(str(directory / "00001.safetensors"))
    torch.testing.assert_close(tensors["image_emb"], backbone.encode_image(images), rtol=1e-5, atol=1e-5)
    teacher = backbone.encode_text([r["int.txt"].decode() for r in raw]).pooled
    torch.testing.assert_close(tensors["teacher_emb"], teacher, rtol=1e-5, atol=1e-5)
    assert index["intent"] == [r["int.txt"].decode() for r in raw]

    before = (directory / "00000.safetensors").stat().st_mtime_ns
    build_cache(repo_root, shards)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["shards_built"] == 0 and summary["shards_skipped"] == 2
    assert (directory / "00000.safetensors").stat().st_mtime_ns == before


def test_one_step_on_cached_features_equals_one_step_on_images(repo_root, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=12)
    build_cache(repo_root, shards, "data.cache_dtype=float32")

    results = {}
    for mode in ("auto", "null"):
        cfg = smoke_config(repo_root, shards, f"data.features={mode}", "model.mapping_dropout=0")
        backbone, model = build_modules(cfg, torch.device("cpu"))
        loader, cache = one_process_data(cfg, backbone)
        assert (cache is not None) == (mode == "auto")
        batch = next(iter(loader))
        losses = compute_losses(model, batch, backbone)
        losses["loss"].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[mode] = (batch, losses, grads)

    (cached, cached_losses, cached_grads), (raw, raw_losses, raw_grads) = results["auto"], results["null"]
    assert "images" in raw and "images" not in cached
    assert cached["keys"] == raw["keys"] and cached["targets"] == raw["targets"]
    for term in ("loss", "distil", "align"):
        torch.testing.assert_close(cached_losses[term], raw_losses[term], rtol=1e-5, atol=1e-5)
    assert cached_grads.keys() == raw_grads.keys()
    for name, grad in raw_grads.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(cached_grads[name], grad, rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_training_on_the_cache_decodes_no_image(repo_root, tmp_path, monkeypatch, capsys):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=12)
    build_cache(repo_root, shards)

    decoded = []

    def counting_decode(data, transform):
        decoded.append(len(data))
        return decode_to_tensor(data, transform)

    monkeypatch.setattr(demind.data, "decode_to_tensor", counting_decode)
    args = ["--config", str(repo_root / "configs/train/smoke.yaml"), *overrides(repo_root, shards),
            "optim.max_steps=2", f"run.output_dir={tmp_path / 'run'}"]
    assert train.main(args) == 0
    assert "features: cache" in capsys.readouterr().out
    assert decoded == []
    # the same run without the cache decodes at least the 32 images it trains on
    train.main(args[:-1] + [f"run.output_dir={tmp_path / 'run2'}", "data.features=null"])
    assert len(decoded) >= 32


def test_cache_of_another_backbone_is_refused(repo_root, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=4)
    other = json.loads((repo_root / "configs/model/tiny-clip.json").read_text())
    other["text_cfg"]["layers"] = 2
    other_json = tmp_path / "tiny-clip-2layer.json"
    other_json.write_text(json.dumps(other))
    cache = tmp_path / "cache"
    assert features_cli.main(["--config", str(repo_root / "configs/train/smoke.yaml"), "--out", str(cache),
                          f"data.shards={shards}", f"backbone.name={other_json}"]) == 0

    cfg = smoke_config(repo_root, shards, f"data.features={cache}")
    backbone, _ = build_modules(cfg, torch.device("cpu"))
    with pytest.raises(FeatureCacheError) as info:
        one_process_data(cfg, backbone)
    message = str(info.value)
    assert "tiny-clip-2layer@" in message and "tiny-clip@" in message and str(cache) in message


def test_incomplete_cache_is_an_error_when_named_and_skipped_when_auto(repo_root, tmp_path, caplog):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=4)
    build_cache(repo_root, shards)
    write_synthetic_shards(tmp_path / "more", num_shards=3, samples_per_shard=4)
    (tmp_path / "more" / "00002.tar").rename(shards / "00002.tar")

    cfg = smoke_config(repo_root, shards)
    backbone, _ = build_modules(cfg, torch.device("cpu"))
    directory = default_cache_dir([str(shards / "00000.tar")], backbone.identity_str)
    with pytest.raises(FeatureCacheError, match=r"lacks 1 of 3 shards \(e\.g\. 00002\)"):
        one_process_data(smoke_config(repo_root, shards, f"data.features={directory}"), backbone)
    _, cache = one_process_data(cfg, backbone)
    assert cache is None and "decoding images instead" in caplog.text


def test_a_damaged_cache_file_is_one_error_saying_how_to_rebuild_it(repo_root, tmp_path, capsys):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=12)
    build_cache(repo_root, shards)
    part = next(shards.rglob("00000.safetensors"))
    part.write_bytes(part.read_bytes()[:100])  # its done-marker json still says the shard is cached
    args = ["--config", str(repo_root / "configs/train/smoke.yaml"), *overrides(repo_root, shards),
            "optim.max_steps=2", f"run.output_dir={tmp_path / 'run'}", "run.progress=false"]
    assert train.main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1
    assert "00000.safetensors is truncated or corrupted" in errors[0] and "rerun demind-features" in errors[0]
    # doing what it says rebuilds that shard and training runs
    part.unlink()
    part.with_suffix(".json").unlink()
    build_cache(repo_root, shards)
    assert train.main(args) == 0


def test_corrupt_image_is_skipped_and_counted_in_the_cache(repo_root, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    good = write_synthetic_shards(tmp_path / "good", num_shards=1, samples_per_shard=1)[0]
    import webdataset as wds

    jpg = next(iter(wds.WebDataset(str(good), shardshuffle=False)))["jpg"]
    write_intent_shard(shards / "00000.tar", [
        {"key": f"k{i}", "jpg": b"\xff\xd8 broken" if i == 1 else jpg, "txt": "a", "rew.txt": "b", "int.txt": "c"}
        for i in range(3)])
    build_cache(repo_root, shards)
    cfg = smoke_config(repo_root, shards)
    index = json.loads((cache_dir_of(cfg, shards) / "00000.json").read_text())
    assert index["keys"] == ["k0", "k2"] and index["counts"] == {"skipped_corrupt_image": 1}


@pytest.mark.parametrize("setting, off", [(None, True), ("none", True), ("None", True), ("null", True), ("", True),
                                          ("auto", False), ("runs/cache", False), ("none-of-these", False)])
def test_which_data_features_values_turn_the_cache_off(setting, off):
    assert features.features_off(setting) is off


def test_data_features_none_is_off_for_the_trainer_and_the_cache_builder(repo_root, tmp_path, monkeypatch):
    """'none' never names a folder: the builder writes where auto looks, the trainer decodes images."""
    monkeypatch.chdir(tmp_path)
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=4)
    build_cache(repo_root, shards, "data.features=none")
    assert not (tmp_path / "none").exists()
    cfg = smoke_config(repo_root, shards, "data.features=none")
    assert (cache_dir_of(cfg, shards) / "00000.json").is_file()
    backbone, _ = build_modules(cfg, torch.device("cpu"))
    _, cache = one_process_data(cfg, backbone)
    assert cache is None  # the finished cache beside the shards is not used: the setting says off
    _, cache = one_process_data(smoke_config(repo_root, shards), backbone)
    assert cache is not None  # while auto finds it
def test_bf16_cache_matches_fp32_and_is_never_read_as_fp32(repo_root, tmp_path):
    """amp_bf16 towers (fp32 weights, bf16 autocast) give features close to fp32's; the
    cache records the precision, so an fp32 run refuses the bf16 cache and finds its own."""
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=8)
    fp32_dir, bf16_dir = tmp_path / "fp32", tmp_path / "bf16"
    for out, precision in ((fp32_dir, "fp32"), (bf16_dir, "amp_bf16")):
        assert features_cli.main(["--config", str(repo_root / "configs/train/smoke.yaml"), "--out", str(out),
                              *overrides(repo_root, shards, f"backbone.precision={precision}")]) == 0
    from safetensors.torch import load_file

    ref, low = load_file(str(fp32_dir / "00000.safetensors")), load_file(str(bf16_dir / "00000.safetensors"))
    for name in ("image_emb", "teacher_emb"):
        assert not torch.equal(ref[name], low[name])  # bf16 really ran
        cosine = torch.nn.functional.cosine_similarity(ref[name], low[name])
        # Measured on the tiny CLIP: cosine >= 0.99995, max |diff| <= 0.6 % of max |x|.
        assert cosine.min() > 0.9995, (name, cosine.min())
        assert (ref[name] - low[name]).abs().max() < 0.02 * ref[name].abs().max()

    index = json.loads((bf16_dir / "00000.json").read_text())
    assert index["backbone"]["precision"] == "amp_bf16"
    assert "precision" not in json.loads((fp32_dir / "00000.json").read_text())["backbone"]
    cfg = smoke_config(repo_root, shards, f"data.features={bf16_dir}")
    backbone, _ = build_modules(cfg, torch.device("cpu"))
    with pytest.raises(FeatureCacheError, match="amp_bf16"):
        one_process_data(cfg, backbone)
    # The default folders differ too, so "auto" never mixes them up.
    fp32_auto = features.default_cache_dir(["x/00000.tar"], cache_slug(backbone))
    backbone.cfg.precision = "amp_bf16"
    bf16_auto = features.default_cache_dir(["x/00000.tar"], cache_slug(backbone))
    assert fp32_auto == default_cache_dir(["x/00000.tar"], backbone.identity_str) and bf16_auto != fp32_auto


def test_half_precision_backbones_encode_float32_images_and_texts(tiny_backbone):
    """pure_bf16 / bf16 / pure_fp16 towers take float32 pixels (cast to the tower's dtype)."""
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig

    images = torch.rand(3, 3, 32, 32)
    ref_img, ref_txt = tiny_backbone.encode_image(images), tiny_backbone.encode_text(["a red dog"]).pooled
    for precision in ("pure_bf16", "bf16", "pure_fp16"):
        torch.manual_seed(0)  # same draw as the fixture, then cast
        low = FrozenCLIP(BackboneConfig(name=tiny_backbone.cfg.name, pretrained=None, precision=precision))
        img, txt = low.encode_image(images), low.encode_text(["a red dog"]).pooled
        assert img.dtype == torch.float32 and txt.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(img, ref_img).min() > 0.999
        assert torch.nn.functional.cosine_similarity(txt, ref_txt).min() > 0.999
    with pytest.raises(ValueError, match="precision"):
        FrozenCLIP(BackboneConfig(name=tiny_backbone.cfg.name, pretrained=None, precision="half"))


@pytest.mark.parametrize("noise_mode", ["downweight", "conesep"])
def test_noise_modes_on_cached_features_equal_decoded_images(repo_root, tmp_path, noise_mode):
    """GFQ per batch reads T_rew's embedding from the cache (no text pass) or encodes it: same losses."""
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=12)
    build_cache(repo_root, shards, "data.cache_dtype=float32", "--plot", "none")

    results = {}
    for mode in ("auto", "null"):
        cfg = smoke_config(repo_root, shards, f"data.features={mode}", "model.mapping_dropout=0",
                           f"noise.mode={noise_mode}",
                           f"model.negative_tokens={2 if noise_mode == 'conesep' else 0}")
        backbone, model = build_modules(cfg, torch.device("cpu"))
        loader, _ = one_process_data(cfg, backbone)
        batch = next(iter(loader))
        results[mode] = (batch, compute_losses(model, batch, backbone, noise=cfg.noise, step=1, seed=0))
    (cached, cached_losses), (raw, raw_losses) = results["auto"], results["null"]
    assert "rew_emb" in cached and "rew_emb" not in raw and cached["target_kinds"] == raw["target_kinds"]
    for term in ("loss", "distil", "align", "ul", "intra", "noisy_align", "noisy_distil"):
        torch.testing.assert_close(cached_losses[term], raw_losses[term], rtol=1e-4, atol=1e-5, msg=term)
