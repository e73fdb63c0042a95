"""The per-sequence weights DFPO's objective is built from: s, s̄ (eq. 44–47), the clip survivors U, the loss mask.

Pure functions of tensors, no trainer and no config object (tests/objectives/test_loss_inputs.py,
tests/transforms/test_transforms.py):

* :func:`loss_mask`: the tokens TRL's loss counts (completion mask × tool mask);
* :func:`bounded_old_logps`: the log-ratio bound (docs/source/concepts/decisions.md, "Numerics"): ρ (sequence level) or
each token's
  log-ratio kept in ±20 by shifting the old log-probs, gradients unchanged;
* :func:`sequence_log_ratio`: ρ_i (eq. 44), s_i = exp(ρ_i);
* :func:`sign_aware_post_clip`: s̄ (eq. 46–47);
* :func:`clip_survivors`: U, the members whose gradient survives TRL's clip (docs/source/concepts/cancellation.md, eq.
C2);
* :func:`post_clip_weights`: s̄ and U of a micro-batch's rows from its log-probs;
* :func:`clipped_ratios`: which ratios TRL's clip removes, with TRL's own ratio arithmetic (its ``clip_ratio/*``
  count, which DFPO's metrics read: metrics/clip.py, metrics/diagnostics.py);
* :class:`RowWeights`: s̄, s̃, U and the two-sided flag of eq. C8 per row, what the loss-input rewrite reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..precision import compute_dtype as _compute_dtype

__all__ = [
    "MAX_LOG_RATIO",
    "ClippedRatios",
    "PostClipWeights",
    "RowWeights",
    "bounded_old_logps",
    "clip_survivors",
    "clipped_ratios",
    "loss_mask",
    "post_clip_weights",
    "sequence_log_ratio",
    "sign_aware_post_clip",
]

MAX_LOG_RATIO = 20.0
# Per-token log-ratios that are +-Inf are replaced by +-_TOKEN_LOG_RATIO_MAX before averaging, so a row
# holding both +Inf and -Inf gives a finite (then clamped) mean instead of NaN.
_TOKEN_LOG_RATIO_MAX = 1e6


def loss_mask(inputs: Mapping[str, Any]) -> Tensor:
    """The tokens TRL's loss counts: ``completion_mask`` times ``tool_mask`` where the rollout has one."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def bounded_old_logps(
    per_token_logps: Tensor, old: Tensor, mask: Tensor, sequence_level: bool, max_log_ratio: float = MAX_LOG_RATIO
) -> Tensor:
    """Old log-probs shifted so that TRL's log-ratio, ρ_i (eq. 44) at sequence level or ℓ − ℓ_old per token,
    lies in ±``max_log_ratio``: exp() never overflows and Â = 0 rows never give inf·0. Inside the bound the
    shift is exactly 0 (the same values, no data-dependent branch); gradients are unchanged.

    Args:
        per_token_logps: ℓ(θ) (B, T). old: ℓ_old (B, T). mask: the loss mask (B, T).
        sequence_level: bound ρ_i per row (TRL's sequence-level importance sampling) instead of each token's.

    Returns:
        The bounded old log-probs (B, T).
    """
    log_ratio = per_token_logps.detach() - old
    if sequence_level:
        rho = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        excess = rho - rho.clamp(-max_log_ratio, max_log_ratio)
        return old + excess.unsqueeze(1) * mask
    return old + (log_ratio - log_ratio.clamp(-max_log_ratio, max_log_ratio))


