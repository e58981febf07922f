"""DeepSpeed through ``accelerate launch``: it trains (DistributedType.DEEPSPEED), or the run is refused
in one line; on a CPU machine with DS_ACCELERATOR=cpu (the slow tests), it exports, resumes after a
kill and its weights match the plain single-process run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from demind.cli import train
from demind.config import load_config
from demind.model import build_model
from toyworld.synthetic import write_synthetic_shards
from demind.training import TrainConfig, build_modules
from demind.trainkit import DeepSpeedError, hold_scalars_as_vectors
from demind.training.accel import configure_deepspeed

from helpers import kill_at_checkpoint

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed: pip install -e '.[train,deepspeed]'")
DS_YAML = "configs/accelerate/deepspeed_zero2.yaml"
STEPS = 8
# fp32 ZeRO-2 against the plain fp32 run: the same arithmetic except where DeepSpeed sums
# (gradient norm for clipping, flattened AdamW update), so only float32 rounding may differ.
FP32_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
# bf16 ZeRO-2 (the GPU recipe's precision) against the same plain fp32 run: forward and backward see
# weights rounded to 8 mantissa bits (~0.4 %), the float32 masters keep the updates exact, so after
# 8 steps the weights differ at rounding level: relative L2 over all tensors 1.7e-3 measured; 1e-2 allowed.
BF16_RELATIVE_L2 = 1e-2


def smoke_args(repo_root: Path, shards: Path, run: Path, *extra: str) -> list[str]:
    return ["--config", str(repo_root / "configs/train/smoke.yaml"), f"data.shards={shards}",
            f"run.output_dir={run}", f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", *extra]


def tiny_config(repo_root: Path, tmp_path: Path, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, repo_root / "configs/train/smoke.yaml",
                       [f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", "model.mapping_dropout=0",
                        f"run.output_dir={tmp_path / 'run'}", *extra])


# ------------------------------------------------------------------------------------------ fast


def test_deepspeed_asked_for_but_not_installed_is_one_error_line(repo_root, tmp_path, monkeypatch, capsys):
    """What `accelerate launch` with a DeepSpeed config sets, with `import deepspeed` failing as it does
    when the package is absent (None in sys.modules is Python's "not importable")."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert train.main(smoke_args(repo_root, tmp_path / "shards", tmp_path / "run")) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the launcher asked for DeepSpeed"), lines
    assert "pip install -e '.[train,deepspeed]'" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_deepspeed_numbers_come_from_the_train_config(repo_root, tmp_path):
    cfg = tiny_config(repo_root, tmp_path, "optim.grad_clip=null", "optim.grad_accum_steps=2")
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"})
    config = configure_deepspeed(plugin, cfg, num_processes=2, micro_batch=4)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["train_batch_size"] == 16
    assert config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 0.0  # grad_clip null: none, not Accelerate's default 1.0


@pytest.mark.parametrize("key, value", [("gradient_clipping", 1.0), ("gradient_accumulation_steps", 4),
                                        ("train_micro_batch_size_per_gpu", 8)])
def test_a_deepspeed_config_contradicting_the_train_config_is_refused(repo_root, tmp_path, key, value):
    cfg = tiny_config(repo_root, tmp_path, "optim.grad_clip=null")
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 2}, key: value})
    with pytest.raises(DeepSpeedError, match=rf"sets {key}: {value}, but the train config gives"):
        configure_deepspeed(plugin, cfg, num_processes=1, micro_batch=16)


def test_bf16_weights_take_float32_inputs_and_leave_the_backbone_alone(repo_root, tmp_path):
    """DeepSpeed's bf16 casts the trainable weights (and Accelerate turns autocast off): the float32
    cached embeddings must still go in, and the frozen tower keeps backbone.precision."""
    cfg = tiny_config(repo_root, tmp_path)
    backbone, model = build_modules(cfg, torch.device("cpu"))
    image_emb = torch.randn(3, backbone.embed_dim)
    model.bfloat16()  # older DeepSpeed; 0.19 casts the parameters one by one, which skips _apply
    assert model.mapping.layers[0].weight.dtype == torch.bfloat16 and model.gate.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in backbone.parameters())
    out = model(image_emb, ["red", "a dog", "at night"])
    assert out.t_hat.shape == (3, backbone.embed_dim) and torch.isfinite(out.t_hat).all()
    model.to("cpu")  # a device move still reaches the backbone
    assert backbone.device.type == "cpu"


