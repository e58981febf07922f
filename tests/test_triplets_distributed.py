"""demind-train-triplets in several processes (``accelerate launch``, two CPU processes over gloo).

Every process holds all cached features and draws the same epoch order; each composes half of
each global batch and the queries are gathered with gradients, so every term is the one-process
term of the whole batch. Two processes therefore train the weights of one process with the same
global batch, up to float32 rounding: the two halves' gradients are summed by the gather and
averaged by DDP in another order than one process sums them (measured: max |diff| 1.5e-8 on
weights of size ~0.2 after 9 steps of conesep). Small-loss's per-sample losses are split over the
processes and summed, GFQ's filter is the main process's, so the noise scores agree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TINY_CLIP
from test_train_distributed import free_port
from test_triplets import tiny_config, weights, write_tiny_triplets

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed: pip install -e '.[train,deepspeed]'")
EPOCHS = 3
# float32 sums in another order (see the module docstring); weights are ~0.2 in size
WEIGHT_TOLERANCE = dict(rtol=1e-5, atol=1e-6)

# Saves the state as the trainer does, then SIGKILLs this (the main) process after epoch 2:
# the launcher then ends the other process, as a kill of the whole job would.
KILL_AFTER_EPOCH_2 = r'''
import os, signal, sys
import demind.triplets.train as train_module
from demind.cli.train_triplets import main

real_save = train_module.save_train_state

def save_then_die(*args, **kwargs):
    real_save(*args, **kwargs)
    if kwargs["extra"]["epoch"] == 2:
        os.kill(os.getpid(), signal.SIGKILL)

train_module.save_train_state = save_then_die
sys.exit(main(sys.argv[1:]))
'''


def overrides(folder: Path, out: Path, mode: str, *extra: str) -> list[str]:
    return [f"backbone.name={TINY_CLIP}", "backbone.pretrained=null", "data.source=file",
            f"data.path={folder / 'triplets.jsonl'}", f"data.cache_dir={folder / 'cache'}", f"run.output_dir={out}",
            "run.device=cpu", "run.progress=false", f"robust.mode={mode}", f"optim.epochs={EPOCHS}",
            "optim.batch_size=8", "model.projection_dim=16", "model.hidden_dim=16", "noise.rate=0.5", *extra]


def launch(repo_root: Path, args: list[str], script: Path | None = None, config: str = "multi_cpu.yaml",
           processes: int = 2, extra_env: dict[str, str] | None = None, flags: tuple[str, ...] = ()
           ) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file configs/accelerate/<config> -m demind.cli.train_triplets ARGS``
    (or ``script`` in its place), as docs/training.md launches it."""
    target = [str(script)] if script else ["-m", "demind.cli.train_triplets"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(repo_root / "configs/accelerate" / config), "--num_processes", str(processes),
           "--main_process_port", str(free_port()), *flags, *target, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root), **(extra_env or {}))
    return subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def triplet_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("triplets")
    write_tiny_triplets(folder)
    return folder


# ------------------------------------------------------------------------------------------ fast


def test_process_shares_split_the_batch_and_the_per_sample_losses(triplet_folder, tmp_path):
    """Two shares' per-sample losses (each process every other batch, zeros elsewhere), summed, are
    the one-process losses; the shares' rows tile the global batch."""
    from demind.backbone import build_backbone
    from demind.combiner import Combiner
    from demind.trainkit import ProcessShare
    from demind.triplets.modes import per_sample_losses
    from demind.triplets.train import load_training_data

    cfg = tiny_config(triplet_folder, tmp_path / "run")
    assert [ProcessShare(r, 4).rows(8) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    backbone = build_backbone(cfg.backbone, device=torch.device("cpu"))
    data = load_training_data(cfg, backbone)
    torch.manual_seed(0)
    model = Combiner(cfg.model, backbone)
    order = torch.randperm(data.reference.shape[0], generator=torch.Generator().manual_seed(1))
    args = (model, data.reference, data.text, data.target, 1 / 0.07, 8, order)
    whole = per_sample_losses(*args)
    parts = [per_sample_losses(*args, share=ProcessShare(r, 2)) for r in range(2)]
    assert all((p > 0).sum() in (8, 16) for p in parts) and ((parts[0] > 0) & (parts[1] > 0)).sum() == 0
    assert torch.equal(parts[0] + parts[1], whole) and (whole > 0).all()


def test_deepspeed_asked_for_but_not_installed_is_one_error_line(triplet_folder, tmp_path, monkeypatch, capsys):
    """What `accelerate launch` with a DeepSpeed config sets, with `import deepspeed` failing as it does
    when the package is absent."""
    from demind.cli import train_triplets

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert train_triplets.main(overrides(triplet_folder, tmp_path / "run", "none")) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the launcher asked for DeepSpeed"), lines
    # refused before anything was written (the config check made and probed the empty run folder only)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_mixed_precision_from_the_launcher_is_refused_not_ignored(triplet_folder, tmp_path, monkeypatch, capsys,
                                                                 one_thread_and_fresh_accelerator):
    from demind.cli import train_triplets

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # `accelerate launch --mixed_precision bf16`
    assert train_triplets.main(overrides(triplet_folder, tmp_path / "run", "none")) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "trains in float32" in lines[0] and "--mixed_precision no" in lines[0], lines


