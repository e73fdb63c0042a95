"""Group ids: the explicit id of every row's group, the (num_groups, G) view the transforms need, row positions.

A DFPO transform needs every member's post-clip weight at the same parameters (docs/source/concepts/layouts.md). Groups
are carried as an explicit int64 id per row (``inputs["group_ids"]``), never inferred from "every G rows",
so that shuffling, splitting and gathering can never silently mix members of different prompts. Also here: the
group-granular row order and the per-rollout random generators, which draw by (seed, process, step, stream).
"""

from __future__ import annotations

import torch

GROUP_IDS_KEY = "group_ids"
# Global row index in the generation batch: lets gathered per-sequence scalars find their rows again.
ROW_IDS_KEY = "row_ids"
# Whether a buffered training micro-batch holds whole groups: looked up once per rollout, so that the loss path
# never has to ask the device (a host sync per micro-step).
WHOLE_GROUPS_KEY = "dfpo_whole_groups"
# Streams of rollout_generator: each random draw of DFPO has its own, none touches torch's global RNG.
DELTA_RANDOM_STREAM = 0  # DelTA's random-λ control
GROUP_SHUFFLE_STREAM = 1  # the group-granular layout's group order
REDISTRIBUTION_STREAM = 2  # the redistributed layout's group order: one draw shared by every process
PRE_PASS_ORDER_STREAM = 3  # the pre-pass layout's group order: each process's groups in consecutive rows


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


def rollout_ids(
    local_rows: int, group_size: int, process_index: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(group ids, row ids) of one process's rollout rows: global row // G, as TRL's sampler lays rows out, and the
    global row index (TRL slices the global generation batch per process in blocks of ``local_rows``)."""
    offset = process_index * local_rows
    group_ids = consecutive_group_ids(local_rows, group_size, offset=offset, device=device)
    return group_ids, torch.arange(offset, offset + local_rows, device=device)


def group_index(group_ids: torch.Tensor, group_size: int, validate: bool = True) -> torch.Tensor:
    """Row indices arranged as (num_groups, group_size), one row per group, groups in ascending id order.

    Args:
        group_ids: (B,) int64, one id per row. group_size: G.
        validate: check that every group has exactly G rows (it reads the device: a host sync); False for ids
            already checked, e.g. once per rollout.

    Returns:
        (B // G, G) int64 row indices.

    Raises:
        ValueError: naming the layout problem when a group is cut apart (a per-sample shuffle or a split).
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
    """Where each of ``row_ids`` sits in ``all_row_ids``: the index that takes per-row values gathered from all
    processes back to a micro-batch's rows.

    Args:
        row_ids: (B,) the micro-batch's global row ids. all_row_ids: (N,) unique ids, any order, holding every one.

    Returns:
        (B,) int64 positions into ``all_row_ids``.
    """
    order = torch.argsort(all_row_ids)
    return order[torch.searchsorted(all_row_ids[order], row_ids.to(all_row_ids.device))]


def group_granular_order(group_ids: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A row order that shuffles whole groups and keeps each group's rows together (in their current order).

    Replaces TRL's per-sample shuffle so that splitting the generation batch into equal micro-batches of a
    multiple of G rows keeps every group whole (the group-granular layout of docs/source/concepts/layouts.md), and, in
    the pre-pass layout, so that an optimizer step's rows come from as few groups as its size allows.
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
