"""The math of the built-in in-group transforms of the sequence-level weights (DFPO, arXiv 2604.13088, Appendix B).

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

The registry that names them, with the properties the objective reads, is :mod:`dfpo_trl.transforms`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..precision import compute_dtype as _compute_dtype

# The valid ranges of the two constants, one definition for the math below and the config's checks.
SCALE_FACTOR_RULE = (
    "must be a finite number > 0 (the factor κ of the 'scale' ablation: 0 drops every update, a negative κ "
    "reverses it)"
)
#: The defaults of ``scale``'s κ and ``truncate_rebalance``'s ϵ, here once: ``DFPOConfig``'s ``transform_scale`` and
#: ``transform_truncate_floor`` default to them (the config imports the transforms, never the reverse).
SCALE_FACTOR_DEFAULT: float = 0.5
TRUNCATE_FLOOR_DEFAULT: float = 1e-6
SCALE_FACTOR_FIX = "the paper uses 0.5"
TRUNCATE_FLOOR_RULE = (
    "must be in (0, 1) (a floor far below the weights, which are 1 on-policy: a floor >= 1 would replace them)"
)
TRUNCATE_FLOOR_FIX = "the default is 1e-6"


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def valid_scale_factor(factor: Any) -> bool:
    """Whether κ of the ``"scale"`` ablation (Table 3) is usable: a finite number > 0."""
    return _real(factor) and factor > 0


def valid_truncate_floor(floor: Any) -> bool:
    """Whether ϵ of Truncate-and-Rebalance (eq. 52) is usable: in (0, 1), an underflow guard below the on-policy
    weight 1."""
    return _real(floor) and 0 < floor < 1

__all__ = [
    "SCALE_FACTOR_DEFAULT",
    "SCALE_FACTOR_FIX",
    "SCALE_FACTOR_RULE",
    "TRUNCATE_FLOOR_DEFAULT",
    "TRUNCATE_FLOOR_FIX",
    "TRUNCATE_FLOOR_RULE",
    "W_MAX",
    "min_replace",
    "min_replace_on_subset",
    "orth_proj",
    "positive_orth_proj",
    "scale",
    "truncate_rebalance",
    "valid_scale_factor",
    "valid_truncate_floor",
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

    Args:
        w: (num_groups, G) post-clip sequence weights s̄.
        advantages: (num_groups, G) Â.

    Returns:
        s̃ (num_groups, G), ``w``'s dtype.
    """
    _check_groups(w, advantages)
    x = _sanitize_weights(w, _compute_dtype(w, advantages))
    return _to_output(x.amin(dim=-1, keepdim=True).expand_as(x), w.dtype)


