"""Contrastive losses against hand-computed values."""

from __future__ import annotations

import math

import torch

from demind.losses import demind_losses, symmetric_info_nce
from demind.model import ComposeOutput


def test_symmetric_info_nce_matches_hand_computation():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    # logits a@b.T (scale 1) = [[0.6, 0.0], [0.8, 1.0]]; b@a.T is its transpose.
    row = lambda logits, i: -logits[i] + math.log(sum(math.exp(x) for x in logits))  # noqa: E731
    ab = [[0.6, 0.0], [0.8, 1.0]]
    ba = [[0.6, 0.8], [0.0, 1.0]]
    expected = 0.5 * ((row(ab[0], 0) + row(ab[1], 1)) / 2 + (row(ba[0], 0) + row(ba[1], 1)) / 2)
    assert math.isclose(float(symmetric_info_nce(a, b, 1.0)), expected, rel_tol=1e-6)


def test_loss_is_lowest_when_pairs_match():
    torch.manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    matched = symmetric_info_nce(a, a, 10.0)
    shuffled = symmetric_info_nce(a, a[torch.randperm(8)], 10.0)
    assert matched < shuffled
    assert matched < 0.1


def test_rows_of_a_global_batch_average_to_the_full_loss():
    torch.manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(6, 4), dim=-1)
    b = torch.nn.functional.normalize(torch.randn(6, 4), dim=-1)
    full = symmetric_info_nce(a, b, 5.0)
    halves = [symmetric_info_nce(a[i : i + 3], b[i : i + 3], 5.0, a, b, offset=i) for i in (0, 3)]
    assert torch.allclose(full, sum(halves) / 2, atol=1e-6)


def test_demind_losses_terms_and_distillation_switch():
    torch.manual_seed(0)
    emb = lambda: torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)  # noqa: E731
    out = ComposeOutput(emb(), emb(), emb())
    teacher, image = torch.randn(4, 8), torch.randn(4, 8)
    terms = demind_losses(out, teacher, image, torch.tensor(20.0))
    assert torch.allclose(terms["distil"], symmetric_info_nce(out.t_star, teacher / teacher.norm(dim=-1, keepdim=True), 20.0))
    assert torch.allclose(terms["align"], symmetric_info_nce(out.t_hat, image / image.norm(dim=-1, keepdim=True), 20.0))
    assert torch.allclose(terms["loss"], terms["distil"] + terms["align"])
    no_distil = demind_losses(out, teacher, image, torch.tensor(20.0), distil=False)
    assert torch.allclose(no_distil["loss"], no_distil["align"])