def test_scalars_held_as_vectors_are_saved_and_loaded_0_dim(repo_root, tmp_path):
    cfg = tiny_config(repo_root, tmp_path, "model.learnable_temperature=true")
    backbone, model = build_modules(cfg, torch.device("cpu"))
    with torch.no_grad():
        model.gate.fill_(0.25)
    hold_scalars_as_vectors(model)  # what the trainer does before DeepSpeed builds its engine
    assert model.gate.shape == (1,) and model.logit_scale.shape == (1,)
    state = model.state_dict()
    assert state["gate"].shape == () and state["logit_scale"].shape == () and float(state["gate"]) == 0.25
    plain = build_model(cfg.model, backbone)  # a 0-dim model loads it, and the held one loads a 0-dim state
    plain.load_state_dict(state)
    assert plain.gate.shape == () and float(plain.gate.detach()) == 0.25
    model.load_state_dict(plain.state_dict())
    assert model.gate.shape == (1,)


@needs_deepspeed
def test_run_device_cuda_without_a_gpu_is_refused(repo_root, tmp_path, monkeypatch):
    from demind.trainkit import deepspeed_device

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(DeepSpeedError, match=r"'run.device' = 'cuda', but DeepSpeed's accelerator here is 'cpu'"):
        deepspeed_device(tiny_config(repo_root, tmp_path, "run.device=cuda").run.device)


def test_accelerate_setting_up_anything_but_deepspeed_is_refused_not_used(repo_root, tmp_path, monkeypatch):
    """The launcher asked for DeepSpeed, but Accelerate came up as something else (as it did, silently,
    as MULTI_CPU before): one DeepSpeedError naming what it set up, never a run without DeepSpeed."""
    import accelerate
    from accelerate.utils import DistributedType

    from demind.training import accel

    class NotDeepSpeed:  # stands in for Accelerator: what it set up is all setup() reads before refusing
        distributed_type = DistributedType.MULTI_CPU

        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setattr(accelerate, "Accelerator", NotDeepSpeed)
    monkeypatch.setattr(accel, "deepspeed_device", lambda device: "cpu")  # DeepSpeed itself need not be installed
    with pytest.raises(DeepSpeedError, match=r"asked for DeepSpeed but Accelerate set up .*MULTI_CPU.*"
                                             r"configs/accelerate/deepspeed_zero2\.yaml"):
        accel.setup(tiny_config(repo_root, tmp_path, "run.device=cpu"), deepspeed=True)



def test_both_trainers_refuse_another_engine_naming_their_launch():
    """The one refusal (demind.trainkit) with each trainer's launch: the triplet trainer's adds
    --mixed_precision no (it trains in float32)."""
    from accelerate.utils import DistributedType

    from demind.trainkit import DEEPSPEED_LAUNCH, DeepSpeedError, refuse_without_deepspeed

    class Engine:  # what Accelerate set up is all the refusal reads
        def __init__(self, kind):
            self.distributed_type = kind

    refuse_without_deepspeed(Engine(DistributedType.DEEPSPEED))  # DeepSpeed trains: nothing to refuse
    with pytest.raises(DeepSpeedError, match=r"^the launcher asked for DeepSpeed but Accelerate set up .*NO.*; "
                                             r"launch with `accelerate launch --config_file "
                                             r"configs/accelerate/deepspeed_zero2\.yaml --mixed_precision no`$"):
        refuse_without_deepspeed(Engine(DistributedType.NO), f"{DEEPSPEED_LAUNCH} --mixed_precision no")

# ------------------------------------------------------------------------------------------ slow


def launch_command(repo_root: Path, args: list[str], ds_yaml: Path | None = None) -> list[str]:
    accelerate = Path(sys.executable).with_name("accelerate")
    return [str(accelerate), "launch", "--config_file", str(ds_yaml or repo_root / DS_YAML), "--num_processes", "1",
            str(repo_root / "train.py"), *args]


def launch_env(repo_root: Path) -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root))