def orth_proj(w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Orth-Proj (eq. 18): s̃ = w − (Âᵀw / ‖Â‖²) Â, the closest vector to w orthogonal to Â.

    Groups with no advantage (‖Â‖ ≈ 0) are returned unchanged. Entries may become negative; use
    :func:`positive_orth_proj` when that matters.

    Args:
        w: (num_groups, G) post-clip sequence weights s̄.
        advantages: (num_groups, G) Â.

    Returns:
        s̃ (num_groups, G), ``w``'s dtype.
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
    (sanitized). Its cost on the GPU: docs/source/concepts/decisions.md, "Numerics".

    Args:
        w: (num_groups, G) post-clip sequence weights s̄.
        advantages: (num_groups, G) Â.

    Returns:
        s̃ (num_groups, G), ``w``'s dtype.
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


def truncate_rebalance(
    w: torch.Tensor, advantages: torch.Tensor, floor: float = TRUNCATE_FLOOR_DEFAULT
) -> torch.Tensor:
    """Truncate-and-Rebalance (eq. 52–55), the paper's closed-form stand-in for eq. 51.

    s⁺ = max(w, floor); δ = Âᵀs⁺ = M_P − M_N with M_P = Σ_P Â_i s⁺_i, M_N = Σ_N (−Â_i) s⁺_i.
    δ > 0: the positive-advantage side is scaled by α = M_N / M_P; δ < 0: the negative side by
    β = M_P / M_N; δ = 0: s⁺. Zero-advantage members are never scaled. Eq. 55 prints
    β = −Σ_P Â_i s⁺_i / Σ_N (−Â_i) s⁺_i, which is negative; the positive β used here is the factor
    that gives Âᵀs̃ = 0 (docs/source/concepts/design.md). α, β lie in (0, 1) when both sides are non-empty and are 0
    when the opposite side is empty (the only scaling that reaches orthogonality).

    ``floor`` (default 1e-6) only matters for weights ≤ floor; s̄ = exp(·) > 0, so it mostly guards
    generic inputs and keeps φ = s̃/s̄ well defined. The paper's claim "s̃ ⪰ ϵ" is false: after scaling
    by α or β < 1, scaled members can fall below ``floor``. The result is ≥ 0 and orthogonal to Â.

    Args:
        w: (num_groups, G) post-clip sequence weights s̄.
        advantages: (num_groups, G) Â.
        floor: ϵ of eq. 52, in (0, 1) (:func:`valid_truncate_floor`).

    Returns:
        s̃ (num_groups, G), ``w``'s dtype.
    """
    _check_groups(w, advantages)
    if not valid_truncate_floor(floor):
        raise ValueError(f"truncate_floor={floor!r} {TRUNCATE_FLOOR_RULE}; {TRUNCATE_FLOOR_FIX}")
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


def scale(w: torch.Tensor, advantages: torch.Tensor, factor: float = SCALE_FACTOR_DEFAULT) -> torch.Tensor:
    """Global scaling s̃ = factor · w, the "DFPO (scale by 0.5)" ablation of Table 3.

    It shrinks updates without any in-group consistency, to separate "smaller steps" from the
    cancellation effect. ``advantages`` is unused.

    Args:
        w: (num_groups, G) post-clip sequence weights s̄.
        advantages: (num_groups, G) Â, unused (shape-checked).
        factor: κ > 0 (:func:`valid_scale_factor`).

    Returns:
        s̃ (num_groups, G), ``w``'s dtype.
    """
    _check_groups(w, advantages)
    if not valid_scale_factor(factor):
        raise ValueError(f"scale_factor={factor!r} {SCALE_FACTOR_RULE}; {SCALE_FACTOR_FIX}")
    x = _sanitize_weights(w, _compute_dtype(w, advantages))
    return _to_output(x * factor, w.dtype)


def min_replace_on_subset(w: torch.Tensor, a: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Min-Replace balanced on a subset (eq. C4–C7): the closest vector to Min-Replace's output that cancels.

    On the members U (``members``), Min-Replace gives every member m = min_{i∈U} w_i, and Σ_U a_i m = m Σ_U a_i
    is not 0 when the a_i do not sum to 0 over U. The construction is the exact solution of

        min ½‖v − m 1‖²  s.t.  Σ_{i∈U} a_i v_i = 0,  0 ≤ v_i ≤ m   (i ∈ U)            (C4)

    the smallest change to Min-Replace that balances the coefficients and, like Min-Replace, never raises a
    weight above the group minimum (φ ≤ 1). KKT gives v_i = clip(m − μ a_i, 0, m). If D = Σ_U a_i > 0
    (μ > 0), the negative ("light") side stays at m and the positive ("heavy") side is lowered to
    v_i = m max(1 − t a_i, 0), t = μ/m, with t the root of the decreasing, piecewise-linear

        h(t) = Σ_{heavy} a_i max(1 − t a_i, 0) = M_light = Σ_{light} |a_i|,              (C5)

    located between the breakpoints 1/a_i and solved exactly on its linear piece (C6); D < 0 mirrors it.
    D = 0 gives t = 0, i.e. Min-Replace itself (C7). Members outside U are returned unchanged (φ = 1),
    zero-a members of U get m. Groups whose U is one-sided or empty (no exact non-zero balance) are not
    handled here: see :func:`~dfpo_trl.objectives.cancellation.balance_group_weights`. Batched over groups, no
    Python loop, no host sync.

    Args:
        w: (num_groups, G) s̄.
        a: (num_groups, G) the gradient coefficients a = Â c 1[U] (eq. C1).
        members: (num_groups, G) bool, the clip survivors U.

    Returns:
        s̃ (num_groups, G), ``w``'s dtype; ``w`` outside U.
    """
    _check_groups(w, a)
    if members.shape != w.shape:
        raise ValueError(f"members must be shaped like w {tuple(w.shape)}, got {tuple(members.shape)}")
    dtype = _compute_dtype(w, a)
    x = _sanitize_weights(w, dtype)
    b, _ = _normalized_advantages(torch.where(members, a, torch.zeros_like(a)), dtype)
    m = torch.where(members, x, torch.full_like(x, W_MAX)).amin(dim=-1, keepdim=True)
    direction = torch.where(b.sum(dim=-1, keepdim=True) >= 0, 1.0, -1.0).to(dtype)
    b = b * direction  # now the heavy side has b > 0
    heavy_b = torch.where(members & (b > 0), b, torch.zeros_like(b))
    light_mass = torch.where(members & (b < 0), -b, torch.zeros_like(b)).sum(dim=-1, keepdim=True)
    sorted_b = heavy_b.sort(dim=-1, descending=True).values  # non-heavy zeros go last
    # Suffix sums over the sorted heavy side: active set "positions >= k" has S1[k] = Σ b, S2[k] = Σ b².
    s1 = sorted_b.flip(-1).cumsum(-1).flip(-1)
    s2 = (sorted_b * sorted_b).flip(-1).cumsum(-1).flip(-1)
    # h at the breakpoint t_k = 1/b_(k): the members after k are the active ones (ties contribute 0).
    next_s1 = torch.cat((s1[..., 1:], torch.zeros_like(s1[..., :1])), dim=-1)
    next_s2 = torch.cat((s2[..., 1:], torch.zeros_like(s2[..., :1])), dim=-1)
    breakpoints = 1.0 / torch.where(sorted_b > 0, sorted_b, torch.ones_like(sorted_b))
    h_at = torch.where(sorted_b > 0, next_s1 - breakpoints * next_s2, torch.zeros_like(sorted_b))
    k = (h_at > light_mass).sum(dim=-1, keepdim=True)  # h > M_light at the first k breakpoints: root after them
    k = k.clamp(max=sorted_b.shape[-1] - 1)
    piece_s1, piece_s2 = s1.gather(-1, k), s2.gather(-1, k)
    t = (piece_s1 - light_mass) / torch.where(piece_s2 > 0, piece_s2, torch.ones_like(piece_s2))
    t = t.clamp(min=0.0)
    lowered = m * torch.clamp(1.0 - t * b, min=0.0)
    v = torch.where(b > 0, lowered, m.expand_as(x))
    return _to_output(torch.where(members, v, x), w.dtype)
