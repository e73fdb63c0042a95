"""Group layout: explicit group ids, the (num_groups, G) view the transforms need, group-granular batches.

A DFPO transform needs every member's post-clip weight at the same parameters (docs/layouts.md). Groups are
carried as an explicit int64 id per row (``inputs["group_ids"]``), never inferred from "every G rows",
so that shuffling, splitting and gathering can never silently mix members of different prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

GROUP_IDS_KEY = "group_ids"
# Global row index in the generation batch: lets gathered per-sequence scalars find their rows again.
ROW_IDS_KEY = "row_ids"
# Whether a buffered training micro-batch holds whole groups: looked up once per rollout, so that the loss path
# never has to ask the device (a host sync per micro-step).
WHOLE_GROUPS_KEY = "dfpo_whole_groups"


def consecutive_group_ids(
    batch_size: int, num_generations: int, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Ids for rows laid out as TRL's ``RepeatSampler`` lays them: ``num_generations`` consecutive rows a prompt.

    ``offset`` is the row's position in the *global* generation batch of the first local row, so ids agree
    across processes (TRL slices the global batch per process with ``process_index * local_batch``).
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
    rows = torch.arange(offset, offset + batch_size, device=device, dtype=torch.int64)
    return torch.div(rows, num_generations, rounding_mode="floor")


def group_index(group_ids: torch.Tensor, group_size: int, validate: bool = True) -> torch.Tensor:
    """Row indices arranged as (num_groups, group_size), one row per group, groups in ascending id order.

    Raises a ``ValueError`` that names the layout problem when a group does not have exactly ``group_size``
    members in ``group_ids`` (a group cut apart by a per-sample shuffle or a split). ``validate=False`` skips
    that check (it reads the device: a host sync) for ids already checked, e.g. once per rollout.
    """
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D (one id per row), got shape {tuple(group_ids.shape)}.")
    n = group_ids.numel()
    if n % group_size != 0:
        raise ValueError(
            f"The batch has {n} rows, which is not a whole number of groups of num_generations={group_size}: "
            "a group is cut apart. Make per_device_train_batch_size a multiple of num_generations."
        )
    order = torch.argsort(group_ids, stable=True)
    index = order.view(n // group_size, group_size)
    if not validate:
        return index
    sorted_ids = group_ids[index]
    if not bool((sorted_ids == sorted_ids[:, :1]).all()):
        _, counts = torch.unique(group_ids, return_counts=True)
        bad = counts[counts != group_size]
        raise ValueError(
            f"Every group must have exactly num_generations={group_size} rows in the batch, but group sizes "
            f"{sorted(set(bad.tolist()))} occur: a group is cut apart. Make per_device_train_batch_size a "
            "multiple of num_generations, or keep group_ids consistent with the batch."
        )
    return index


def holds_whole_groups(group_ids: torch.Tensor, group_size: int) -> bool:
    """Whether every group present in ``group_ids`` has exactly ``group_size`` rows."""
    if group_ids.numel() == 0 or group_ids.numel() % group_size != 0:
        return False
    _, counts = torch.unique(group_ids, return_counts=True)
    return bool((counts == group_size).all())


def positions_of(row_ids: torch.Tensor, all_row_ids: torch.Tensor) -> torch.Tensor:
    """Where each of ``row_ids`` sits in ``all_row_ids`` (unique ids, any order, every ``row_ids`` present): the
    index that takes per-row values gathered from all processes back to a micro-batch's rows."""
    order = torch.argsort(all_row_ids)
    return order[torch.searchsorted(all_row_ids[order], row_ids.to(all_row_ids.device))]


