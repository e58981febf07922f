"""Kill a training process mid-way, rerun the same command: same final step and weights."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from demind.cli import train
from toyworld.synthetic import write_synthetic_shards

from helpers import kill_at_checkpoint

TOTAL_STEPS = 40


pytestmark = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")


def run_args(repo_root: Path, shards: Path, run: Path) -> list[str]:
    # Two DataLoader workers and epoch-wise shard splitting: resume must restore each
    # worker's position in its own stream.
    return ["--config", str(repo_root / "configs/train/smoke.yaml"), f"data.shards={shards}",
            f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", f"run.output_dir={run}",
            f"optim.max_steps={TOTAL_STEPS}", "optim.warmup_steps=4", "optim.global_batch_size=8",
            "run.save_every=5", "run.log_every=1", "run.keep_checkpoints=3",
            "data.num_workers=2", "data.resample=false", "data.shards_per_group=1", "data.shuffle_buffer=16"]


def kill_after_checkpoint(args: list[str], run: Path, repo_root: Path, step: int) -> int:
    """Start ``python train.py args``; SIGKILL it and its DataLoader workers once the step-``step`` checkpoint exists."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root))
    return kill_at_checkpoint([sys.executable, str(repo_root / "train.py"), *args], repo_root, env, run, step, 120)


def test_killed_run_resumes_to_the_same_weights(repo_root, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=4, samples_per_shard=12)

    reference = tmp_path / "uninterrupted"
    assert train.main(run_args(repo_root, shards, reference)) == 0

    resumed = tmp_path / "killed"
    returncode = kill_after_checkpoint(run_args(repo_root, shards, resumed), resumed, repo_root, step=10)
    assert returncode == -signal.SIGKILL
    assert not (resumed / "demind.safetensors").exists(), "the run finished before it was killed"
    killed_at = max(int(p.name.split("_")[1].split(".")[0]) for p in (resumed / "checkpoints").iterdir())
    assert killed_at < TOTAL_STEPS

    assert train.main(run_args(repo_root, shards, resumed)) == 0

    final = json.loads((resumed / "checkpoints" / f"step_{TOTAL_STEPS:08d}" / "trainer_state.json").read_text())
    assert final["step"] == TOTAL_STEPS and final["samples_seen"] == TOTAL_STEPS * 8
    expected = load_file(str(reference / "demind.safetensors"))
    got = load_file(str(resumed / "demind.safetensors"))
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # the log continues without repeating or skipping steps, and the losses match step by step
    steps = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    ref_steps = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, TOTAL_STEPS + 1))
    assert [m["loss"] for m in steps] == pytest.approx([m["loss"] for m in ref_steps], rel=1e-5)


def test_resuming_with_max_steps_below_the_checkpoints_step_is_refused(repo_root, tmp_path, capsys):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=8)
    run = tmp_path / "run"
    args = ["--config", str(repo_root / "configs/train/smoke.yaml"), f"data.shards={shards}",
            f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", f"run.output_dir={run}",
            "optim.warmup_steps=1", "optim.global_batch_size=4", "run.save_every=4", "run.log_every=4",
            "data.num_workers=0"]
    assert train.main([*args, "optim.max_steps=4"]) == 0
    exported = (run / "demind.safetensors").read_bytes()
    capsys.readouterr()
    assert train.main([*args, "optim.max_steps=2"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in captured.err, captured.err[-2000:]
    assert "optim.max_steps=2" in errors[0] and "step 4" in errors[0] and "step_00000004" in errors[0]
    assert "steps 4 -> 2" not in captured.out + captured.err
    assert (run / "demind.safetensors").read_bytes() == exported  # no export claiming a step it is not
