"""In-group transforms of the sequence-level weight vector (DFPO, arXiv 2604.13088, Appendix B).

Every group function takes ``w`` and ``advantages`` shaped ``(num_groups, G)`` and returns a tensor of the
same shape and of ``w``'s dtype. They are normally called on detached tensors under ``torch.no_grad()``
(the paper's stop-gradient), but are built from differentiable torch ops so the "no stop-gradient"
ablation of Table 3 can differentiate through them.

Numerics, shared by all group transforms except ``none``:

* Computation runs in float32, or float64 when ``w`` or ``advantages`` is float64; bf16/fp16 inputs are
  upcast and the result is cast back to ``w``'s dtype (clamped to that dtype's finite range).
* ``w`` is sanitized first: NaN and +Inf become ``+W_MAX``, -Inf becomes ``-W_MAX`` and every value is
  clamped to ``[-W_MAX, W_MAX]``. ``W_MAX = 1e10`` is above ``exp(20)`` (the largest ratio that
  :func:`~dfpo_trl.objectives.weights.sequence_log_ratio` can produce with its default clamp), so legitimate
  weights pass through unchanged while one broken member can never turn its whole group's coefficients into
  NaN/Inf.
* NaN advantages are treated as 0. Because every transform here is invariant to a positive rescaling
  of the advantage vector, advantages are divided by the group's max ``|Â_i|`` before use, so extreme
  advantages (1e30, or +-Inf) cannot overflow ``‖Â‖²``. Groups whose max ``|Â_i|`` is at most the
  compute dtype's ``tiny`` count as "no advantage" (all-zero).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..precision import compute_dtype as _compute_dtype

__all__ = [
    "GROUP_TRANSFORMS",
    "TRANSFORMS",
    "GroupTransform",
    "W_MAX",
    "apply_group_transform",
    "get_transform",
    "min_replace",
    "orth_proj",
    "positive_orth_proj",
    "scale",
    "truncate_rebalance",
]


#: Bound applied to sanitized weights (see module docstring).
W_MAX = 1e10
# In positive_orth_proj, advantages below this fraction of the group's largest |Â| are treated as 0 so
# every breakpoint w_i / Â_i stays finite (|w| <= W_MAX). Their effect on the solution is below rounding.
_REL_ADV_EPS = 1e-20
# positive_orth_proj evaluates its root function densely (num_groups x G x G) up to this many elements
# (64 MiB in float32), and through a sort beyond.
_DENSE_MAX_ELEMENTS = 1 << 24


def _sanitize_weights(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = w.to(dtype)
    return torch.nan_to_num(x, nan=W_MAX, posinf=W_MAX, neginf=-W_MAX).clamp(-W_MAX, W_MAX)


def _normalized_advantages(advantages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (Â / max|Â| per group, has_advantage of shape (num_groups, 1))."""
    a = torch.nan_to_num(advantages.to(dtype), nan=0.0)
    amax = a.abs().amax(dim=-1, keepdim=True)
    has_adv = amax > torch.finfo(dtype).tiny
    a = a / torch.where(has_adv, amax, torch.ones_like(amax))
    return a, has_adv


