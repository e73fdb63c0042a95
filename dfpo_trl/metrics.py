"""Mechanism metrics of DFPO (DESIGN.md §6; arXiv 2604.13088 eq. 19, 20, 23/94).

Tensor metrics take ``(num_groups, G)`` (or ``(num_groups, G, T)``) tensors, compute in float32 (float64
when an input is float64) and return 0-dim tensors, so the trainer decides when to synchronise with the
device. Curve metrics (Jitter₂, EMA, steps-to-threshold) take a Python sequence or a 1-D tensor and
return Python numbers. None of them returns NaN for valid input: empty batches give 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "asym",
    "ema",
    "jitter2",
    "orth_residual",
    "phi_stats",
    "shared_prefix_mask",
    "shared_prefix_residual",
    "steps_to_threshold",
]

# Denominator guard for φ = w̃ / w̄. w̄ = exp(·) clipped is > 0 by construction; the guard only keeps a
# corrupted w̄ <= 0 from producing Inf/NaN.
_PHI_DENOM_MIN = 1e-12


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_groups(name: str, x: torch.Tensor, advantages: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape != advantages.shape:
        raise ValueError(
            f"{name} expects two tensors shaped (num_groups, G) and equal; got {tuple(x.shape)} and "
            f"{tuple(advantages.shape)}"
        )


def asym(coefficients: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Asym (eq. 23/94): mean over groups of Var_i(coefficient_i · Â_i), population variance.

    It measures how unevenly the weights modulate the group's advantages; with a transform that makes
    the coefficients equal it reduces to the variance of Â itself.
    """
    _check_groups("asym", coefficients, advantages)
    dtype = _compute_dtype(coefficients, advantages)
    if coefficients.numel() == 0:
        return torch.zeros((), dtype=dtype, device=coefficients.device)
    prod = coefficients.to(dtype) * advantages.to(dtype)
    return prod.var(dim=-1, correction=0).mean()