# ------------------------------------------------------------------------------------------ slow


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["small-loss", "conesep"])
def test_two_processes_train_the_one_process_weights(repo_root, triplet_folder, tmp_path, mode,
                                                     one_thread_and_fresh_accelerator):
    """small-loss: the GMM on every triplet's loss; conesep: GFQ's filter, NBL and BTU. Dropout off:
    the two runs must draw the same (no) masks."""
    from demind.triplets.train import train_triplets

    one = train_triplets(tiny_config(triplet_folder, tmp_path / "one", mode, epochs=EPOCHS,
                                     **{"noise.rate": 0.5, "model.dropout": 0}))
    result = launch(repo_root, overrides(triplet_folder, tmp_path / "two", mode, "model.dropout=0"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    two = tmp_path / "two"
    a, b = weights(one), weights(two / "combiner.safetensors")
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"{mode}: two processes vs one, max |weight diff| {worst:.3g}")
    for name in a:
        torch.testing.assert_close(b[name], a[name], **WEIGHT_TOLERANCE, msg=name)
    # one writer: a metrics line per epoch (not per process), the same losses and kept shares
    ones = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    twos = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in twos] == list(range(1, EPOCHS + 1))
    for x, y in zip(ones, twos):
        assert x["kept"] == y["kept"] and x.get("flagged") == y.get("flagged") and x["lr"] == y["lr"]
        assert abs(x["loss"] - y["loss"]) < 1e-4
    # the mode's detector acted (small-loss filters; conesep flags half of each batch for BTU)
    assert ones[-1]["kept"] < 1.0 or ones[-1]["flagged"] > 0
    assert json.loads((two / "run.json").read_text())["processes"] == 2
    # the noise scores of every triplet, from the main process's weights
    x, y = (json.loads((p / "detection.json").read_text()) for p in (tmp_path / "one", two))
    assert x["auroc"] == y["auroc"]
    torch.testing.assert_close(torch.tensor(y["scores"]), torch.tensor(x["scores"]), rtol=0, atol=1e-4)
    assert not (two / "state.safetensors").exists()


@pytest.mark.slow
def test_two_processes_resume_after_a_kill_with_the_same_weights(repo_root, triplet_folder, tmp_path):
    """With dropout (each process its own masks): killed after epoch 2's state, rerun with the same
    command, the run ends with the weights of the uninterrupted two-process run, bit for bit."""
    whole = launch(repo_root, overrides(triplet_folder, tmp_path / "whole", "conesep"))
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    killed = tmp_path / "killed"
    script = tmp_path / "kill_after_epoch_2.py"
    script.write_text(KILL_AFTER_EPOCH_2)
    died = launch(repo_root, overrides(triplet_folder, killed, "conesep"), script=script)
    assert died.returncode != 0 and (killed / "state.safetensors").is_file(), died.stderr[-3000:]
    assert not (killed / "combiner.safetensors").exists()
    resumed = launch(repo_root, overrides(triplet_folder, killed, "conesep"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and "at epoch 2 of 3" in resumed.stderr
    a, b = weights(tmp_path / "whole" / "combiner.safetensors"), weights(killed / "combiner.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [1, 2, 3]  # no epoch logged twice


@pytest.mark.slow
def test_a_global_batch_that_does_not_split_is_one_error_line(repo_root, triplet_folder, tmp_path):
    result = launch(repo_root, overrides(triplet_folder, tmp_path / "run", "none", "optim.batch_size=7"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors, result.stderr[-3000:]
    assert "optim.batch_size=7 (the global batch) does not split into 2 processes" in errors[0]


DS_ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_launch_trains_the_one_process_weights_and_resumes_after_a_kill(
        repo_root, triplet_folder, tmp_path, one_thread_and_fresh_accelerator):
    """configs/accelerate/deepspeed_zero2.yaml, two CPU processes (DS_ACCELERATOR=cpu, gloo), ZeRO-2 in
    float32: the one-process weights to float rounding; killed after epoch 2, rerun, the uninterrupted
    DeepSpeed run's weights; continuing it without DeepSpeed is refused in one line."""
    from demind.triplets.train import train_triplets

    # the config's bf16 is for De-MINDS; this trainer is float32 and says so unless told "no"
    ds = dict(config="deepspeed_zero2.yaml", extra_env=DS_ENV, flags=("--mixed_precision", "no"))
    common = ["model.dropout=0"]
    one = train_triplets(tiny_config(triplet_folder, tmp_path / "one", "conesep", epochs=EPOCHS,
                                     **{"noise.rate": 0.5, "model.dropout": 0}))
    deep = tmp_path / "deep"
    result = launch(repo_root, overrides(triplet_folder, deep, "conesep", *common), **ds)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "DeepSpeed ZeRO stage 2: micro batch 4" in result.stderr
    a, b = weights(one), weights(deep / "combiner.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], **WEIGHT_TOLERANCE, msg=name)
    assert not (deep / "deepspeed_state").exists()  # the export is the finished run's record

    killed = tmp_path / "killed"
    script = tmp_path / "kill_after_epoch_2.py"
    script.write_text(KILL_AFTER_EPOCH_2)
    died = launch(repo_root, overrides(triplet_folder, killed, "conesep", *common), script=script, **ds)
    assert died.returncode != 0 and (killed / "deepspeed_state" / "epoch_2").is_dir(), died.stderr[-3000:]
    plain = launch(repo_root, overrides(triplet_folder, killed, "conesep", *common))
    errors = [line for line in plain.stderr.splitlines() if line.startswith("error:")]
    assert plain.returncode != 0 and errors and "written under DeepSpeed" in errors[0], plain.stderr[-3000:]
    resumed = launch(repo_root, overrides(triplet_folder, killed, "conesep", *common), **ds)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at epoch 2 of 3" in resumed.stderr
    again = weights(killed / "combiner.safetensors")
    assert all(torch.equal(again[k], b[k]) for k in b)
