"""The ``redistributed`` layout: where each rollout row goes, and the one all-to-all that moves it
(docs/source/concepts/layouts.md).

When ``per_device_train_batch_size × num_processes`` is a multiple of G but the per-device batch is not, TRL's
micro-batches cut groups across micro-steps, and exact in-group coefficients would need an extra forward (the
pre-pass). Moving each rollout once between processes, so that every micro-step holds whole groups *across*
processes (:func:`redistribution_plan`), makes them cost one all-gather of a few floats a row.

Every per-row tensor of TRL's rollout moves with its row: ids, masks, advantages, old / reference / sampling
log-probs, the vLLM importance-sampling ratio, the tool mask, DFPO's group and row ids, and anything else with
one row per sample. Rows of different processes have different widths, so before the exchange the prompt side
is left-padded and the completion side right-padded to the widest process, and after it each process trims
the columns that are padding in all of its rows (TRL pads a rollout to its own longest row the same way).
Scalars (``num_items_in_batch``, a global token count) stay as they are. Entries that are not one tensor row
per sample (multimodal inputs, lists) cannot move and are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .batches import concat_sequence_dicts, is_batch_scalar
from .ids import GROUP_IDS_KEY, REDISTRIBUTION_STREAM, ROW_IDS_KEY, rollout_generator

PROMPT_SIDE_KEYS = ("prompt_ids", "prompt_mask")
COMPLETION_MASK_KEY = "completion_mask"


def redistribution_plan(
    row_ids: torch.Tensor,
    group_ids: torch.Tensor,
    group_size: int,
    per_device: int,
    num_processes: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every row of a generation batch goes so that each micro-step holds whole groups *across* processes
    (the ``redistributed`` layout, docs/source/concepts/layouts.md).

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


@dataclass(frozen=True)
class ExchangePlan:
    """One process's part of a redistribution: which local rows go to which process, and where the received
    rows belong. All host tensors (int64), computed once per rollout from the global plan."""

    send_order: torch.Tensor  # local rows in the order they are sent (grouped by destination process)
    send_counts: list[int]  # rows sent to each process
    receive_counts: list[int]  # rows received from each process
    receive_order: torch.Tensor  # received row k goes to local index receive_order[k]


def exchange_plan(
    destination_process: torch.Tensor, destination_index: torch.Tensor, process_index: int, num_processes: int
) -> ExchangePlan:
    """This process's exchange from the global plan (:func:`redistribution_plan`), whose
    entries are the generation batch's rows in process-major order (process p's local row i at ``p·L + i``)."""
    total = destination_process.numel()
    if total % num_processes:
        raise ValueError(f"{total} rows do not split evenly over {num_processes} processes.")
    local = total // num_processes
    source = torch.arange(total) // local
    mine = slice(process_index * local, (process_index + 1) * local)
    # Sort this process's rows by (destination, local index there): each destination receives them in order.
    key = destination_process[mine] * local + destination_index[mine]
    send_order = torch.argsort(key)
    send_counts = torch.bincount(destination_process[mine], minlength=num_processes).tolist()
    incoming = destination_process == process_index
    receive_counts = torch.bincount(source[incoming], minlength=num_processes).tolist()
    # All-to-all delivers source by source, each source's rows in the order it sent them.
    incoming_key = source[incoming] * local + destination_index[incoming]
    receive_order = destination_index[incoming][torch.argsort(incoming_key)]
    if receive_order.numel() != local or not torch.equal(torch.sort(receive_order).values, torch.arange(local)):
        raise ValueError("The redistribution plan does not give every process exactly one row per local slot.")
    return ExchangePlan(send_order, send_counts, receive_counts, receive_order)


def per_row_keys(batch: dict[str, Any], rows: int) -> list[str]:
    """Keys of ``batch`` that hold one tensor row per sample; refuses per-sample entries that are not tensors."""
    keys = []
    for key, value in batch.items():
        if is_batch_scalar(value):
            continue
        if not isinstance(value, torch.Tensor) or value.size(0) != rows:
            raise ValueError(
                f"The redistributed layout moves every rollout entry with its row, but {key!r} "
                f"({type(value).__name__}) is not a tensor with one row per sample ({rows} rows). Multimodal "
                "inputs and list-valued entries cannot move: use group_layout='pre_pass' or a text-only model."
            )
        keys.append(key)
    return keys


def _map_sides(
    batch: dict[str, Any], keys: list[str], completion_width: int,
    prompt_side: Callable[[torch.Tensor], torch.Tensor], completion_side: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    """``prompt_side`` applied to the prompt tensors, ``completion_side`` to the per-token tensors (those
    ``completion_width`` wide); 1-D entries and the rest unchanged."""
    out = dict(batch)
    for key in keys:
        value = batch[key]
        if value.dim() < 2:
            continue
        if key in PROMPT_SIDE_KEYS:
            out[key] = prompt_side(value)
        elif value.size(1) == completion_width:
            out[key] = completion_side(value)
    return out


def _zeros(value: torch.Tensor, columns: int) -> torch.Tensor:
    return value.new_zeros((value.size(0), max(columns, 0), *value.shape[2:]))


def pad_to_widths(
    batch: dict[str, Any], keys: list[str], prompt_width: int, completion_width: int
) -> dict[str, Any]:
    """Left-pad the prompt side to ``prompt_width`` and right-pad per-token tensors (those as wide as
    ``completion_mask``) to ``completion_width``, with zeros: the masks are 0 there, so a padded position never
    counts (and the columns padded in every row of a process are trimmed again after the exchange)."""
    return _map_sides(
        batch, keys, batch[COMPLETION_MASK_KEY].size(1),
        lambda v: torch.cat([_zeros(v, prompt_width - v.size(1)), v], dim=1),
        lambda v: torch.cat([v, _zeros(v, completion_width - v.size(1))], dim=1),
    )


def trim_padding(batch: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Drop the leading prompt columns and trailing completion columns that are padding in every row (one host
    read of two numbers), as TRL pads a rollout to its own longest row."""
    prompt_mask, completion_mask = batch["prompt_mask"], batch[COMPLETION_MASK_KEY]
    prompt_used = prompt_mask.ne(0).any(dim=0)
    completion_used = completion_mask.ne(0).any(dim=0)
    drop_prompt, drop_completion = torch.stack([
        prompt_used.int().cumsum(0).eq(0).sum(),  # leading all-padding prompt columns
        completion_used.int().flip(0).cumsum(0).eq(0).sum(),  # trailing all-padding completion columns
    ]).tolist()
    if not drop_prompt and not drop_completion:
        return batch
    width = completion_mask.size(1)
    return _map_sides(batch, keys, width, lambda v: v[:, drop_prompt:], lambda v: v[:, : width - drop_completion])