def launch(repo_root: Path, args: list[str], ds_yaml: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(launch_command(repo_root, args, ds_yaml), cwd=repo_root, env=launch_env(repo_root),
                          capture_output=True, text=True, timeout=600)


def launch_and_kill(repo_root: Path, args: list[str], run: Path, step: int) -> None:
    """Start the launcher; SIGKILL it and the trainer once the step-``step`` checkpoint exists."""
    kill_at_checkpoint(launch_command(repo_root, args), repo_root, launch_env(repo_root), run, step, 600)


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_launch_trains_resumes_after_a_kill_and_matches_the_plain_run(repo_root, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=4, samples_per_shard=16)
    # dropout off: the engine's start-up may draw from the RNG, so masks could differ between launchers
    common = [f"optim.max_steps={STEPS}", "run.save_every=2", "run.log_every=1", "model.mapping_dropout=0"]

    deep = tmp_path / "deepspeed"
    result = launch(repo_root, smoke_args(repo_root, shards, deep, *common))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "processes 1 (DistributedType.DEEPSPEED, cpu), DeepSpeed ZeRO-2 fp32 weights" in result.stdout
    assert (deep / "checkpoints" / f"step_{STEPS:08d}" / "pytorch_model").is_dir()  # DeepSpeed's own checkpoint

    plain = tmp_path / "plain"
    assert subprocess.run([sys.executable, str(repo_root / "train.py"), *smoke_args(repo_root, shards, plain, *common)],
                          cwd=repo_root, env=dict(launch_env(repo_root)), capture_output=True).returncode == 0
    expected, got = load_file(str(plain / "demind.safetensors")), load_file(str(deep / "demind.safetensors"))
    assert got.keys() == expected.keys() and got["gate"].shape == ()
    worst = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    print(f"deepspeed fp32 ZeRO-2 vs plain after {STEPS} steps: max |diff| {worst:.3g}")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **FP32_TOLERANCE, msg=name)

    bf16 = tmp_path / "deepspeed_bf16"
    result = launch(repo_root, smoke_args(repo_root, shards, bf16, *common, "run.mixed_precision=bf16"))
    assert result.returncode == 0 and "DeepSpeed ZeRO-2 bf16 weights" in result.stdout, result.stderr[-3000:]
    rounded = load_file(str(bf16 / "demind.safetensors"))
    assert all(t.dtype == torch.float32 for t in rounded.values())  # the export holds the float32 masters
    diff = sum(float((rounded[k] - expected[k]).pow(2).sum()) for k in expected) ** 0.5
    relative = diff / sum(float(expected[k].pow(2).sum()) for k in expected) ** 0.5
    print(f"deepspeed bf16 ZeRO-2 vs plain fp32 after {STEPS} steps: relative L2 {relative:.3g}")
    assert 0 < relative < BF16_RELATIVE_L2

    resumed = tmp_path / "killed"
    launch_and_kill(repo_root, smoke_args(repo_root, shards, resumed, *common), resumed, step=4)
    assert not (resumed / "demind.safetensors").exists(), "the run finished before it was killed"
    result = launch(repo_root, smoke_args(repo_root, shards, resumed, *common))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from" in result.stderr + result.stdout
    again = load_file(str(resumed / "demind.safetensors"))
    for name in got:  # the same engine, resumed: the same weights as the uninterrupted DeepSpeed run
        torch.testing.assert_close(again[name], got[name], rtol=1e-6, atol=1e-7, msg=name)
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))

    # continuing that run without DeepSpeed: refused in one line, not a failure inside Accelerate's loader
    more = smoke_args(repo_root, shards, resumed, *common, f"optim.max_steps={STEPS + 2}")
    result = subprocess.run([sys.executable, str(repo_root / "train.py"), *more], cwd=repo_root,
                            env=launch_env(repo_root), capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "written under DeepSpeed" in errors[0], result.stderr[-2000:]


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_launch_refuses_a_contradicting_config_in_one_line(repo_root, tmp_path):
    ds_yaml = tmp_path / "zero2_clip.yaml"
    text = (repo_root / DS_YAML).read_text()
    ds_yaml.write_text(text.replace("  zero_stage: 2\n", "  zero_stage: 2\n  gradient_clipping: 1.0\n"))
    result = launch(repo_root, smoke_args(repo_root, tmp_path / "shards", tmp_path / "run", "optim.grad_clip=null"),
                    ds_yaml)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "gradient_clipping: 1.0, but the train config gives 0.0 (optim.grad_clip)" in errors[0]
