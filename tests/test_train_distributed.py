"""Two CPU processes (gloo) with batch b each == one process with batch 2b.

The contrastive losses gather features from every process with gradients, so the
mean of the per-process losses is the single-process loss on the global batch, and
DDP's averaged gradients are that loss's gradients.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toyworld.synthetic import write_synthetic_shards

PER_PROCESS = 4
TERMS = ("loss", "distil", "align")

WORKER = r'''
import json, sys, torch
torch.set_num_threads(1)
from demind.config import load_config
from demind.trainkit import make_gather
from demind.training import TrainConfig, build_modules, compute_losses, setup

overrides, out, per_process = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from test_train_distributed import synthetic_batch

cfg = load_config(TrainConfig, None, overrides)
accelerator = setup(cfg)
assert accelerator.num_processes == 2, accelerator.state
backbone, model = build_modules(cfg, accelerator.device)
model = accelerator.prepare(model)
rank = accelerator.process_index
batch = synthetic_batch(backbone, 2 * per_process, rows=slice(rank * per_process, (rank + 1) * per_process))
losses = compute_losses(model, batch, backbone, gather=make_gather(accelerator))
accelerator.backward(losses["loss"])
mean = accelerator.reduce(torch.stack([losses[t].detach() for t in ("loss", "distil", "align")]), "mean")
grads = {n: p.grad.clone() for n, p in accelerator.unwrap_model(model).named_parameters() if p.grad is not None}
if accelerator.is_main_process:
    torch.save({"losses": mean, "grads": grads}, out)
accelerator.wait_for_everyone()
# as train() does: destroy the process group before exit (a gloo group left to the interpreter's
# teardown can abort the process: "terminate called without an active exception")
accelerator.end_training()
print("worker finished", flush=True)
# Leave without the interpreter's teardown: even after destroy_process_group, gloo's C++ threads can
# still hold tensors whose release during finalisation aborts the process (seen once in CI, exit -6,
# after the results were written). The results are on disk; nothing else needs a clean teardown.
import os
os._exit(0)
'''


def synthetic_batch(backbone, total: int, rows: slice = slice(None)) -> dict:
    """A cache-style batch: fixed random image/teacher embeddings and target texts."""
    g = torch.Generator().manual_seed(123)
    image_emb = torch.randn(total, backbone.embed_dim, generator=g)
    teacher_emb = torch.randn(total, backbone.embed_dim, generator=g)
    words = ["red", "blue", "a dog", "two cats", "on the beach", "at night", "bigger", "without people"]
    targets = [f"make it {words[i % len(words)]} {words[(3 * i + 1) % len(words)]}" for i in range(total)]
    return dict(image_emb=image_emb[rows], teacher_emb=teacher_emb[rows], targets=targets[rows],
                intents=targets[rows])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_overrides(repo_root: Path, run: Path) -> list[str]:
    return [f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", "backbone.pretrained=null",
            "model.num_queries=2", "model.num_blocks=2", "model.num_heads=4", "model.mapping_hidden=64",
            # dropout off: the two runs must draw the same (no) masks
            "model.mapping_dropout=0", "model.gate_init=0.3", "run.device=cpu", "run.trackers=[]",
            f"run.output_dir={run}"]


def test_two_processes_equal_one_process_with_the_global_batch(repo_root, tmp_path):
    overrides = config_overrides(repo_root, tmp_path / "run")
    out = tmp_path / "two_process.pt"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(overrides), str(out), str(PER_PROCESS), str(Path(__file__).parent)],
            cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        output = proc.communicate(timeout=180)[0].decode(errors="replace")
        assert proc.returncode == 0 and "worker finished" in output, output[-4000:]
    distributed = torch.load(out, weights_only=True)

    # The same model and the same 2b samples in one process, no Accelerate, no gather.
    from accelerate.utils import set_seed

    from demind.config import load_config
    from demind.training import TrainConfig, build_modules, compute_losses

    cfg = load_config(TrainConfig, None, overrides)
    set_seed(cfg.run.seed)
    backbone, model = build_modules(cfg, torch.device("cpu"))
    model.train()
    losses = compute_losses(model, synthetic_batch(backbone, 2 * PER_PROCESS), backbone)
    losses["loss"].backward()

    torch.testing.assert_close(distributed["losses"], torch.stack([losses[t].detach() for t in TERMS]),
                               rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == distributed["grads"].keys() and "gate" in grads
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        # float32 sums in another order: compare relative to each tensor's scale
        scale = grad.abs().max().item()
        torch.testing.assert_close(distributed["grads"][name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_epoch_mode_splits_shards_between_processes_and_workers():
    from demind.data import group_shards

    shards = [f"{i:05d}.tar" for i in range(10)]
    for epoch in range(2):
        seen = []
        for rank in range(2):
            for worker in range(2):
                # 10 shards / 4 readers -> 3 or 2 each; one group of 3 per reader per epoch
                seen += group_shards(shards, epoch, seed=0, rank=rank, world_size=2, worker=worker,
                                     num_workers=2, per_group=3, resample=False)
        assert sorted(seen) == shards  # every shard once per epoch, no reader shares one
    first = group_shards(shards, 0, seed=0, rank=0, world_size=2, worker=0, num_workers=2, per_group=3, resample=False)
    second = group_shards(shards, 1, seed=0, rank=0, world_size=2, worker=0, num_workers=2, per_group=3, resample=False)
    assert first != second  # a fresh permutation each epoch


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_end_to_end(repo_root, tmp_path):
    """The real command, on CPU: accelerate launch --multi_gpu --num_processes 2 train.py ... run.device=cpu.

    (``accelerate launch --cpu`` starts several CPU processes only through mpirun; with
    ``--multi_gpu`` it uses torchrun, and run.device=cpu makes Accelerate pick gloo on CPU.)
    """
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=4, samples_per_shard=16)
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root))
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           str(repo_root / "train.py"), "--config", str(repo_root / "configs/train/smoke.yaml"),
           f"data.shards={shards}", f"run.output_dir={run}", "optim.max_steps=4", "run.save_every=2",
           f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", "run.device=cpu"]
    result = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "micro batch 8 x 2 processes" in result.stdout and "contrastive batch 16" in result.stdout
    state = json.loads((run / "checkpoints/step_00000004/trainer_state.json").read_text())
    assert state["num_processes"] == 2 and len(state["positions"]) == 2
    assert (run / "demind.safetensors").is_file()



@pytest.mark.slow
def test_multi_node_config_as_two_machines_on_one_host(repo_root, tmp_path):
    """configs/accelerate/multi_node.yaml as docs/training.md launches it, one command per machine:
    here 2 "machines" x 1 CPU process on this host (gloo), machine 0's address 127.0.0.1."""
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=4, samples_per_shard=16)
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root))
    accelerate = Path(sys.executable).with_name("accelerate")
    port = str(free_port())
    machines = []
    for rank in range(2):
        cmd = [str(accelerate), "launch", "--config_file", str(repo_root / "configs/accelerate/multi_node.yaml"),
               "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
               "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no",
               str(repo_root / "train.py"), "--config", str(repo_root / "configs/train/smoke.yaml"),
               f"data.shards={shards}", f"run.output_dir={run}", "optim.max_steps=2", "run.save_every=2",
               f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", "run.device=cpu"]
        machines.append(subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
    outputs = [m.communicate(timeout=300)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "micro batch 8 x 2 processes" in outputs[0] and "contrastive batch 16" in outputs[0]
    state = json.loads((run / "checkpoints/step_00000002/trainer_state.json").read_text())
    assert state["num_processes"] == 2 and len(state["positions"]) == 2
    assert (run / "demind.safetensors").is_file()


CONESEP_WORKER = r'''
import json, sys, torch
torch.set_num_threads(1)
from demind.config import load_config
from demind.trainkit import make_gather
from demind.training import TrainConfig, build_modules, compute_losses, setup

overrides, per_process = json.loads(sys.argv[1]), int(sys.argv[2])
sys.path.insert(0, sys.argv[3])
from test_train_distributed import synthetic_batch

cfg = load_config(TrainConfig, None, overrides)
accelerator = setup(cfg)
backbone, model = build_modules(cfg, accelerator.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
rank = accelerator.process_index
for step in range(2):  # a second step: DDP checks that every parameter got its gradient in the first
    batch = synthetic_batch(backbone, 2 * per_process, rows=slice(rank * per_process, (rank + 1) * per_process))
    batch["rew_emb"] = batch["teacher_emb"].flip(0)
    batch["target_kinds"] = ["original", "rewritten", "intent", "rewritten"][:per_process]
    losses = compute_losses(model, batch, backbone, gather=make_gather(accelerator), noise=cfg.noise, step=step)
    accelerator.backward(losses["loss"])
    optimizer.step()
    optimizer.zero_grad()
    assert float(losses["ot_masked_mass"]) == 0.0
prompt = accelerator.unwrap_model(model).negative_prompt.detach()
gathered = accelerator.gather(prompt.unsqueeze(0))
assert torch.allclose(gathered[0], gathered[1]), "negative prompts diverged between processes"
print("ok")
'''


@pytest.mark.slow
def test_conesep_trains_in_two_processes_with_the_negative_prompt_in_sync(repo_root, tmp_path):
    """NBL's negative prompt is used outside the model's forward: DDP must still reduce its gradient."""
    overrides = config_overrides(repo_root, tmp_path / "run") + ["noise.mode=conesep", "model.negative_tokens=2"]
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", CONESEP_WORKER, json.dumps(overrides), str(PER_PROCESS), str(Path(__file__).parent)],
            cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        output = proc.communicate(timeout=180)[0].decode(errors="replace")
        assert proc.returncode == 0 and "ok" in output, output[-4000:]