def orth_residual(w_tilde: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Mean over groups of |Σ_i w̃_i Â_i|: how far the transformed weights are from the orthogonality
    condition Σ_i s̃_i Â_i = 0 that restores shared-token cancellation (Appendix B, eq. 49–51)."""
    _check_groups("orth_residual", w_tilde, advantages)
    dtype = _compute_dtype(w_tilde, advantages)
    if w_tilde.shape[0] == 0:
        return torch.zeros((), dtype=dtype, device=w_tilde.device)
    return (w_tilde.to(dtype) * advantages.to(dtype)).sum(dim=-1).abs().mean()


def phi_stats(w_tilde: torch.Tensor, w_bar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, mean) of φ = w̃ / w̄, the stop-gradient factor of the ratio-form surrogate (DESIGN.md §3).

    φ < 1 means the transform shrank a sequence's weight. w̄ is clamped below at 1e-12 before dividing.
    Any shape; empty input gives (0, 0).
    """
    if w_tilde.shape != w_bar.shape:
        raise ValueError(
            f"phi_stats expects equal shapes; got {tuple(w_tilde.shape)} and {tuple(w_bar.shape)}"
        )
    dtype = _compute_dtype(w_tilde, w_bar)
    if w_tilde.numel() == 0:
        zero = torch.zeros((), dtype=dtype, device=w_tilde.device)
        return zero, zero.clone()
    phi = w_tilde.to(dtype) / w_bar.to(dtype).clamp(min=_PHI_DENOM_MIN)
    return phi.min(), phi.mean()


def shared_prefix_mask(completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Positions whose (prefix, token) every member of the group shares, shaped (num_groups, T).

    True at t iff for all members i: mask[i, t'] = 1 and ids[i, t'] = ids[0, t'] for every t' ≤ t. These
    are the positions where the gradients ∇ℓ_{i,t} coincide, so only the coefficient sum matters
    (eq. 38, Corollary 3.3). Groups of G = 1 are all False: with one member there is nothing to cancel.
    Inputs are (num_groups, G, T).
    """
    if completion_ids.dim() != 3 or completion_ids.shape != completion_mask.shape:
        raise ValueError(
            "shared_prefix_mask expects completion_ids and completion_mask shaped (num_groups, G, T) and "
            f"equal; got {tuple(completion_ids.shape)} and {tuple(completion_mask.shape)}"
        )
    num_groups, group_size, length = completion_ids.shape
    if group_size < 2 or length == 0:
        return torch.zeros((num_groups, length), dtype=torch.bool, device=completion_ids.device)
    same = (completion_ids == completion_ids[:, :1, :]).all(dim=1) & (completion_mask != 0).all(dim=1)
    # Cumulative AND along t: a position is shared only if every earlier one is.
    return same.to(torch.int8).cummin(dim=-1).values.bool()


def shared_prefix_residual(
    token_coefficients: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-token cancellation residual (DESIGN.md §6): returns (value, count).

    Over shared positions (see :func:`shared_prefix_mask`) with Σ_i |c_{i,t}| > 0, the mean of
    |Σ_i c_{i,t}| / Σ_i |c_{i,t}|, where c_{i,t} is the effective scalar multiplying ∇ℓ_{i,t}. 0 means
    the shared tokens' gradients cancel exactly, 1 that they all push the same way (the "learning tax").
    ``count`` (int64 0-dim tensor) is the number of positions used; ``value`` is 0 when it is 0, so the
    caller should check ``count`` before logging. Inputs are (num_groups, G, T).
    """
    if token_coefficients.shape != completion_ids.shape:
        raise ValueError(
            "shared_prefix_residual expects token_coefficients shaped like completion_ids; got "
            f"{tuple(token_coefficients.shape)} and {tuple(completion_ids.shape)}"
        )
    shared = shared_prefix_mask(completion_ids, completion_mask)
    dtype = _compute_dtype(token_coefficients)
    c = token_coefficients.to(dtype)
    total_abs = c.abs().sum(dim=1)
    used = shared & (total_abs > 0)
    ratio = c.sum(dim=1).abs() / torch.where(used, total_abs, torch.ones_like(total_abs))
    ratio = torch.where(used, ratio, torch.zeros_like(ratio))
    count = used.sum()
    value = ratio.sum() / count.clamp(min=1).to(dtype)
    return value, count


def _as_float_list(curve: Sequence[float] | torch.Tensor, name: str) -> list[float]:
    if isinstance(curve, torch.Tensor):
        if curve.dim() != 1:
            raise ValueError(f"{name} expects a 1-D curve, got a tensor of shape {tuple(curve.shape)}")
        return [float(v) for v in curve.detach().to("cpu", torch.float64).tolist()]
    return [float(v) for v in curve]


def jitter2(curve: Sequence[float] | torch.Tensor) -> float:
    """Jitter₂ (eq. 20): (1/(T−2)) Σ_{t=1}^{T−2} |m_{t+2} − 2m_{t+1} + m_t|, the mean absolute second
    difference of a training curve: 0 for a straight line, large for short-term oscillation.

    Raises ValueError for fewer than 3 points (the metric is undefined; we never log NaN).
    """
    m = _as_float_list(curve, "jitter2")
    if len(m) < 3:
        raise ValueError(f"jitter2 needs a curve of at least 3 points, got {len(m)}")
    return sum(abs(m[t + 2] - 2.0 * m[t + 1] + m[t]) for t in range(len(m) - 2)) / (len(m) - 2)


def ema(curve: Sequence[float] | torch.Tensor, alpha: float = 0.3) -> list[float]:
    """Exponential moving average e_0 = m_0, e_t = α m_t + (1 − α) e_{t−1}, used to smooth a reward
    curve before thresholding (eq. 19) so a single lucky step does not count as reaching the threshold."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    out: list[float] = []
    for value in _as_float_list(curve, "ema"):
        out.append(value if not out else alpha * value + (1.0 - alpha) * out[-1])
    return out


def steps_to_threshold(
    curve: Sequence[float] | torch.Tensor, threshold: float, alpha: float = 0.3
) -> int | None:
    """Steps(Score ≥ κ) (eq. 19): the first 0-based index where the EMA of ``curve`` is ≥ ``threshold``,
    or None if it never gets there."""
    for index, value in enumerate(ema(curve, alpha=alpha)):
        if value >= threshold:
            return index
    return None
