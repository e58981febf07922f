"""The shared training engine (demind/training: optim, finite, store, metrics_log): optimizer groups,
schedule values by hand, state round trip and exact continuation, damaged state files, the
non-finite check, the log line; and ExclMM's refusal of the pickle files of earlier versions."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from demind.errors import DemindError, NonFiniteError
from demind.trainkit.finite import NonFiniteLossError, check_finite_terms
from demind.trainkit.metrics_log import LogWindow, step_line, term_parts
from demind.trainkit.optim import build_adamw, build_lr_scheduler, parameter_groups, warmup_cosine
from demind.trainkit.state_file import (StateFileError, load_train_state, load_tree, read_train_state_extra,
                                   restore_train_state, save_train_state, save_tree)


class Toy(torch.nn.Module):
    """Every kind of parameter the no-decay rule sorts: matrices, biases, gains, an embedding
    table, a gate and a temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = torch.nn.Embedding(5, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 2)
        self.gate = torch.nn.Parameter(torch.tensor(0.1))
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) token ids -> (B, 2) scores."""
        x = self.norm(self.proj(self.token_embedding(tokens).mean(1)))
        return self.head(torch.tanh(self.gate) * x) * self.logit_scale.exp()


def names_of(groups: list[dict], model: torch.nn.Module) -> list[set[str]]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return [{ids[id(p)] for p in g["params"]} for g in groups]


def test_no_decay_on_gains_biases_embeddings_gate_and_temperature():
    model = Toy()
    groups = parameter_groups(model.named_parameters(), weight_decay=0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert names_of(groups, model) == [
        {"proj.weight", "head.weight"},
        {"token_embedding.weight", "proj.bias", "norm.weight", "norm.bias", "head.bias", "gate", "logit_scale"}]
    model.head.requires_grad_(False)  # frozen parameters are left out
    assert "head.weight" not in set.union(*names_of(parameter_groups(model.named_parameters(), 0.1), model))


def test_lr_multiplier_groups_and_a_subset_of_named_parameters():
    model = Toy()
    optimizer = build_adamw(model.named_parameters(), 1e-3, weight_decay=0.1, lr_scales={"head.": 10.0})
    got = [(g["lr"], g["weight_decay"], names) for g, names in
           zip(optimizer.param_groups, names_of(optimizer.param_groups, model))]
    assert got == [(1e-3, 0.1, {"proj.weight"}),
                   (1e-3, 0.0, {"token_embedding.weight", "proj.bias", "norm.weight", "norm.bias", "gate",
                                "logit_scale"}),
                   (pytest.approx(1e-2), 0.1, {"head.weight"}), (pytest.approx(1e-2), 0.0, {"head.bias"})]
    # the scheduler scales every group's own lr: the multiplier holds through the schedule
    scheduler = build_lr_scheduler(optimizer, warmup_steps=2, total_steps=10)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4, 5e-4, 5e-3, 5e-3])
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3, 1e-3, 1e-2, 1e-2])
    # a stage over a subset (the toy CLIP's locked image tower): only those parameters
    subset = build_adamw(model.head.named_parameters(prefix="head"), 1e-3, weight_decay=0.1)
    assert names_of(subset.param_groups, model) == [{"head.weight"}, {"head.bias"}]


def test_schedule_values_by_hand():
    # warm-up 4 steps: 1/4, 2/4, 3/4, 4/4; then cosine over the 8 steps to 12
    assert [warmup_cosine(s, 4, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine(4, 4, 12) == 1.0
    assert warmup_cosine(6, 4, 12) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # 0.853553
    assert warmup_cosine(8, 4, 12) == pytest.approx(0.5)
    assert warmup_cosine(12, 4, 12) == pytest.approx(0.0, abs=1e-12)
    assert warmup_cosine(20, 4, 12) == pytest.approx(0.0, abs=1e-12)  # stays at the floor after the end
    # floor 0.1: 0.1 + 0.9 * 0.5 at the middle
    assert warmup_cosine(8, 4, 12, min_lr_ratio=0.1) == pytest.approx(0.55)
    assert [warmup_cosine(s, 0, 12, "constant") for s in (0, 5, 50)] == [1.0, 1.0, 1.0]
    assert [warmup_cosine(s, 2, 12, "constant") for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    with pytest.raises(DemindError, match="'cosine' or 'constant'"):
        warmup_cosine(5, 2, 12, "linear")


def train_steps(model, optimizer, scheduler, steps: range) -> list[float]:
    """Steps on batches drawn from the global RNGs (so a resume must restore them to continue exactly)."""
    losses = []
    for _ in steps:
        tokens = torch.randint(0, 5, (8, 3))
        noise = random.random() + float(np.random.rand())
        loss = model(tokens).square().mean() + noise
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = Toy()
    optimizer = build_adamw(model.named_parameters(), 1e-2, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6)
    return model, optimizer, build_lr_scheduler(optimizer, 3, 12)


def test_state_round_trip_and_exact_continuation(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    model, optimizer, scheduler = build()
    whole = train_steps(model, optimizer, scheduler, range(12))
    final = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    model, optimizer, scheduler = build()
    first = train_steps(model, optimizer, scheduler, range(5))
    sampler = random.Random(7)  # a trainer's own sampler: its state goes in ``extra``
    sampler.random()
    path = save_train_state(tmp_path / "state.safetensors", step=5, modules={"model": model}, optimizer=optimizer,
                            scheduler=scheduler, extra={"phase": "b", "sampler": sampler.getstate()})
    assert read_train_state_extra(path) == {"step": 5, "phase": "b", "sampler": sampler.getstate()}
    expected_optimizer, expected_scheduler = optimizer.state_dict(), scheduler.state_dict()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # the global RNGs move on; the state restores them

    model, optimizer, scheduler = build(seed=3)  # other initial weights: all overwritten
    state = load_train_state(path)
    assert restore_train_state(state, modules={"model": model}, optimizer=optimizer, scheduler=scheduler) == 5
    assert all(torch.equal(v, first_v) for v, first_v in zip(model.state_dict().values(),
                                                               state["modules"]["model"].values()))
    got = optimizer.state_dict()
    assert got["param_groups"] == expected_optimizer["param_groups"]
    for i, moments in expected_optimizer["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in moments.items())
    assert scheduler.state_dict() == expected_scheduler
    restored = random.Random()
    restored.setstate(state["extra"]["sampler"])
    assert restored.random() == sampler.random()
    rest = train_steps(model, optimizer, scheduler, range(5, 12))
    assert first + rest == whole
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())


def test_damaged_state_file_is_one_error_naming_the_file(tmp_path):
    model, optimizer, scheduler = build()
    path = save_train_state(tmp_path / "state.safetensors", step=1, modules={"model": model}, optimizer=optimizer)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 40])
    with pytest.raises(StateFileError, match=r"truncated\.safetensors is truncated or corrupted .*delete it"):
        load_train_state(truncated)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(StateFileError, match=r"empty\.safetensors is truncated or corrupted"):
        load_train_state(tmp_path / "empty.safetensors")
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF  # a byte of a tensor: safetensors cannot notice, the checksum does
    (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(StateFileError, match=r"flipped\.safetensors is corrupted \(the sha256"):
        load_train_state(tmp_path / "flipped.safetensors")
    save_tree(tmp_path / "other.safetensors", {"x": torch.zeros(2)})  # not a training state
    with pytest.raises(StateFileError, match=r"other\.safetensors is not a demind-train-state/1 file"):
        load_train_state(tmp_path / "other.safetensors")
    assert issubclass(StateFileError, DemindError)


def test_tree_keeps_types_without_pickle(tmp_path):
    tree = {"ints": {3: torch.arange(3), 10: None}, "pair": (1, "a", 2.5), "nested": [[1, 2], []],
            "array": np.arange(4, dtype=np.uint32), "nan": float("nan"), "empty": torch.zeros(0, 2)}
    back = load_tree(save_tree(tmp_path / "t.safetensors", tree))
    assert list(back["ints"]) == [3, 10] and torch.equal(back["ints"][3], torch.arange(3))
    assert back["pair"] == (1, "a", 2.5) and back["nested"] == [[1, 2], []]
    assert back["array"].dtype == np.uint32 and back["array"].tolist() == [0, 1, 2, 3]
    assert math.isnan(back["nan"]) and back["empty"].shape == (0, 2)
    with pytest.raises(TypeError, match="cannot store object at /x"):
        save_tree(tmp_path / "bad.safetensors", {"x": object()})


def test_non_finite_check_names_the_term_and_step():
    terms = {"loss": torch.tensor(float("nan")), "rec": torch.tensor(0.5), "asl": torch.tensor(float("inf"))}
    with pytest.raises(NonFiniteLossError, match=r"^exclmm sae: non-finite loss at step 12: loss=nan, asl=inf "
                                                 r"\(terms loss, asl\); lower sae.lr"):
        check_finite_terms(terms, 12, where="exclmm sae", hint="lower sae.lr")
    assert issubclass(NonFiniteLossError, NonFiniteError) and issubclass(NonFiniteLossError, DemindError)
    check_finite_terms({"loss": torch.tensor(1.0)}, 0)


def test_log_window_and_line():
    window = LogWindow(sums={}, names=("loss", "rec"))
    for value in (1.0, 3.0):
        window.add({"loss": torch.tensor(value), "rec": torch.tensor(value / 2), "other": torch.tensor(9.0)})
    assert window.terms() == ["loss", "rec"]
    means = dict(zip(window.terms(), window.means(torch.device("cpu")).tolist()))
    assert means == {"loss": 2.0, "rec": 1.0}
    again = LogWindow.restore(window.snapshot(), sums={}, names=("loss", "rec"))
    assert again.means(torch.device("cpu")).tolist() == [2.0, 1.0]
    assert step_line(4, 10, term_parts(means, ("loss", "rec")) + ["12 rows/s"], prefix="exclmm sae ") == \
        "exclmm sae step 4/10 | loss 2.0000 | rec 1.0000 | 12 rows/s"


def test_exclmm_refuses_a_run_folder_with_old_pickles(tmp_path):
    from demind.exclmm.run_upgrade import LegacyStateError
    from demind.exclmm.train import train_exclmm
    from demind.exclmm.config import ExclMMConfig

    run = tmp_path / "run"
    run.mkdir()
    (run / "state.pt").write_bytes(b"old pickle")
    cfg = ExclMMConfig()
    cfg.run.output_dir = str(run)
    with pytest.raises(LegacyStateError, match=r"state\.pt: pickle file\(s\) of an earlier demind version, no longer "
                                               r"read; delete state\.pt and rerun the same command"):
        train_exclmm(cfg)
    (run / "state.pt").unlink()
    (run / "features.pt").write_bytes(b"old pickle")  # the feature cache alone: refused the same way
    with pytest.raises(LegacyStateError, match=r"delete features\.pt and rerun .* recomputed into features\.safetensors"):
        train_exclmm(cfg)
    assert issubclass(LegacyStateError, DemindError)
