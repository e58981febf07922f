"""train.py end to end on the tiny backbone and generated intent shards (CPU)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from demind.cli import train
from demind.checkpoint import load_checkpoint, read_checkpoint_metadata
from demind.data import ShardFormatError
from toyworld.synthetic import write_intent_shard, write_synthetic_shards
from demind.trainkit import NonFiniteLossError, ResumeError
from demind.training import TrainConfig, check_finite, lr_factor, OptimConfig


pytestmark = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")



def run_training(args: list[str]) -> int:
    """The train command's body without the error wrapper: bad input raises its own exception type."""
    from demind.cli.common import load_command_config

    return train.train_command(load_command_config(train.TrainConfig, train.build_parser().parse_intermixed_args(args)))


def smoke_args(repo_root: Path, shards: Path, run: Path, *extra: str) -> list[str]:
    return ["--config", str(repo_root / "configs/train/smoke.yaml"), f"data.shards={shards}",
            f"run.output_dir={run}", f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", *extra]


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_few_steps_write_state_and_export(repo_root, tmp_path, tiny_backbone):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=24)
    run = tmp_path / "run"
    args = smoke_args(repo_root, shards, run, "optim.max_steps=4", "run.save_every=2", "run.log_every=2",
                      "run.keep_checkpoints=1")
    assert train.main(args) == 0

    export = run / "demind.safetensors"
    meta = read_checkpoint_metadata(export)
    assert meta["backbone_identity"] == tiny_backbone.identity
    model = load_checkpoint(export, tiny_backbone)
    assert model.cfg.num_queries == 2  # from smoke.yaml, not the default 4
    # keep_checkpoints=1: the step-2 state was pruned, the final one is complete
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]
    final = run / "checkpoints" / "step_00000004"
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["samples_seen"] == 4 * 16
    assert (final / "config.yaml").is_file() and (final / "optimizer.bin").is_file()
    # the Accelerate state and the export hold the same trained weights, which moved from init
    saved = load_file(str(final / "model.safetensors"))
    exported = load_file(str(export))
    assert saved.keys() == exported.keys()
    for name in saved:
        torch.testing.assert_close(saved[name], exported[name])
    assert not torch.equal(exported["gate"], torch.tensor(0.0))
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [2, 4]
    assert all(math.isfinite(m["loss"]) and m["loss"] == pytest.approx(m["distil"] + m["align"], rel=1e-5)
               for m in metrics)

    # Rerunning the finished command trains nothing more and re-exports the same weights.
    assert train.main(args) == 0
    assert [m["step"] for m in read_metrics(run)] == [2, 4]
    for name, value in load_file(str(export)).items():
        torch.testing.assert_close(value, exported[name])

    # Resuming with another model is refused, naming the key.
    with pytest.raises(ResumeError, match="model.num_queries"):
        run_training(args + ["model.num_queries=3"])
    # A speed-only backbone setting is not another backbone: the finished run is accepted.
    assert train.main(args + ["backbone.text_buckets=1"]) == 0


def test_loss_falls_on_a_learnable_task(repo_root, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=32, seed=1)
    run = tmp_path / "run"
    train.main(smoke_args(repo_root, shards, run, "optim.max_steps=30", "optim.warmup_steps=3", "optim.lr=3e-3",
                          "run.log_every=1", "run.save_every=100"))
    losses = [m["loss"] for m in read_metrics(run)]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.75 * first, (first, last)  # 0.41-0.59 seen over four data/run seeds


def test_missing_intent_field_is_an_error_naming_shard_and_field(repo_root, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=20, omit=("int.txt",))
    with pytest.raises(ShardFormatError) as info:
        run_training(smoke_args(repo_root, shards, tmp_path / "run", "optim.max_steps=1"))
    message = str(info.value)
    assert "00000.tar" in message and "'int.txt'" in message and "data.missing_text=original" in message


def counts_after_training(repo_root, shards, run, steps: int, *overrides: str) -> dict:
    """Train ``steps`` smoke steps with no read-ahead (shuffle buffer 1); the checkpoint's skip/fallback counts."""
    train.main(smoke_args(repo_root, shards, run, f"optim.max_steps={steps}", "data.shuffle_buffer=1", *overrides))
    return json.loads((run / f"checkpoints/step_{steps:08d}/trainer_state.json").read_text())["counts"]


