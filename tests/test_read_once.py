"""Start-up work done once: a checkpoint's header is parsed once per load, and training derives its
micro batch once and passes it on (DeepSpeed's config, the data stream, the start-up lines)."""

from __future__ import annotations

import pytest
import torch

import demind.checkpoint as checkpoint
import demind.tensor_files as tensor_files
from demind.checkpoint import load_backbone_and_model, save_checkpoint
from demind.model import DeMinds
from demind.schema import ModelConfig


def test_a_checkpoint_header_is_read_once_per_load(tmp_path, tiny_backbone, monkeypatch):
    torch.manual_seed(0)
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, mapping_hidden=16), tiny_backbone)
    path = save_checkpoint(tmp_path / "demind.safetensors", model)
    calls = []
    real = tensor_files.read_format_metadata

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "read_format_metadata", counting)
    backbone, loaded = load_backbone_and_model(path)  # the backbone rebuilt from the checkpoint's record
    assert len(calls) == 1
    assert backbone.identity == tiny_backbone.identity
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    calls.clear()
    load_backbone_and_model(path, tiny_backbone)  # a loaded backbone given: still one header read
    assert len(calls) == 1


@pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
def test_training_derives_its_micro_batch_once(repo_root, tmp_path, monkeypatch):
    from demind.cli import train
    from toyworld.synthetic import write_synthetic_shards
    import demind.training.accel as accel
    import demind.training.loop as loop

    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=8)
    calls = []
    real = accel.micro_batch_size

    def counting(optim, processes):
        calls.append(processes)
        return real(optim, processes)

    for module in (accel, loop):  # build_data takes the micro batch; it derives none of its own
        monkeypatch.setattr(module, "micro_batch_size", counting)
    run = tmp_path / "run"
    assert train.main(["--config", str(repo_root / "configs/train/smoke.yaml"), f"data.shards={shards}",
                       f"run.output_dir={run}", f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}",
                       "optim.max_steps=1"]) == 0
    assert calls == [1]
    assert (run / "demind.safetensors").is_file()