def _to_output(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not dtype.is_floating_point:
        return x
    limit = torch.finfo(dtype).max
    if limit < torch.finfo(x.dtype).max:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def _check_groups(w: torch.Tensor, advantages: torch.Tensor) -> None:
    if w.dim() != 2 or w.shape != advantages.shape:
        raise ValueError(
            "group transforms expect w and advantages shaped (num_groups, G) and equal; got "
            f"w {tuple(w.shape)} and advantages {tuple(advantages.shape)}"
        )


# --------------------------------------------------------------------------------------------------
# Group transforms (eq. 18, 50–55, Table 3)
# --------------------------------------------------------------------------------------------------


def min_replace(w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Min-Replace (eq. 50): every member gets the group minimum, so Σ_i s̃_i Â_i = s̄_min Σ_i Â_i = 0.

    ``advantages`` is unused; it is kept so all transforms share one signature.
    """
    _check_groups(w, advantages)
    x = _sanitize_weights(w, _compute_dtype(w, advantages))
    return _to_output(x.amin(dim=-1, keepdim=True).expand_as(x), w.dtype)


def orth_proj(w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Orth-Proj (eq. 18): s̃ = w − (Âᵀw / ‖Â‖²) Â, the closest vector to w orthogonal to Â.

    Groups with no advantage (‖Â‖ ≈ 0) are returned unchanged. Entries may become negative; use
    :func:`positive_orth_proj` when that matters.
    """
    _check_groups(w, advantages)
    dtype = _compute_dtype(w, advantages)
    x = _sanitize_weights(w, dtype)
    a, has_adv = _normalized_advantages(advantages, dtype)
    coef = (a * x).sum(dim=-1, keepdim=True) / torch.where(
        has_adv, (a * a).sum(dim=-1, keepdim=True), torch.ones_like(has_adv, dtype=dtype)
    )
    out = torch.where(has_adv, x - coef * a, x)
    return _to_output(out, w.dtype)


def _bracket_dense(x: torch.Tensor, a: torch.Tensor, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lo = max{p : g(p) > 0}, hi = min{p : g(p) <= 0} over the points, with g evaluated directly at every
    point: O(G²) work and memory per group, but few kernel launches (the cost that dominates at G <= 64)."""
    a_row = a.unsqueeze(-2)
    g_at_points = (a_row * torch.relu(x.unsqueeze(-2) - points.unsqueeze(-1) * a_row)).sum(dim=-1)
    positive = g_at_points > 0
    lo = torch.where(positive, points, float("-inf")).amax(dim=-1, keepdim=True)
    hi = torch.where(positive, float("inf"), points).amin(dim=-1, keepdim=True)
    return lo, hi


def _bracket_sorted(x: torch.Tensor, a: torch.Tensor, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same bracket as :func:`_bracket_dense` in O(G log G) work and O(G) memory per group, via a sort.

    Right of sorted point j, the members with w_i − μÂ_i > 0 are the negative side up to j and the
    positive side beyond j, so there g(μ) = S1[j] − μ S2[j] with (S1, S2) = Σ_active Â_i (w_i, Â_i)
    (channels stacked on dim 1): a prefix sum over N plus an exclusive suffix sum over P. Both are summed
    directly, not as "total minus prefix", so g keeps its relative accuracy near the root.
    """
    points, order = torch.sort(points, dim=-1)
    terms = torch.stack((x, a), dim=1)
    sorted_terms = terms.gather(-1, order.unsqueeze(1).expand_as(terms))
    a_sorted = sorted_terms[:, 1:]
    contrib = sorted_terms * a_sorted
    neg_prefix = (contrib * (a_sorted < 0)).cumsum(dim=-1)
    pos_suffix = (contrib * (a_sorted > 0)).flip(-1).cumsum(dim=-1).flip(-1)
    right = neg_prefix + torch.cat((pos_suffix[..., 1:], torch.zeros_like(pos_suffix[..., :1])), dim=-1)
    g_at_points = right[:, 0] - points * right[:, 1]  # g is continuous: read it from the right-hand piece
    k = (g_at_points > 0).sum(dim=-1, keepdim=True)  # g > 0 at the first k points
    group_size = points.shape[-1]
    lo = torch.where(k > 0, points.gather(-1, (k - 1).clamp(min=0)), float("-inf"))
    hi = torch.where(k < group_size, points.gather(-1, k.clamp(max=group_size - 1)), float("inf"))
    return lo, hi


def positive_orth_proj(w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Positive Orth-Proj (eq. 51): the exact solution of min ½‖v − w‖² s.t. Âᵀv = 0, v ≥ 0.

    KKT gives v(μ) = max(w − μÂ, 0) with μ a root of g(μ) = Âᵀ max(w − μÂ, 0), which is continuous,
    non-increasing and piecewise linear with kinks at b_i = w_i / Â_i. Per group (batched, no Python
    loop, no host sync) we evaluate g at every kink, take the two neighbouring kinks where g changes
    sign and solve the linear piece between them exactly. Small batches (num_groups · G² <= 2**24)
    evaluate g densely, larger ones through a sort (O(G log G)); both give the same bracket. The QP is
    always feasible (v = 0), so a root exists; when only one side of Â is non-empty, that side goes
    to 0. Members with Â_i = 0 get max(w_i, 0); groups with no advantage are returned unchanged
    (sanitized). On GPU the cost is kernel launches (~50), not arithmetic: 0.45 ms for 10⁴ groups of 32
    on an H200 whatever the batch size, 0.08 ms under ``torch.compile`` (benchmarks/bench_transforms.py).
    """
    _check_groups(w, advantages)
    dtype = _compute_dtype(w, advantages)
    x = _sanitize_weights(w, dtype)
    a, has_adv = _normalized_advantages(advantages, dtype)
    a = torch.where(a.abs() > _REL_ADV_EPS, a, 0.0)
    # g is evaluated at every kink b_i = w_i / Â_i and, harmlessly, at w_i for zero-advantage members
    # (whose terms in g are 0). All are finite since |w| <= W_MAX and |Â_i| > 1e-20 or Â_i = 0.
    points = x / torch.where(a == 0, 1.0, a)
    if x.shape[0] * x.shape[1] ** 2 <= _DENSE_MAX_ELEMENTS:
        lo, hi = _bracket_dense(x, a, points)
    else:
        lo, hi = _bracket_sorted(x, a, points)
    # No kink lies strictly inside (lo, hi), so there the active members are fixed: the positive side
    # with b_i >= hi and the negative side with b_i <= lo, and g(μ) = S1 − μ S2 with the sums below taken
    # directly over that set. A flat piece (S2 = 0) only occurs next to an empty side, where g = 0 on
    # it, so any of its points is a root; take a finite end.
    active = torch.where(a > 0, points >= hi, points <= lo)
    s1 = (active * a * x).sum(dim=-1, keepdim=True)
    s2 = (active * a * a).sum(dim=-1, keepdim=True)
    has_slope = s2 > 0
    mu_flat = torch.where(hi < float("inf"), hi, lo)
    mu = torch.where(has_slope, s1 / torch.where(has_slope, s2, 1.0), mu_flat)
    mu = torch.maximum(torch.minimum(mu, hi), lo)  # rounding in locating the piece cannot push μ out
    v = torch.relu(x - mu * a)
    return _to_output(torch.where(has_adv, v, x), w.dtype)


def truncate_rebalance(w: torch.Tensor, advantages: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """Truncate-and-Rebalance (eq. 52–55), the paper's closed-form stand-in for eq. 51.

    s⁺ = max(w, floor); δ = Âᵀs⁺ = M_P − M_N with M_P = Σ_P Â_i s⁺_i, M_N = Σ_N (−Â_i) s⁺_i.
    δ > 0: the positive-advantage side is scaled by α = M_N / M_P; δ < 0: the negative side by
    β = M_P / M_N; δ = 0: s⁺. Zero-advantage members are never scaled. Eq. 55 prints
    β = −Σ_P Â_i s⁺_i / Σ_N (−Â_i) s⁺_i, which is negative; the positive β used here is the factor
    that gives Âᵀs̃ = 0 (docs/design.md). α, β lie in (0, 1) when both sides are non-empty and are 0
    when the opposite side is empty (the only scaling that reaches orthogonality).

    ``floor`` (default 1e-6) only matters for weights ≤ floor; s̄ = exp(·) > 0, so it mostly guards
    generic inputs and keeps φ = s̃/s̄ well defined. The paper's claim "s̃ ⪰ ϵ" is false: after scaling
    by α or β < 1, scaled members can fall below ``floor``. The result is ≥ 0 and orthogonal to Â.
    """
    _check_groups(w, advantages)
    if not (floor >= 0 and floor < float("inf")):
        raise ValueError(f"truncate_floor must be a finite number >= 0, got {floor}")
    dtype = _compute_dtype(w, advantages)
    x = _sanitize_weights(w, dtype)
    a, _ = _normalized_advantages(advantages, dtype)
    s_plus = x.clamp(min=floor)
    pos = a > 0
    neg = a < 0
    zeros = torch.zeros_like(s_plus)
    mass_p = torch.where(pos, a * s_plus, zeros).sum(dim=-1, keepdim=True)
    mass_n = torch.where(neg, -a * s_plus, zeros).sum(dim=-1, keepdim=True)
    ones = torch.ones_like(mass_p)
    alpha = mass_n / torch.where(mass_p > 0, mass_p, ones)
    beta = mass_p / torch.where(mass_n > 0, mass_n, ones)
    factor = torch.where(
        mass_p > mass_n,
        torch.where(pos, alpha, torch.ones_like(s_plus)),
        torch.where(mass_p < mass_n, torch.where(neg, beta, torch.ones_like(s_plus)), torch.ones_like(s_plus)),
    )
    return _to_output(s_plus * factor, w.dtype)


def scale(w: torch.Tensor, advantages: torch.Tensor, factor: float = 0.5) -> torch.Tensor:
    """Global scaling s̃ = factor · w, the "DFPO (scale by 0.5)" ablation of Table 3.

    It shrinks updates without any in-group consistency, to separate "smaller steps" from the
    cancellation effect. ``advantages`` is unused.
    """
    _check_groups(w, advantages)
    if not (factor >= 0 and factor < float("inf")):
        raise ValueError(f"scale_factor must be a finite number >= 0, got {factor}")
    x = _sanitize_weights(w, _compute_dtype(w, advantages))
    return _to_output(x * factor, w.dtype)


class GroupTransform(NamedTuple):
    """One in-group transform of the registry: its name, its function of (w, Â, scale_factor, truncate_floor)
    on (num_groups, G) tensors, whether it has a balance condition Σ_i a_i s̃_i = 0 (that
    ``cancellation_target="gradient"`` can retarget, eq. C1), and the equation it implements."""

    name: str
    apply: Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]
    balances: bool
    source: str


def _identity(w: torch.Tensor, advantages: torch.Tensor, _scale: float, _floor: float) -> torch.Tensor:
    _check_groups(w, advantages)
    return w  # no sanitization: GSPO exactly


#: The one registry of transforms: config validation, the objective plan, the docs test and the tests read it.
TRANSFORMS: dict[str, GroupTransform] = {
    t.name: t
    for t in (
        GroupTransform("none", _identity, False, "GSPO, eq. 49"),
        GroupTransform("min_replace", lambda w, a, _s, _f: min_replace(w, a), True, "eq. 50"),
        GroupTransform("orth_proj", lambda w, a, _s, _f: orth_proj(w, a), True, "eq. 18"),
        GroupTransform("positive_orth_proj", lambda w, a, _s, _f: positive_orth_proj(w, a), True,
                       "exact QP of eq. 51"),
        GroupTransform("truncate_rebalance", lambda w, a, _s, floor: truncate_rebalance(w, a, floor=floor), True,
                       "eq. 52-55"),
        GroupTransform("scale", lambda w, a, factor, _f: scale(w, a, factor=factor), False, "Table 3 ablation"),
    )
}
GROUP_TRANSFORMS: tuple[str, ...] = tuple(TRANSFORMS)


def get_transform(transform: str | GroupTransform) -> GroupTransform:
    """The registry entry of ``transform``: a name of :data:`TRANSFORMS`, or an entry, returned as it is."""
    if isinstance(transform, GroupTransform):
        return transform
    entry = TRANSFORMS.get(transform)
    if entry is None:
        raise ValueError(f"unknown group transform name={transform!r}; valid names: {', '.join(GROUP_TRANSFORMS)}")
    return entry


def apply_group_transform(
    name: str | GroupTransform,
    w: torch.Tensor,
    advantages: torch.Tensor,
    *,
    scale_factor: float = 0.5,
    truncate_floor: float = 1e-6,
) -> torch.Tensor:
    """Apply the in-group transform ``name`` of :data:`TRANSFORMS` (docs/design.md) to ``w`` shaped (num_groups, G).

    ``none`` returns ``w`` itself (no sanitization), so it reproduces GSPO exactly.
    """
    return get_transform(name).apply(w, advantages, scale_factor, truncate_floor)