def first_good_jpeg(tmp_path) -> bytes:
    import webdataset as wds

    good = write_synthetic_shards(tmp_path / "good", num_shards=1, samples_per_shard=1)[0]
    return next(iter(wds.WebDataset(str(good), shardshuffle=False)))["jpg"]


def test_missing_field_fallback_is_counted(repo_root, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=40, omit=("rew.txt",))
    counts = counts_after_training(repo_root, shards, tmp_path / "run", 2, "data.missing_text=original")
    # buffer 1 -> no read-ahead beyond the batch: exactly the 32 consumed samples fell back
    assert counts == {"fallback_rewritten": 32}


def test_empty_rewritten_caption_of_single_prompt_mode_falls_back_and_is_counted(repo_root, tmp_path):
    # data_gen's "w/o CoT" mode writes an empty rew.txt; the caption stands in, counted.
    image = first_good_jpeg(tmp_path)
    samples = [{"key": f"k{i:03d}", "jpg": image, "txt": "a red square", "rew.txt": "" if i % 2 else "a red square",
                "int.txt": "make it red"} for i in range(16)]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_intent_shard(shards / "00000.tar", samples)
    counts = counts_after_training(repo_root, shards, tmp_path / "run", 1, "optim.global_batch_size=12")
    assert counts == {"fallback_empty_rewritten": 6}


def test_corrupt_images_are_skipped_and_counted(repo_root, tmp_path):
    shards = tmp_path / "shards"
    image = first_good_jpeg(tmp_path)
    samples = []
    for i in range(20):
        samples.append({"key": f"k{i:03d}", "jpg": b"not a jpeg" if i % 4 == 0 else image,
                        "txt": "a red square", "rew.txt": "a square painted red", "int.txt": "make it red"})
    shards.mkdir()
    write_intent_shard(shards / "00000.tar", samples)
    counts = counts_after_training(repo_root, shards, tmp_path / "run", 1, "optim.global_batch_size=12")
    assert counts == {"skipped_corrupt_image": 4}  # keys 0, 4, 8, 12 of the 16 read for 12 good ones


def test_non_finite_loss_stops_the_run_naming_the_terms(repo_root, tmp_path, monkeypatch):
    from demind.model import DeMinds

    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=20)
    # a NaN temperature makes both terms NaN (model.init_logit_scale=.nan itself is now refused at load)
    monkeypatch.setattr(DeMinds, "temperature_scale", lambda self: torch.tensor(float("nan")))
    with pytest.raises(NonFiniteLossError, match=r"distil=nan.*align=nan"):
        run_training(smoke_args(repo_root, shards, tmp_path / "run", "optim.max_steps=2"))

    class OneProcess:
        num_processes = 1

    terms = {"loss": torch.tensor(float("inf")), "distil": torch.tensor(float("inf")), "align": torch.tensor(0.5)}
    with pytest.raises(NonFiniteLossError, match=r"step 7.*terms loss, distil"):
        check_finite(terms, 7, OneProcess())
    check_finite({k: torch.tensor(1.0) for k in terms}, 7, OneProcess())


def test_config_errors_name_the_key(repo_root, tmp_path, capsys):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=4)
    assert train.main(smoke_args(repo_root, shards, tmp_path / "run", "optim.lrr=1")) == 2
    assert "optim.lrr" in capsys.readouterr().err
    assert train.main(smoke_args(repo_root, shards, tmp_path / "run", "data.missing_text=caption")) == 2
    assert ("config key 'data.missing_text' = 'caption' must be one of 'error', 'original' (command line)"
            in capsys.readouterr().err)
    # found at load time now (one validation pass), not when the trainer starts
    assert train.main(smoke_args(repo_root, shards, tmp_path / "run", "optim.global_batch_size=10",
                                 "optim.grad_accum_steps=4")) == 2
    assert re.search(r"^error: .*'optim.global_batch_size' = 10 must be a multiple of optim.grad_accum_steps = 4",
                     capsys.readouterr().err, flags=re.M)


