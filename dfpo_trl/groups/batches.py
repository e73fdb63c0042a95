"""Rollout dicts as whole batches: join micro-batches, reorder rows, and tell per-row entries from batch scalars.

TRL keeps a rollout as a dict of tensors (one row per sample), lists, flags and 0-dim tensors such as
``num_items_in_batch``; its ``split_tensor_dict`` cuts it into micro-batches. The layouts that regroup a rollout
(docs/source/concepts/layouts.md) join those micro-batches, permute the rows and split again with these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["concat_sequence_dicts", "is_batch_scalar", "permute_sequence_dict"]


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
