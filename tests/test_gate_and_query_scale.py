"""The gate's own learning rate (``optim.gate_lr``) and the query scale (``model.query_scale``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from demind.config import ConfigError
from demind.losses import demind_losses
from demind.model import DeMinds
from demind.schema import ModelConfig
from demind.training import OptimConfig, load_train_config, lr_factor
from demind.training.optim import build_optimizer, build_scheduler, gate_lr


def _model(backbone, **cfg) -> DeMinds:
    torch.manual_seed(0)
    return DeMinds(ModelConfig(mapping_hidden=64, **cfg), backbone)


def _loss(model: DeMinds, backbone) -> torch.Tensor:
    """The training loss (distillation + alignment) on a random batch of four."""
    torch.manual_seed(1)
    image = backbone.encode_image(torch.randn(4, 3, 32, 32))
    out = model(image, ["make it red", "a cat on a bed", "without the dog", "two blue cars"])
    teacher = backbone.encode_text(["a red one", "a cat", "no dog", "blue cars"]).pooled
    return demind_losses(out, teacher, image, model.temperature_scale())["loss"]


def test_gate_lr_is_the_lr_adam_applies_to_the_gate_alone(tiny_backbone):
    model = _model(tiny_backbone)
    optim = OptimConfig(lr=1e-3, gate_lr=2e-2, warmup_steps=2, max_steps=10, weight_decay=0.1)
    optimizer = build_optimizer(optim, model)
    scheduler = build_scheduler(optim, optimizer)
    # first step: warm-up factor 1/2 on both lrs
    assert gate_lr(optimizer, model.gate, optim) == pytest.approx(2e-2 * lr_factor(0, optim))
    others = [g["lr"] for g in optimizer.param_groups if not any(p is model.gate for p in g["params"])]
    assert others and all(lr == pytest.approx(1e-3 * lr_factor(0, optim)) for lr in others)
    alpha = model.gate.detach().clone()
    _loss(model, tiny_backbone).backward()
    grad = float(model.gate.grad)
    assert abs(grad) > 1e-3  # the training loss reaches alpha
    optimizer.step()
    scheduler.step()
    # Adam's first step moves a scalar by lr * g / (|g| + eps): the configured lr, against the gradient
    moved = float(model.gate.detach() - alpha)
    assert moved == pytest.approx(-2e-2 * lr_factor(0, optim) * grad / (abs(grad) + optim.eps), rel=1e-4)
    assert gate_lr(optimizer, model.gate, optim) == pytest.approx(2e-2 * lr_factor(1, optim))
    # DeepSpeed's groups hold its own flat partitions, not the gate: found by the group's lr_scale
    stand_in = torch.nn.Parameter(model.gate.detach().clone())
    assert gate_lr(optimizer, stand_in, optim) == pytest.approx(2e-2 * lr_factor(1, optim))


def test_without_gate_lr_the_gate_follows_lr(tiny_backbone):
    model = _model(tiny_backbone)
    optim = OptimConfig(lr=3e-4)
    optimizer = build_optimizer(optim, model)
    assert gate_lr(optimizer, model.gate, optim) == pytest.approx(3e-4)
    assert len({g["lr"] for g in optimizer.param_groups}) == 1


def test_gate_lr_without_a_gate_is_refused_naming_the_key(repo_root):
    with pytest.raises(ConfigError, match=r"optim\.gate_lr.*model\.fusion=add"):
        load_train_config(repo_root / "configs/train/smoke.yaml", ["optim.gate_lr=1e-3", "model.fusion=add"])


@pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
def test_training_logs_the_gate_lr_and_gradient(repo_root, tmp_path):
    from toyworld.synthetic import write_synthetic_shards
    from demind.training import train

    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=1, samples_per_shard=16)
    cfg = load_train_config(repo_root / "configs/train/smoke.yaml", [
        f"data.shards={shards}", f"run.output_dir={tmp_path / 'run'}", "optim.max_steps=2", "run.log_every=1",
        f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", "optim.lr=1e-4", "optim.gate_lr=5e-3"])
    train(cfg)
    lines = [json.loads(line) for line in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        # after step s the scheduler holds lr_factor(s): both lrs follow it, the gate's from 5e-3
        assert m["lr"] == pytest.approx(1e-4 * lr_factor(m["step"], cfg.optim))
        assert m["gate_lr"] == pytest.approx(5e-3 * lr_factor(m["step"], cfg.optim))
        assert m["gate_grad"] > 0


def test_query_scale_puts_every_refined_query_at_the_token_embedding_norm(tiny_backbone):
    model = _model(tiny_backbone, query_scale="token_norm")
    table = tiny_backbone.model.token_embedding.weight.detach().float()
    assert model.token_norm == pytest.approx(float(table.norm(dim=-1).mean()))
    words, mask = torch.randn(3, 5, tiny_backbone.width), torch.ones(3, 5, dtype=torch.bool)
    raw = model.intention(words, mask)
    scaled = model.scale_queries(raw)
    assert torch.allclose(scaled.norm(dim=-1), torch.full((3, model.cfg.num_queries), model.token_norm), rtol=1e-5)
    # the direction is kept; only the length changes (here from the blocks' scale)
    assert torch.allclose(torch.nn.functional.normalize(scaled, dim=-1), torch.nn.functional.normalize(raw, dim=-1),
                          atol=1e-6)
    assert not torch.allclose(raw.norm(dim=-1), scaled.norm(dim=-1), rtol=1e-2)
    # and t* changes with it
    t_scaled = model.intention_embedding(words, mask)
    model.cfg.query_scale = "none"
    assert not torch.allclose(t_scaled, model.intention_embedding(words, mask), atol=1e-4)


def test_query_scale_off_is_bit_identical_to_the_unscaled_path(tiny_backbone):
    model = _model(tiny_backbone)
    assert model.cfg.query_scale == "none"
    words, mask = torch.randn(2, 6, tiny_backbone.width), torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    expected = tiny_backbone.encode_template_with_pseudo_tokens(model.intent_prompt, model.intention(words, mask))
    assert torch.equal(model.intention_embedding(words, mask), torch.nn.functional.normalize(expected.pooled, dim=-1))
    # and the state dict holds no new tensor: checkpoints of either setting have the same keys
    assert model.state_dict().keys() == _model(tiny_backbone, query_scale="token_norm").state_dict().keys()
