"""Mechanism metrics of DFPO's in-group transforms (docs/source/concepts/metrics.md; arXiv 2604.13088 eq. 23/94, 38).

Asym, the orthogonality residual, φ and the shared-prefix cancellation residual's sums take ``(num_groups, G)`` (or
``(num_groups, G, T)``) tensors, compute in float32 (float64 when an input is float64) and return 0-dim tensors, so
the trainer decides when to synchronise with the device; :func:`log_group_metrics` adds them to the metric store.
None of them returns NaN for valid input: empty batches give 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..precision import compute_dtype as _compute_dtype

if TYPE_CHECKING:
    from ..objectives.step import GroupedWeights
    from .store import MetricStore

__all__ = [
    "asym",
    "log_group_metrics",
    "orth_residual",
    "phi_stats",
    "shared_prefix_mask",
    "shared_prefix_residual_sums",
]

# Denominator guard for φ = w̃ / w̄. w̄ = exp(·) clipped is > 0 by construction; the guard only keeps a
# corrupted w̄ <= 0 from producing Inf/NaN.
_PHI_DENOM_MIN = 1e-12


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
    """(min, mean) of φ = w̃ / w̄, the stop-gradient factor of the ratio-form surrogate
    (docs/source/concepts/design.md).

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


def shared_prefix_residual_sums(
    token_coefficients: torch.Tensor, shared: torch.Tensor, *group_subsets: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The shared-token cancellation residual (docs/source/concepts/metrics.md) as sums: over shared positions
    (``shared``) with Σ_i |c_{i,t}| > 0, Σ |Σ_i c_{i,t}| / Σ_i |c_{i,t}| and the count of such positions (0 means the
    shared tokens' gradients cancel exactly, 1 that they all push the same way), over all groups, then over each subset
    of groups.

    ``token_coefficients`` (num_groups, G, T); ``shared`` the (num_groups, T) mask of
    :func:`shared_prefix_mask`; each of ``group_subsets`` a (num_groups,) bool selecting groups (e.g. the two-sided
    ones, eq. C8). One pass over the coefficients serves every subset: the metric runs in a backward hook on
    every micro-step, where each extra kernel shows in step time."""
    dtype = _compute_dtype(token_coefficients)
    c = token_coefficients.to(dtype)
    total_abs = c.abs().sum(dim=1)
    used = shared & (total_abs > 0)
    ratio = torch.where(used, c.sum(dim=1).abs() / torch.where(used, total_abs, 1.0), 0.0)
    sums = [(ratio.sum(), used.sum())]
    for subset in group_subsets:
        keep = subset.unsqueeze(-1)
        sums.append(((ratio * keep).sum(), (used & keep).sum()))
    return sums


def log_group_metrics(store: MetricStore, mode: str, grouped: GroupedWeights, off_policy: bool = False) -> None:
    """The group metrics of one transformed set of whole groups, as device tensors pooled over groups (eq. 23/94,
    the orthogonality residual, φ, and the share of one-sided groups of eq. C8); the diagnostics share of groups
    without signal, and on an ``off_policy`` step (the rollout is an optimizer step old or more) φ again under
    ``diagnostics/phi_*_off_policy``, where it can differ from 1.

    Args:
        store: the metric store. mode: ``"train"`` or ``"eval"``.
        grouped: the transformed groups, (num_groups, G) views of s̄, s̃, Â and their sides (objectives/step.py).
        off_policy: whether this step trains on a rollout an optimizer step old or more.
    """
    s_bar, s_tilde, adv = grouped.s_bar.detach(), grouped.s_tilde.detach(), grouped.advantages.detach()
    sides, groups = grouped.sides, s_bar.size(0)
    # eq. C8: the share of groups with signal that no per-sequence weight can balance
    store.add_mean(mode, "cancellation/one_sided_groups", sides.one_sided.sum(), sides.has_signal.sum())
    store.add_mean(mode, "asym/before", asym(s_bar, adv) * groups, groups)
    store.add_mean(mode, "asym/after", asym(s_tilde, adv) * groups, groups)
    store.add_mean(mode, "transform/orth_residual", orth_residual(s_tilde, adv) * groups, groups)
    phi_min, phi_mean = phi_stats(s_tilde, s_bar)
    store.add_min(mode, "transform/phi_min", phi_min, s_bar.numel())
    store.add_mean(mode, "transform/phi_mean", phi_mean * s_bar.numel(), s_bar.numel())
    store.add_mean(mode, "diagnostics/zero_variance_groups", (~sides.has_signal).sum(), groups)
    if off_policy:
        store.add_min(mode, "diagnostics/phi_min_off_policy", phi_min, s_bar.numel())
        store.add_mean(mode, "diagnostics/phi_mean_off_policy", phi_mean * s_bar.numel(), s_bar.numel())