def scatter_from_groups(grouped: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Inverse of ``x[index]``: put (num_groups, G, ...) values back into row order (B, ...)."""
    flat_index = index.reshape(-1)
    out = torch.empty((flat_index.numel(), *grouped.shape[2:]), dtype=grouped.dtype, device=grouped.device)
    out[flat_index] = grouped.reshape(flat_index.numel(), *grouped.shape[2:])
    return out


def group_granular_order(group_ids: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A row order that shuffles whole groups and keeps each group's rows together.

    Replaces TRL's per-sample shuffle so that splitting the generation batch into equal micro-batches of a
    multiple of G rows keeps every group whole (the group-granular layout of docs/layouts.md).
    """
    unique_ids, inverse = torch.unique(group_ids.cpu(), return_inverse=True)
    perm = torch.randperm(unique_ids.numel(), generator=generator)
    rank_of_group = torch.empty_like(perm)
    rank_of_group[perm] = torch.arange(perm.numel())
    key = rank_of_group[inverse] * (group_ids.numel() + 1) + torch.arange(group_ids.numel())
    return torch.argsort(key).to(group_ids.device)


def rollout_generator(
    seed: int, process_index: int, step: int, stream: int = 0, device: torch.device | str | None = None
) -> torch.Generator:
    """A generator for one rollout's random draws, seeded from (seed, process, optimizer step, stream) alone:
    DFPO's draws never touch torch's global RNG (so TRL's stream is unchanged), and it holds no state a
    checkpoint would have to save (a run resumed at a generation boundary draws the same numbers)."""
    generator = torch.Generator(device=device if device is not None else "cpu")
    generator.manual_seed(int(seed) + 7919 * int(process_index) + 104729 * int(step) + 1_000_003 * int(stream))
    return generator


def is_batch_scalar(value: Any) -> bool:
    """Whether a batch-dict entry is shared by all rows (``None``, a flag, a 0-dim tensor such as
    ``num_items_in_batch``) rather than one entry per row: regrouping, splitting and moving rows leave it as is."""
    return value is None or isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def concat_sequence_dicts(chunks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Join micro-batch dicts (as TRL's ``split_tensor_dict`` makes them) back into one batch dict.

    Tensors with a batch dimension are concatenated, lists joined, 0-dim tensors (``num_items_in_batch``),
    flags and ``None`` taken from the first chunk.
    """
    out: dict[str, Any] = {}
    for key, first in chunks[0].items():
        if is_batch_scalar(first):
            out[key] = first
        elif isinstance(first, torch.Tensor):
            out[key] = torch.cat([chunk[key] for chunk in chunks], dim=0)
        elif isinstance(first, list):
            out[key] = [item for chunk in chunks for item in chunk[key]]
        else:
            raise TypeError(f"Cannot regroup batch entry {key!r} of type {type(first).__name__}.")
    return out


def permute_sequence_dict(batch: dict[str, Any], order: torch.Tensor) -> dict[str, Any]:
    """Reorder every per-row entry of a batch dict by ``order``; 0-dim tensors and ``None`` stay as they are."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if is_batch_scalar(value):
            out[key] = value
        elif isinstance(value, torch.Tensor):
            out[key] = value[order.to(value.device)]
        else:
            out[key] = [value[i] for i in order.tolist()]
    return out


def redistribution_plan(
    row_ids: torch.Tensor,
    group_ids: torch.Tensor,
    group_size: int,
    per_device: int,
    num_processes: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every row of a generation batch goes so that each micro-step holds whole groups *across* processes
    (the ``redistributed`` layout, docs/layouts.md).

    ``row_ids`` and ``group_ids`` list every row of the global generation batch (any order, row ids unique).
    Groups are put in a random order (``generator``: the same draw on every process) and laid out group by group,
    members in row-id order; the k-th row of that sequence goes to micro-step ``k // (per_device·P)``, process
    ``(k mod per_device·P) // per_device``. So a micro-step's ``per_device·P`` rows across the P processes are
    exactly ``per_device·P / G`` whole groups; with ``per_device = 1`` and ``G = P``, micro-step k on process p
    holds member p of group k. Returns, aligned with the inputs, the destination process and the row's index in
    that process's local batch (micro-step · per_device + position), both int64 on the CPU.

    Raises a ``ValueError`` naming the fix when a group does not have exactly ``group_size`` rows or
    ``per_device · P`` is not a multiple of ``group_size``.
    """
    rows_per_step = per_device * num_processes
    if rows_per_step % group_size:
        raise ValueError(
            f"The redistributed layout needs per_device_train_batch_size × num_processes = {per_device} × "
            f"{num_processes} = {rows_per_step} to be a multiple of num_generations={group_size}, so that every "
            "micro-step holds whole groups across processes; change the per-device batch or the process count."
        )
    row_ids, group_ids = row_ids.cpu().to(torch.int64), group_ids.cpu().to(torch.int64)
    n = row_ids.numel()
    if n % rows_per_step:
        raise ValueError(
            f"The generation batch has {n} rows, not a whole number of micro-steps of {rows_per_step} rows."
        )
    unique_groups, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts != group_size).any()):
        raise ValueError(
            f"Every group must have exactly num_generations={group_size} rows in the generation batch, but group "
            f"sizes {sorted(set(counts.tolist()) - {group_size})} occur; the redistributed layout cannot place them."
        )
    slot_of_group = torch.empty(unique_groups.numel(), dtype=torch.int64)
    slot_of_group[torch.randperm(unique_groups.numel(), generator=generator)] = torch.arange(unique_groups.numel())
    # Sequence position k: groups in slot order, members by row id (the key is unique: row id < max + 1).
    key = slot_of_group[inverse] * (int(row_ids.max()) + 1) + row_ids
    position = torch.empty(n, dtype=torch.int64)
    position[torch.argsort(key)] = torch.arange(n)
    step, within = position // rows_per_step, position % rows_per_step
    return within // per_device, step * per_device + within % per_device
