"""The non-finite check every trainer runs on its loss terms before an update.

One NaN step would poison the weights and every step after it, so a trainer stops at the first
non-finite loss term with an error naming the term(s), their values and the step.
"""

from __future__ import annotations

import torch

from demind.errors import NonFiniteError

DEFAULT_HINT = "lower the learning rate or check the data; rerunning resumes from the last saved state"


class NonFiniteLossError(NonFiniteError):
    """A loss term became NaN or infinite; the run stops instead of training on garbage."""


def finite_flags(terms: dict[str, torch.Tensor]) -> torch.Tensor:
    """(len(terms),) float tensor on the terms' device: 1.0 where the scalar term is finite, else 0.0.

    Kept on the device (no host sync) so a multi-process trainer can reduce it before deciding."""
    return torch.stack([torch.isfinite(v.detach()).all().float() for v in terms.values()])


def raise_non_finite(terms: dict[str, torch.Tensor], flags: torch.Tensor, step: int, *, where: str = "",
                     hint: str = DEFAULT_HINT) -> None:
    """Raise :class:`NonFiniteLossError` naming every term whose flag is below 1 (any process saw it
    non-finite), with its value here and the step; do nothing when all are finite."""
    bad = [name for name, ok in zip(terms, flags.tolist()) if ok < 1.0]
    if not bad:
        return
    values = ", ".join(f"{name}={float(terms[name].detach().float().mean())}" for name in bad)
    plural = "s" if len(bad) > 1 else ""
    raise NonFiniteLossError(f"{where + ': ' if where else ''}non-finite loss at step {step}: {values} "
                             f"(term{plural} {', '.join(bad)}); {hint}")


def check_finite_terms(terms: dict[str, torch.Tensor], step: int, *, where: str = "",
                       hint: str = DEFAULT_HINT) -> None:
    """Raise :class:`NonFiniteLossError` when any scalar of ``terms`` (name -> loss term) is NaN or
    infinite, naming the term(s), their values and ``step``; ``where`` prefixes the message
    (e.g. ``"exclmm sae"``), ``hint`` says what to do."""
    if terms:
        raise_non_finite(terms, finite_flags(terms), step, where=where, hint=hint)
