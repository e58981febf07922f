"""Each process's share of a global batch when several processes train (``accelerate launch``):
which rows it composes, the gather of every process's queries with gradients, a sum over processes
and the main process's value of a tensor (:class:`ProcessShare`; :data:`ONE_PROCESS` alone)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from demind.losses import Gather
from demind.trainkit.accelerator import make_gather


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class ProcessShare:
    """This process's part of the work when several processes train (``accelerate launch``).

    rows: the rows of each global batch this process composes (with gradients); gather: the
    queries of every process, with gradients (:func:`demind.trainkit.make_gather`; None in one
    process); total: sums a tensor over processes (each holds its rows, zeros elsewhere); agree:
    the main process's value of a tensor in every process. The defaults are one process."""

    index: int = 0
    count: int = 1
    gather: Gather | None = None
    total: Callable[[torch.Tensor], torch.Tensor] = _same
    agree: Callable[[torch.Tensor], torch.Tensor] = _same

    def rows(self, batch_size: int) -> slice:
        """This process's slice of a global batch of ``batch_size`` (a multiple of ``count``)."""
        per = batch_size // self.count
        return slice(self.index * per, (self.index + 1) * per)

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) every process's rows of ``x`` (this process's share of the batch), with gradients."""
        return x if self.gather is None else self.gather(x)[0]


ONE_PROCESS = ProcessShare()


def process_share(accelerator) -> ProcessShare:
    """This process's :class:`ProcessShare` (the one-process default alone)."""
    if accelerator.num_processes == 1:
        return ONE_PROCESS
    from accelerate.utils import broadcast

    def total(x: torch.Tensor) -> torch.Tensor:
        return accelerator.reduce(x.to(accelerator.device), reduction="sum").to(x.device)

    def agree(x: torch.Tensor) -> torch.Tensor:
        return broadcast(x.contiguous(), from_process=0)

    return ProcessShare(accelerator.process_index, accelerator.num_processes, make_gather(accelerator), total, agree)
