"""The compute dtype of DFPO's pure math, chosen in one place."""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32: bf16/fp16 inputs are upcast so that sums over a group or
    a batch, ratios and exp() keep their precision; results are cast back by the caller where it matters."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
