"""Cross-process gathers of per-row scalars: the few floats a sequence that complete groups straddling processes.

A group whose members sit on several processes is completed by gathering each row's (row id, group id, s̄, Â, U, c)
from every process (docs/source/concepts/layouts.md): 6 floats a row, never a token tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..objectives.step import GatheredGroups, RowScalars
from .ids import group_index, positions_of

__all__ = ["GatheredRows", "gather_groups", "gather_row_scalars", "gather_rows"]


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


def gather_groups(
    accelerator: Any, row_ids: Tensor, group_ids: Tensor, rows: RowScalars, advantages: Tensor, group_size: int,
    equal_rows: bool = False,
) -> GatheredGroups:
    """Complete groups straddling processes: every process's (row id, group id, s̄, Â, U, c), grouped.

    Args:
        row_ids, group_ids: (B,) global ids of this process's rows. rows: their s̄, U and c. advantages: Â (B,).
        group_size: G. equal_rows: groups whole across processes by construction (the redistributed layout), so
            one plain all-gather, no group check and no host read.

    Returns:
        :class:`~dfpo_trl.objectives.step.GatheredGroups`, the same on every process but for ``position``.
    """
    gathered = gather_row_scalars(accelerator, row_ids, group_ids, rows.s_bar, advantages, rows.survives,
                                  rows.factor, equal_rows)
    index = group_index(gathered.group_ids, group_size, validate=not equal_rows)
    return GatheredGroups(gathered.row_ids, gathered.s_bar, gathered.advantages, gathered.survives, gathered.factor,
                          index, positions_of(row_ids, gathered.row_ids))