def exchange_rows(batch: dict[str, Any], keys: list[str], plan: ExchangePlan) -> dict[str, Any]:
    """Every per-row tensor of ``batch`` (same widths on every process) sent by ``plan``: returns this process's
    new local batch, rows in local-index order. One all-to-all per key; booleans travel as uint8 (NCCL has no
    bool)."""
    out = dict(batch)
    rows = plan.receive_order.numel()
    for key in keys:
        value = batch[key]
        is_bool = value.dtype == torch.bool
        send = (value.to(torch.uint8) if is_bool else value)[plan.send_order.to(value.device)].contiguous()
        received = send.new_empty((rows, *send.shape[1:]))
        dist.all_to_all_single(received, send, plan.receive_counts, plan.send_counts)
        placed = torch.empty_like(received)
        placed[plan.receive_order.to(value.device)] = received
        out[key] = placed.bool() if is_bool else placed
    return out


def redistribute(
    buffered: list[dict[str, Any]], accelerator: Any, group_size: int, per_device: int, seed: int, step: int
) -> dict[str, Any]:
    """Move one rollout between processes so that micro-step k of every process holds whole groups across
    processes: gather every row's (row id, group id) and the batch widths (one small all-gather and host read per
    rollout), plan with one group order shared by all processes (drawn from (``seed``, optimizer ``step``)), pad
    to common widths, one all-to-all per rollout tensor, trim. Returns the local batch in micro-step order."""
    full = concat_sequence_dicts(buffered)
    rows = full["advantages"].size(0)
    keys = per_row_keys(full, rows)
    device = full["advantages"].device
    widths = torch.tensor([[full["prompt_ids"].size(1), full["completion_mask"].size(1)]], device=device)
    ids = torch.stack([full[ROW_IDS_KEY], full[GROUP_IDS_KEY]], dim=1)
    all_ids = accelerator.gather(ids).cpu()
    all_widths = accelerator.gather(widths).cpu()
    generator = rollout_generator(seed, 0, step, stream=REDISTRIBUTION_STREAM)
    destination, index = redistribution_plan(
        all_ids[:, 0], all_ids[:, 1], group_size, per_device, accelerator.num_processes, generator
    )
    plan = exchange_plan(destination, index, accelerator.process_index, accelerator.num_processes)
    padded = pad_to_widths(full, keys, int(all_widths[:, 0].max()), int(all_widths[:, 1].max()))
    return trim_padding(exchange_rows(padded, keys, plan), keys)
