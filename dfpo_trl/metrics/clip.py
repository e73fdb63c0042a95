"""Clip fractions of the clip DFPO applies, counted and reduced as TRL counts and reduces its ``clip_ratio/*``.

TRL's ``_compute_loss`` counts clipped ratios from the inputs it is handed, and DFPO hands it rewritten ones
(objectives/rewrite.py): in the score form, and for Orth-Proj's flipped rows under the gradient target, the old
log-probs are the detached current ones (ratio 1, never counted); the effective advantage Â φ can change sign; and
GRPO-fix clips both signs above 1 + ε_high, which TRL's PPO count misses for Â < 0. So where a rewrite is active
DFPO recounts, from the inputs before the rewrite (docs/source/concepts/metrics.md "Clip fractions"). The micro-step's
objective finds the clipped ratios once (:func:`~dfpo_trl.objectives.weights.clipped_ratios`, in its return value); this
module only reduces and logs them:

* the ratio TRL computes: r = exp(ℓ − ℓ_old) per token, or at sequence level s = exp(ρ) with ρ the length-normalised
  sequence log-ratio (eq. 44), then capped at TRL's two-sided ``delta`` as TRL caps it before counting;
* the advantage Â before the rewrite, whose sign says which side of the sign-aware clip (eq. 46–47) applies;
* the region: PPO's (low: r < 1 − ε_low and Â < 0; high: r > 1 + ε_high and Â > 0), or GRPO-fix's clip(r, 0,
  1 + ε_high) for both signs (eq. 79; high: r > 1 + ε_high and Â ≠ 0; low as PPO's, empty since ε_low := 1).

:func:`clip_fraction_terms` reduces one loss call's counts to what TRL reduces over processes, and
:func:`log_clip_fractions` hands them to the metric store as per-call entries under TRL's own names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..objectives.weights import ClippedRatios

if TYPE_CHECKING:
    from .store import MetricStore

__all__ = [
    "CLIP_RATIO_METRICS",
    "ClipFractionTerms",
    "clip_fraction_terms",
    "log_clip_fractions",
]

CLIP_RATIO_METRICS = (
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
    "clip_ratio/high_max",
)
"""The names TRL 1.16's ``_compute_loss`` logs for its clipped loss types, one value per call each."""


class ClipFractionTerms(NamedTuple):
    """One loss call's local share of TRL's clip metrics (0-dim float32 tensors), to be reduced over processes:
    the clipped counts and ``count`` (summed), each row's low fraction's minimum and high fraction's maximum
    (NaN when no row has one)."""

    low: Tensor
    high: Tensor
    region: Tensor
    count: Tensor
    low_min: Tensor
    high_max: Tensor


def clip_fraction_terms(clipped: ClippedRatios, mask: Tensor) -> ClipFractionTerms:
    """TRL's reductions, local half: the masked sums of its ``global_masked_mean`` (sequence level: one value per
    row, every row counted) and the per-row means of its ``masked_seq_mean`` (NaN for a row without tokens),
    reduced here to their nanmin / nanmax, which TRL takes over every process's rows."""
    low, high = clipped.low.float(), clipped.high.float()
    region = (clipped.low | clipped.high).float()
    if low.size(1) == 1:  # sequence level
        sums = [x.sum() for x in (low, high, region)]
        count = torch.full((), float(low.size(0)), device=low.device)  # filled there: no blocking host copy
        row_low, row_high = low.squeeze(1), high.squeeze(1)
    else:
        sums = [(x * mask).sum() for x in (low, high, region)]
        count = mask.sum().float()
        row_low, row_high = (low * mask).sum(-1) / mask.sum(-1), (high * mask).sum(-1) / mask.sum(-1)
    return ClipFractionTerms(*sums, count, _nan_extreme(row_low, largest=False), _nan_extreme(row_high, largest=True))


def _nan_extreme(values: Tensor, *, largest: bool) -> Tensor:
    """The max (``largest``) or min of the non-NaN values, NaN when there are none (TRL's nanmax / nanmin), with
    no host read (TRL's versions index by a mask, which reads the device)."""
    valid = ~torch.isnan(values)
    if largest:
        out = torch.where(valid, values, -torch.inf).amax()
    else:
        out = torch.where(valid, values, torch.inf).amin()
    return torch.where(valid.any(), out, torch.nan)


def log_clip_fractions(store: MetricStore, mode: str, terms: ClipFractionTerms) -> None:
    """One loss call's clip fractions, under TRL's names, as per-call entries: each becomes one value in TRL's
    ``_metrics``, reduced over processes as TRL reduces its own (sums for the means, min / max for the extremes),
    which TRL then averages over the logging interval as it averages its own."""
    low_mean, high_mean, region_mean, low_min, high_max = CLIP_RATIO_METRICS
    store.add_call_mean(mode, low_mean, terms.low, terms.count)
    store.add_call_mean(mode, high_mean, terms.high, terms.count)
    store.add_call_mean(mode, region_mean, terms.region, terms.count)
    store.add_call_min(mode, low_min, terms.low_min)
    store.add_call_max(mode, high_max, terms.high_max)
