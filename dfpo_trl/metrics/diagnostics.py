"""Per-step diagnostics a study reads to tell whether the transform acted at all (docs/source/concepts/metrics.md,
"Diagnostics").

Whether DFPO's transform can change a run depends on things TRL's own metrics hide: how far the weights moved on
the steps where the policy is stale (φ = s̃/s̄, only < 1 off-policy), how many of the rows that carry a gradient
the clip removes (TRL's ``clip_ratio/*`` count every row, zero-advantage ones too), whether a step had any signal at
all, and how much TRL's vLLM importance-sampling ratio, applied after the transform, re-weights the rows. The
functions here reduce one micro-batch to O(batch) device scalars; :func:`log_loss_diagnostics` hands them to the
metric store (no host read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..objectives.weights import ClippedRatios

if TYPE_CHECKING:
    from .store import MetricStore

__all__ = [
    "RatioSpread",
    "log_loss_diagnostics",
    "ratio_spread",
    "signal_clip_counts",
    "zero_signal",
]


def signal_clip_counts(clipped: ClippedRatios, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(clipped, counted) among the rows with Â ≠ 0: at sequence level (``clipped`` (B, 1)) rows, at token level
    ((B, T)) the loss tokens of those rows; clipped = in the region of eq. 46–47 (or GRPO-fix's) that removes the
    row's gradient in the ratio form. ``advantages`` (B,) are TRL's, before DFPO's rewrite."""
    signal = torch.nan_to_num(advantages.detach(), nan=0.0) != 0
    region = clipped.low | clipped.high
    if region.size(1) == 1:
        return (region.squeeze(1) & signal).sum(), signal.sum()
    counted = (mask != 0) & signal.unsqueeze(1)
    return (region & counted).sum(), counted.sum()


def zero_signal(advantages: Tensor) -> Tensor:
    """1.0 when every row's Â is 0 (every group's rewards are equal: TRL's advantage r − mean(r), scaled or not, is
    then exactly 0), else 0.0; such a micro-batch gives the policy term no gradient."""
    return (torch.nan_to_num(advantages.detach(), nan=0.0) == 0).all().to(torch.float32)


class RatioSpread(NamedTuple):
    """One micro-batch's share of the ratio's spread: min, max, Σ (x − 1), Σ (x − 1)² (float64) and the count."""

    low: Tensor
    high: Tensor
    deviations: Tensor
    squares: Tensor
    count: Tensor


def ratio_spread(ratio: Tensor, mask: Tensor) -> RatioSpread:
    """The spread of TRL's vLLM importance-sampling ratio as TRL applies it: per token ((B, T), the loss tokens) or
    per sequence ((B, 1), every row, as TRL's own ``sampling/importance_sampling_ratio/*`` counts). Centred at 1
    (the ratio of matching samplers), so the pooled variance keeps its digits."""
    values = ratio.detach().to(torch.float64)
    valid = torch.ones_like(values, dtype=torch.bool) if values.size(1) == 1 else mask != 0
    deviation = torch.where(valid, values - 1.0, 0.0)
    return RatioSpread(
        torch.where(valid, values, torch.inf).amin(), torch.where(valid, values, -torch.inf).amax(),
        deviation.sum(), (deviation * deviation).sum(), valid.sum(),
    )


def log_loss_diagnostics(
    store: MetricStore, mode: str, advantages: Tensor, mask: Tensor, clipped: ClippedRatios,
    is_ratio: Tensor | None,
) -> None:
    """The loss call's diagnostics (docs/source/concepts/metrics.md): ``diagnostics/clip_fraction_signal`` (pooled
    clipped / counted among rows with Â ≠ 0), ``diagnostics/zero_signal`` (a minimum over the interval's micro-batches
    and processes: 1 when no row of any had Â ≠ 0) and, where TRL applies its vLLM importance-sampling ratio,
    ``diagnostics/is_ratio_min`` / ``_max`` / ``_std``."""
    store.add_mean(mode, "diagnostics/clip_fraction_signal", *signal_clip_counts(clipped, advantages, mask))
    store.add_min(mode, "diagnostics/zero_signal", zero_signal(advantages))
    if is_ratio is not None:
        spread = ratio_spread(is_ratio, mask)
        store.add_min(mode, "diagnostics/is_ratio_min", spread.low, spread.count)
        store.add_max(mode, "diagnostics/is_ratio_max", spread.high, spread.count)
        store.add_std(mode, "diagnostics/is_ratio_std", spread.deviations, spread.squares, spread.count)