def sequence_log_ratio(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    max_abs: float = MAX_LOG_RATIO,
) -> torch.Tensor:
    """ρ_i = (1/L_i) Σ_t m_{i,t} (ℓ_{i,t} − ℓ^old_{i,t}) over the last dim (eq. 44); s_i = exp(ρ_i).

    The normaliser is ``mask.sum(-1).clamp(min=1)`` as in TRL's GSPO, so zero-length rows give 0.
    The result is clamped to ``[-max_abs, max_abs]`` so ``exp`` never overflows (exp(20) ≈ 4.9e8); past
    the clamp the gradient is 0. Masked-out positions are ignored even if they hold NaN/Inf. Inside the
    mask, ±Inf token log-ratios count as ±1e6 and NaN as 0 (no ratio information), so one broken token
    cannot make ρ NaN. Differentiable; returns ``per_token_logps``'s dtype.
    """
    if per_token_logps.shape != old_per_token_logps.shape or per_token_logps.shape != mask.shape:
        raise ValueError(
            "sequence_log_ratio expects per_token_logps, old_per_token_logps and mask of equal shape; got "
            f"{tuple(per_token_logps.shape)}, {tuple(old_per_token_logps.shape)}, {tuple(mask.shape)}"
        )
    if not max_abs > 0:
        raise ValueError(f"max_abs must be > 0, got {max_abs}")
    dtype = _compute_dtype(per_token_logps, old_per_token_logps)
    log_ratio = per_token_logps.to(dtype) - old_per_token_logps.to(dtype)
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0, posinf=_TOKEN_LOG_RATIO_MAX, neginf=-_TOKEN_LOG_RATIO_MAX)
    m = mask.to(dtype)
    log_ratio = torch.where(m != 0, log_ratio, torch.zeros_like(log_ratio))
    rho = (log_ratio * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    rho = rho.clamp(-max_abs, max_abs)
    out_dtype = per_token_logps.dtype if per_token_logps.dtype.is_floating_point else dtype
    return rho.to(out_dtype)


def sign_aware_post_clip(s: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Sign-aware post-clip weight s̄ (eq. 46–47), elementwise for any (broadcastable) shape.

    c = clip(s, 1 − eps_low, 1 + eps_high); s̄ = min(s, c) where Â ≥ 0, max(s, c) where Â < 0. With it,
    Σ_i min(s_i Â_i, c_i Â_i) = Σ_i Â_i s̄_i (eq. 48–49), so GSPO is "Â times s̄" and a group transform
    can act on s̄. Differentiable: clipped entries carry GSPO's zero gradient.
    """
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"eps_low and eps_high must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    c = s.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.where(advantages >= 0, torch.minimum(s, c), torch.maximum(s, c))


def clip_survivors(
    s: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, two_sided_cap: float | None = None
) -> torch.Tensor:
    """U of eq. C2: members whose gradient survives TRL's clipped surrogate -min(s Â, clip(s) Â).

    Sign-aware, as eq. 46–47: for Â ≥ 0 the gradient is lost when s > 1 + ε_high; for Â < 0 when
    s < 1 − ε_low, or, with TRL's two-sided cap δ (``two_sided_cap``: TRL's ``delta``, which caps s at δ for the
    unclipped branch), when s > δ.
    At a boundary (s exactly 1 ± ε) TRL's min still passes the gradient, so boundaries count as surviving.
    Elementwise on any shape; returns a bool tensor.
    """
    positive = advantages >= 0
    survives_positive = s <= 1.0 + eps_high
    survives_negative = s >= 1.0 - eps_low
    if two_sided_cap is not None:
        survives_negative = survives_negative & (s <= two_sided_cap)
    return torch.where(positive, survives_positive, survives_negative)


class PostClipWeights(NamedTuple):
    """Per row: s̄ (eq. 47), U (eq. C2) and whether a NaN/Inf token log-ratio was read as 0 / ±1e6."""

    s_bar: Tensor
    survives: Tensor
    sanitised: Tensor


def post_clip_weights(
    logps: Tensor, old: Tensor, mask: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
    two_sided_cap: float | None = None, score_form: bool = False,
) -> PostClipWeights:
    """s̄ = sign-aware post-clip of s = exp(ρ) (eq. 44–47) and U, the rows whose gradient survives TRL's clip
    (eq. C2; every row in the score form, which is never clipped). Differentiable in ``logps``.

    Args:
        logps: ℓ(θ) (B, T). old: the old log-probs TRL's loss reads (B, T). mask: the loss mask (B, T).
        advantages: Â (B,). eps_low, eps_high, two_sided_cap: TRL's clip settings. score_form: every row survives.

    Returns:
        :class:`PostClipWeights`: s̄, U and the sanitised flags, (B,) each.
    """
    sanitised = (~torch.isfinite(logps.detach() - old) & (mask != 0)).any(-1)
    s = torch.exp(sequence_log_ratio(logps, old, mask))
    s_bar = sign_aware_post_clip(s, advantages, eps_low, eps_high)
    if score_form:
        return PostClipWeights(s_bar, torch.ones_like(s, dtype=torch.bool), sanitised)
    return PostClipWeights(s_bar, clip_survivors(s.detach(), advantages, eps_low, eps_high, two_sided_cap), sanitised)


class ClippedRatios(NamedTuple):
    """Which ratios were clipped below and above: bool, (B, T) at token level, (B, 1) at sequence level."""

    low: Tensor
    high: Tensor


def clipped_ratios(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    sequence_level: bool,
    eps_low: float,
    eps_high: float,
    symmetric: bool,
    two_sided_cap: float | None = None,
) -> ClippedRatios:
    """The ratios TRL's clip removes from one micro-batch, with TRL's ratio arithmetic (docs/source/concepts/metrics.md
    "Clip fractions"): r = exp(ℓ − ℓ_old) per token, or at sequence level s = exp(ρ) (eq. 44), capped at TRL's two-sided
    ``delta`` as TRL caps it; low: r < 1 − ε_low and Â < 0; high: r > 1 + ε_high and Â > 0, or, ``symmetric``
    (GRPO-fix's clip(r, 0, 1 + ε_high), eq. 79), Â ≠ 0. TRL's arithmetic, not :func:`sequence_log_ratio`'s: the
    count stands in for TRL's own.

    Args:
        per_token_logps: ℓ(θ) (B, T). old_per_token_logps: TRL's old log-probs before DFPO's rewrite (B, T).
        advantages: Â before the rewrite, (B,) or (B, T). mask: TRL's loss mask (B, T).
    """
    log_ratio = per_token_logps.detach() - old_per_token_logps
    if sequence_level:
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if two_sided_cap is not None:
        ratio = torch.clamp(ratio, max=two_sided_cap)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    low = (ratio < 1 - eps_low) & (advantages < 0)
    above = ratio > 1 + eps_high
    high = above & (advantages != 0) if symmetric else above & (advantages > 0)
    return ClippedRatios(low, high)


class RowWeights(NamedTuple):
    """Per-row sequence weights of one micro-batch, what the loss-input rewrite reads: s̄ (eq. 47), s̃ (the
    transform's output), whether the row's gradient survives the clip and, when it is on, TRL's off-policy mask
    (U, eq. C2) and whether its group is two-sided (eq. C8)."""

    s_bar: Tensor
    s_tilde: Tensor
    survives: Tensor
    two_sided: Tensor
