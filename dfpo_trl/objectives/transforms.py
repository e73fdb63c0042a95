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

The registry (:data:`TRANSFORMS`) holds the built-ins and what users add with :func:`register_transform`, each
with the properties the objective reads: its balance condition (:data:`BALANCE_CONDITIONS`), whether its weights
stay non-negative, and its balanced form on the clip survivors for ``cancellation_target="gradient"``. A registered
function gets the numerics above around it (sanitised inputs, w's dtype out; docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..precision import compute_dtype as _compute_dtype

__all__ = [
    "BALANCE_CONDITIONS",
    "BALANCE_EQUAL",
    "BALANCE_NONE",
    "BALANCE_ZERO_SUM",
    "GROUP_TRANSFORMS",
    "TRANSFORMS",
    "GroupFunction",
    "GroupTransform",
    "SubsetBalance",
    "W_MAX",
    "apply_group_transform",
    "get_transform",
    "min_replace",
    "min_replace_on_subset",
    "orth_proj",
    "positive_orth_proj",
    "probe_problem",
    "register_transform",
    "registered_transforms",
    "scale",
    "truncate_rebalance",
    "unregister_transform",
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


# --------------------------------------------------------------------------------------------------
# The registry: built-in and user-registered transforms (docs/extending.md)
# --------------------------------------------------------------------------------------------------

#: No balance condition (GSPO's ``none``, the ``scale`` ablation): ``cancellation_target="gradient"`` refuses it.
BALANCE_NONE = "none"
#: Σ_i Â_i s̃_i = 0 for every advantage vector with both signs, centred or not, so the gradient target can run the
#: transform on a_i = Â_i c_i 1[i ∈ U] instead of Â (eq. C1): Orth-Proj, Positive Orth-Proj, Truncate-and-Rebalance.
BALANCE_ZERO_SUM = "zero_sum"
#: s̃ is one value per group, so Σ_i Â_i s̃_i = s̃ Σ_i Â_i = 0 because TRL centres Â in each group (Min-Replace,
#: eq. 50). The a_i do not sum to 0, so the gradient target needs the transform's own ``subset_balance``.
BALANCE_EQUAL = "equal"
BALANCE_CONDITIONS: tuple[str, ...] = (BALANCE_NONE, BALANCE_ZERO_SUM, BALANCE_EQUAL)

#: A group function as users write it: (w, Â), both (num_groups, G), to s̃ of the same shape.
GroupFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: A transform's balanced form on the survivors U for ``cancellation_target="gradient"``: (w, a, members) → s̃,
#: with Σ_{i∈U} a_i s̃_i = 0 for two-sided U and s̃_i = w_i outside U (as :func:`min_replace_on_subset`).
SubsetBalance = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GroupTransform(NamedTuple):
    """One entry of the registry: what the objective, the config checks and the metrics read about a transform.

    ``apply`` takes (w, Â, scale_factor, truncate_floor) on (num_groups, G) tensors; ``balance`` is one of
    :data:`BALANCE_CONDITIONS`; ``nonnegative``: s̃ ≥ 0 whenever w > 0 (otherwise the gradient target hands TRL
    the rows whose φ < 0 in the score representation, docs/cancellation.md); ``subset_balance``: the balanced
    form on U that the gradient target uses instead of running ``apply`` on a; ``source`` the equation (or who
    registered it); ``builtin``: shipped with dfpo_trl."""

    name: str
    apply: Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]
    balance: str
    source: str
    nonnegative: bool = True
    subset_balance: SubsetBalance | None = None
    builtin: bool = False

    @property
    def balances(self) -> bool:
        """Whether the transform guarantees Σ_i Â_i s̃_i = 0 (the condition that restores cancellation)."""
        return self.balance != BALANCE_NONE

    @property
    def retargetable(self) -> bool:
        """Whether ``cancellation_target="gradient"`` can balance a instead of Â with it (eq. C1)."""
        return self.balance == BALANCE_ZERO_SUM or (self.balances and self.subset_balance is not None)


def _identity(w: torch.Tensor, advantages: torch.Tensor, _scale: float, _floor: float) -> torch.Tensor:
    _check_groups(w, advantages)
    return w  # no sanitization: GSPO exactly


_BUILTINS: dict[str, GroupTransform] = {
    t.name: t
    for t in (
        GroupTransform("none", _identity, BALANCE_NONE, "GSPO, eq. 49", builtin=True),
        GroupTransform("min_replace", lambda w, a, _s, _f: min_replace(w, a), BALANCE_EQUAL, "eq. 50",
                       subset_balance=min_replace_on_subset, builtin=True),
        GroupTransform("orth_proj", lambda w, a, _s, _f: orth_proj(w, a), BALANCE_ZERO_SUM, "eq. 18",
                       nonnegative=False, builtin=True),
        GroupTransform("positive_orth_proj", lambda w, a, _s, _f: positive_orth_proj(w, a), BALANCE_ZERO_SUM,
                       "exact QP of eq. 51", builtin=True),
        GroupTransform("truncate_rebalance", lambda w, a, _s, floor: truncate_rebalance(w, a, floor=floor),
                       BALANCE_ZERO_SUM, "eq. 52-55", builtin=True),
        GroupTransform("scale", lambda w, a, factor, _f: scale(w, a, factor=factor), BALANCE_NONE,
                       "Table 3 ablation", builtin=True),
    )
}
#: The one registry of transforms, built-in and registered (:func:`register_transform`): config validation, the
#: objective plan, the CLI help and the tests read it when they run, never a copy taken at import.
TRANSFORMS: dict[str, GroupTransform] = dict(_BUILTINS)
#: The built-in names, in the order the docs list them (the registry now: :func:`registered_transforms`).
GROUP_TRANSFORMS: tuple[str, ...] = tuple(_BUILTINS)


def registered_transforms() -> tuple[str, ...]:
    """Every name ``group_transform`` accepts now: the built-ins, then the registered ones in registration order."""
    return tuple(TRANSFORMS)


def get_transform(transform: str | GroupTransform) -> GroupTransform:
    """The registry entry of ``transform``: a registered name, or an entry, returned as it is."""
    if isinstance(transform, GroupTransform):
        return transform
    entry = TRANSFORMS.get(transform) if isinstance(transform, str) else None
    if entry is None:
        raise ValueError(
            f"unknown group transform name={transform!r}; valid names: {', '.join(registered_transforms())} "
            "(register others with dfpo_trl.register_transform)"
        )
    return entry


def apply_group_transform(
    name: str | GroupTransform,
    w: torch.Tensor,
    advantages: torch.Tensor,
    *,
    scale_factor: float = 0.5,
    truncate_floor: float = 1e-6,
) -> torch.Tensor:
    """Apply the in-group transform ``name`` of the registry (docs/design.md) to ``w`` shaped (num_groups, G).

    ``none`` returns ``w`` itself (no sanitization), so it reproduces GSPO exactly.
    """
    return get_transform(name).apply(w, advantages, scale_factor, truncate_floor)


def register_transform(
    name: str,
    fn: GroupFunction | None = None,
    *,
    balances: str,
    nonnegative: bool = True,
    subset_balance: SubsetBalance | None = None,
    source: str | None = None,
    replace: bool = False,
    check: bool = True,
) -> GroupFunction | Callable[[GroupFunction], GroupFunction]:
    """Register ``fn(w, advantages) -> s̃`` as the in-group transform ``name`` (docs/extending.md); returns ``fn``.

    A decorator (``@register_transform("name", balances="zero_sum")``) or a call (``register_transform("name", fn,
    balances=...)``). ``fn`` gets both (num_groups, G) tensors as the built-ins do after their sanitisation: w with
    NaN/±Inf replaced and clamped to ±:data:`W_MAX`, Â with NaN → 0, both float32 (float64 when an input is), and
    its result is cast back to w's dtype. It runs under stop-gradient (differentiated only by the
    ``transform_stop_gradient=False`` ablation), so it must be built from torch ops, with no host synchronisation.

    ``balances`` is the condition ``fn`` guarantees, one of :data:`BALANCE_CONDITIONS`: ``"none"``,
    ``"zero_sum"`` (Σ_i Â_i s̃_i = 0 for any two-sided Â) or ``"equal"`` (one weight per group). ``nonnegative``:
    s̃ ≥ 0 whenever w > 0. ``subset_balance``: the balanced form on the clip survivors for
    ``cancellation_target="gradient"`` (needed there by ``"equal"``). ``replace=True`` replaces a registered name
    or a built-in (:func:`unregister_transform` restores it). ``check`` runs ``fn`` once on a probe batch and
    refuses a declared property it breaks there; the ``transform/orth_residual`` metric shows the rest.
    """
    if fn is None:
        return lambda f: register_transform(
            name, f, balances=balances, nonnegative=nonnegative, subset_balance=subset_balance, source=source,
            replace=replace, check=check,
        )
    _check_name(name, replace)
    if not callable(fn):
        raise TypeError(f"register_transform({name!r}, fn): fn must be callable (w, advantages) -> weights, got "
                        f"{type(fn).__name__}")
    entry = GroupTransform(
        name, _user_apply(name, fn), balances, source or f"registered: {_qualified(fn)}", nonnegative,
        None if subset_balance is None else _user_subset(name, subset_balance),
    )
    _check_properties(entry, subset_balance)
    if check:
        problem = probe_problem(entry)
        if problem is not None:
            raise ValueError(f"register_transform({name!r}): {problem}")
    TRANSFORMS[name] = entry
    return fn


def unregister_transform(name: str) -> None:
    """Remove the registered transform ``name``; a built-in it replaced comes back. Built-ins stay."""
    entry = TRANSFORMS.get(name)
    if entry is None:
        raise ValueError(f"unregister_transform({name!r}): no such transform; registered: "
                         f"{', '.join(registered_transforms())}")
    if entry.builtin:
        raise ValueError(f"unregister_transform({name!r}): {name!r} is built in and cannot be removed")
    if name in _BUILTINS:
        TRANSFORMS[name] = _BUILTINS[name]
    else:
        del TRANSFORMS[name]


def _qualified(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _check_name(name: Any, replace: bool) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"register_transform: name={name!r} is not a valid name; use a Python identifier such as "
            "'median_rebalance' (it is what group_transform and --group_transform take)"
        )
    if name == "none":
        raise ValueError("register_transform: 'none' is GSPO itself (no rewrite of the loss) and cannot be replaced; "
                         "choose another name")
    existing = TRANSFORMS.get(name)
    if existing is not None and not replace:
        what = "a built-in transform" if existing.builtin else f"already registered ({existing.source})"
        raise ValueError(
            f"register_transform: {name!r} is {what}; pass replace=True to replace it (unregister_transform "
            f"restores a built-in), or choose another name"
        )


def _check_properties(entry: GroupTransform, subset_balance: Any) -> None:
    name = entry.name
    if not isinstance(entry.balance, str) or entry.balance not in BALANCE_CONDITIONS:
        raise ValueError(
            f"register_transform({name!r}): balances={entry.balance!r} is not a balance condition; use 'zero_sum' "
            "(sum_i A_i w_i = 0 for any two-sided advantages), 'equal' (one weight per group, balanced because "
            "the advantages are centred) or 'none' (no condition)"
        )
    if not isinstance(entry.nonnegative, bool):
        raise ValueError(f"register_transform({name!r}): nonnegative={entry.nonnegative!r} must be True or False")
    if subset_balance is not None and not callable(subset_balance):
        raise TypeError(f"register_transform({name!r}): subset_balance must be callable (w, a, members) -> "
                        f"weights, got {type(subset_balance).__name__}")
    if subset_balance is not None and not entry.balances:
        raise ValueError(
            f"register_transform({name!r}): subset_balance is the balanced form for cancellation_target="
            "'gradient', but balances='none' declares no balance; declare the condition or drop subset_balance"
        )


def _check_output(name: str, out: Any, w: torch.Tensor) -> None:
    """A registered function's result: a floating tensor of w's shape on w's device (no silent copies)."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise TypeError(f"group transform {name!r} must return a floating-point tensor, got "
                        f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__}")
    if out.shape != w.shape or out.device != w.device:
        raise ValueError(
            f"group transform {name!r} returned shape {tuple(out.shape)} on {out.device} for w of shape "
            f"{tuple(w.shape)} on {w.device}; it must return one weight per member, shaped (num_groups, G) like w, "
            "on w's device"
        )


def _user_apply(name: str, fn: GroupFunction) -> Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]:
    """``fn`` with the built-ins' numerics around it (module docstring): sanitised inputs, w's dtype out."""

    def apply(w: torch.Tensor, advantages: torch.Tensor, _scale: float, _floor: float) -> torch.Tensor:
        _check_groups(w, advantages)
        dtype = _compute_dtype(w, advantages)
        out = fn(_sanitize_weights(w, dtype), torch.nan_to_num(advantages.to(dtype), nan=0.0))
        _check_output(name, out, w)
        return _to_output(out, w.dtype)

    return apply


def _user_subset(name: str, fn: SubsetBalance) -> SubsetBalance:
    def subset(w: torch.Tensor, a: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        _check_groups(w, a)
        dtype = _compute_dtype(w, a)
        out = fn(_sanitize_weights(w, dtype), torch.nan_to_num(a.to(dtype), nan=0.0), members)
        _check_output(f"{name}.subset_balance", out, w)
        return _to_output(out, w.dtype)

    return subset


# The probe of register_transform: a few groups like those training meets, including the degenerate one.
_PROBE_SEED, _PROBE_GROUPS = 20_604, 6
_PROBE_RELATIVE_TOLERANCE = 1e-4  # |Σ Â s̃| / Σ |Â s̃|: 840 float32 eps, far above the rounding of G terms


class _Probe(NamedTuple):
    w: torch.Tensor  # post-clip weights near 1, as off-policy s̄ are
    centred: torch.Tensor  # TRL's advantages: centred, both signs in every group but the last (all 0)
    a: torch.Tensor  # the gradient target's coefficients: centred Â x a positive factor c, 0 outside U
    survives: torch.Tensor  # U, two-sided in every group with signal


def _probe(group_size: int) -> _Probe:
    gen = torch.Generator().manual_seed(_PROBE_SEED + group_size)
    shape = (_PROBE_GROUPS, group_size)
    w = torch.exp(0.3 * torch.randn(shape, generator=gen))
    rewards = torch.randn(shape, generator=gen)
    rewards[:, 0] = rewards.amax(dim=-1) + 1.0  # the largest reward: above the mean, Â > 0
    rewards[:, 1] = rewards.amin(dim=-1) - 1.0  # the smallest: Â < 0, so every group (and U) has both signs
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    centred[-1] = 0.0  # uniform rewards
    survives = torch.rand(shape, generator=gen) > 0.25
    survives[:, :2] = True
    a = torch.where(survives, centred * (0.5 + torch.rand(shape, generator=gen)), 0.0)
    return _Probe(w, centred, a, survives)


def probe_problem(entry: GroupTransform) -> str | None:
    """What ``entry`` breaks of its declared properties on the probe batches (G = 2 and 5), or None.

    Checks a floating-point result of w's shape, finite where the inputs are, ≥ 0 when ``nonnegative``, and the
    declared balance: ``"zero_sum"`` on centred Â and on the gradient target's coefficients a, ``"equal"`` within
    every group, ``subset_balance`` Σ_U a_i s̃_i = 0. A probe is a first look, not a proof: the metrics
    (``transform/orth_residual``) watch training."""
    for group_size in (2, 5):
        probe = _probe(group_size)
        cases = [("", "centred advantages", entry.apply, (probe.w, probe.centred, 0.5, 1e-6), probe.centred)]
        if entry.balance == BALANCE_ZERO_SUM:  # claims Σ Â s̃ = 0 for uncentred coefficients too
            cases.append(("", "gradient coefficients a", entry.apply, (probe.w, probe.a, 0.5, 1e-6), probe.a))
        if entry.subset_balance is not None:  # Σ_U a_i s̃_i = 0 over the survivors (a = 0 outside them)
            cases.append(("subset_balance ", "gradient coefficients a and survivors U", entry.subset_balance,
                          (probe.w, probe.a, probe.survives), probe.a))
        for part, case, fn, args, adv in cases:
            where = f"on the probe's {case} (G = {group_size})"
            try:
                with torch.no_grad():
                    out = fn(*args)
            except Exception as exc:  # the user's function: report whatever it raised, and where
                return f"{part}raised {type(exc).__name__}: {exc} {where}"
            balance = BALANCE_ZERO_SUM if part else entry.balance
            problem = _result_problem(entry, out, probe.w, adv, where, balance)
            if problem is not None:
                return part + problem
    return None


def _result_problem(
    entry: GroupTransform, out: Any, w: torch.Tensor, adv: torch.Tensor, where: str, balance: str
) -> str | None:
    """What one probe result breaks of ``balance`` and the entry's other declarations, or None."""
    if not isinstance(out, torch.Tensor) or out.shape != w.shape:
        return f"returned {getattr(out, 'shape', type(out).__name__)} for w of shape {tuple(w.shape)} {where}"
    out = out.to(torch.float64)
    if not torch.isfinite(out).all():
        bad = (~torch.isfinite(out)).any(dim=-1).nonzero().flatten().tolist()
        degenerate = " (the group whose advantages are all 0)" if _PROBE_GROUPS - 1 in bad else ""
        return f"returned NaN or Inf in groups {bad}{degenerate} {where}"
    if entry.nonnegative and (out < 0).any():
        return (f"declares nonnegative=True but returned {out.min().item():.3g} {where}; declare nonnegative=False "
                "(the gradient target then hands TRL negative-weight rows in the score form)")
    adv = adv.to(torch.float64)
    if balance == BALANCE_ZERO_SUM:
        terms = adv * out
        residual = terms.sum(dim=-1).abs()
        allowed = _PROBE_RELATIVE_TOLERANCE * terms.abs().sum(dim=-1) + 1e-30
        if (residual > allowed).any():
            group = int((residual - allowed).argmax())
            claim = "must balance" if balance != entry.balance else "declares balances='zero_sum'"
            return (f"{claim} but |sum_i A_i w_i| = {residual[group].item():.3g} in group {group} {where}; fix "
                    "the function, or declare what it guarantees (balances='none' or 'equal')")
    if balance == BALANCE_EQUAL:
        spread = out.amax(dim=-1) - out.amin(dim=-1)
        allowed = _PROBE_RELATIVE_TOLERANCE * out.abs().amax(dim=-1) + 1e-30
        if (spread > allowed).any():
            group = int((spread - allowed).argmax())
            return (f"declares balances='equal' but the weights of group {group} span {spread[group].item():.3g} "
                    f"{where}; return one weight per group, or declare balances='zero_sum' or 'none'")
    return None