def test_learning_rate_schedule():
    optim = OptimConfig(warmup_steps=10, max_steps=110, min_lr_ratio=0.0)
    assert lr_factor(0, optim) == pytest.approx(0.1)
    assert lr_factor(9, optim) == pytest.approx(1.0)
    assert lr_factor(60, optim) == pytest.approx(0.5)
    assert lr_factor(110, optim) == pytest.approx(0.0, abs=1e-12)
    assert TrainConfig().optim.lr == 1e-6


def test_grad_accumulation_bf16_and_checkpointing_from_the_config(repo_root, tmp_path):
    """2 micro-batches of 8 per optimizer step: 2 optimizer steps consume 32 samples."""
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=40)
    run = tmp_path / "run"
    train.main(smoke_args(repo_root, shards, run, "optim.max_steps=2", "optim.grad_accum_steps=2",
                          "run.log_every=1", "run.mixed_precision=bf16", "data.shards_per_group=1",
                          "backbone.grad_checkpointing=true"))
    assert [m["samples_seen"] for m in read_metrics(run)] == [16, 32]
    assert all(math.isfinite(m["loss"]) for m in read_metrics(run))
    final = run / "checkpoints/step_00000002"
    optimizer = torch.load(final / "optimizer.bin", weights_only=True)
    assert {int(s["step"]) for s in optimizer["state"].values()} == {2}  # not 4: accumulation held the step
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["positions"] == [{"0": [0, 32]}]  # worker 0 consumed 32 samples of its first group
    assert load_file(str(run / "demind.safetensors"))["gate"].dtype == torch.float32


def test_shards_without_a_usable_image_stop_the_run(repo_root, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_intent_shard(shards / "00000.tar", [
        {"key": f"k{i:03d}", "jpg": b"not a jpeg", "txt": "a", "rew.txt": "b", "int.txt": "c"} for i in range(20)])
    with pytest.raises(ShardFormatError, match=r"1000 samples in a row could not be used.*00000\.tar"):
        run_training(smoke_args(repo_root, shards, tmp_path / "run", "optim.max_steps=1"))


def test_cc3m_like_synthetic_texts_have_the_papers_lengths(tmp_path, tiny_backbone):
    """text_lengths=cc3m: T_ori ~12 words, T_rew ~65 and T_int ~27 CLIP tokens, each naming the colour;
    the default short texts are unchanged."""
    import numpy as np
    import webdataset as wds

    from toyworld.synthetic import CC3M_TEXT_WORDS, synthetic_texts

    rng = np.random.default_rng(0)
    texts = [synthetic_texts("red", rng, "cc3m") for _ in range(300)]
    for column, target in zip(zip(*texts), CC3M_TEXT_WORDS):
        tokens = [len(tiny_backbone._token_ids(t)) for t in column]
        assert abs(np.mean(tokens) - target) < 0.1 * target, (np.mean(tokens), target)
        assert np.std(tokens) > 0.1 * target  # lengths vary, as real captions do
        assert all("red" in t for t in column)
    assert synthetic_texts("red", rng, "short") == ("a red square", "a square painted red", "make the square red")
    with pytest.raises(ValueError, match="text_lengths"):
        synthetic_texts("red", rng, "long")
    shard = write_synthetic_shards(tmp_path, num_shards=1, samples_per_shard=4, text_lengths="cc3m")[0]
    samples = list(wds.WebDataset(str(shard), shardshuffle=False))
    assert all(len(s["rew.txt"].split()) > 20 for s in samples)


def test_log_window_sums_on_the_device_equal_python_float_sums():
    """Loss sums kept as float64 tensors (no host sync per step) give the means that summing
    Python floats gave."""
    from demind.training.step_log import LOSS_TERMS, DeMindsLogWindow

    torch.manual_seed(0)
    steps = [{t: torch.rand(()) * 10 for t in LOSS_TERMS} for _ in range(7)]
    window = DeMindsLogWindow()
    for losses in steps:
        window.add(losses)
    expected = torch.tensor([sum(float(s[t]) for s in steps) / len(steps) for t in LOSS_TERMS])
    assert torch.equal(window.means(torch.device("cpu")), expected)
    assert torch.equal(DeMindsLogWindow().means(torch.device("cpu")), torch.zeros(len(LOSS_TERMS)))
