"""Cross-process gathers of per-row scalars: the few floats a sequence that complete groups straddling processes.

A group whose members sit on several processes is completed by gathering each row's (row id, group id, s̄, Â, U, c)
from every process (docs/layouts.md): 6 floats a row, never a token tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["GatheredRows", "gather_row_scalars", "gather_rows"]


def gather_rows(accelerator: Any, values: Tensor) -> Tensor:
    """All-gather (n_p, k) float64 rows from every process, n_p may differ: a few floats per sequence."""
    if accelerator.num_processes == 1:
        return values
    count = torch.tensor([values.size(0)], device=values.device)
    counts = accelerator.gather(count)
    padded = accelerator.pad_across_processes(values, dim=0)
    gathered = accelerator.gather(padded).view(accelerator.num_processes, -1, values.size(1))
    return torch.cat([gathered[p, : int(n)] for p, n in enumerate(counts.tolist())])


class GatheredRows(NamedTuple):
    """Every process's rows, in the same order on every process: ids, s̄ (eq. 47), Â, U (eq. C2), c (eq. C3)."""

    row_ids: Tensor
    group_ids: Tensor
    s_bar: Tensor
    advantages: Tensor
    survives: Tensor
    factor: Tensor


def gather_row_scalars(
    accelerator: Any, row_ids: Tensor, group_ids: Tensor, s_bar: Tensor, advantages: Tensor, survives: Tensor,
    factor: Tensor, equal_rows: bool = False,
) -> GatheredRows:
    """(row id, group id, s̄, Â, U, c) of every row of every process, packed in one float64 tensor for one gather.
    ``equal_rows``: every process holds the same number of rows (the redistributed layout): one plain all-gather,
    no size exchange, so no host read."""
    packed = torch.stack(
        [row_ids.double(), group_ids.double(), s_bar.double(), advantages.double(), survives.double(),
         factor.double()], 1,
    )
    if equal_rows and accelerator.num_processes > 1:
        gathered = accelerator.gather(packed)
    else:
        gathered = gather_rows(accelerator, packed)
    return GatheredRows(
        gathered[:, 0].to(torch.int64), gathered[:, 1].to(torch.int64), gathered[:, 2].float(),
        gathered[:, 3].float(), gathered[:, 4] > 0.5, gathered[:, 5],
    )
