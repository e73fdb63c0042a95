"""Gradient-exact cancellation (``cancellation_target="gradient"``): pure functions of per-sequence tensors.

The paper's transforms balance Σ_i Â_i s̃_i = 0 over the whole group. What cancels a token that every member
shares is the sum of the members' *gradient* coefficients on it. In TRL's sequence-level loss (ratio form,
J_i = Â_i φ_i s̄_i(θ)) member i contributes to a shared token t

    ∂L/∂ℓ_{i,t} ∝ Â_i s̃_i c_i 1[i ∈ U]

where U is the set of members whose gradient survives the sign-aware clip (eq. 44–47) and c_i the loss
aggregation's per-member factor (1/L_i under ``loss_type="grpo"``, 1 under the token-sum losses). So the
gradient cancels exactly when Σ_i a_i s̃_i = 0 with a_i = Â_i c_i 1[i ∈ U] (docs/cancellation.md, eq. C1).
This module computes c and a (U is :func:`~dfpo_trl.objectives.weights.clip_survivors`), and runs each transform
on a instead of Â, with members outside U kept at φ = 1 and Min-Replace replaced on U by its minimal-change
balanced version (eq. C4–C7).

Every function takes explicit tensors: per-row ``(B,)`` / ``(B, T)`` or per-group ``(num_groups, G)``; no
function infers groups from row order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .transforms import (
    TRANSFORMS,
    W_MAX,
    GroupTransform,
    _check_groups,
    _compute_dtype,
    _normalized_advantages,
    _sanitize_weights,
    _to_output,
    get_transform,
)

__all__ = [
    "BALANCING_TRANSFORMS",
    "CANCELLATION_TARGETS",
    "FACTOR_LOSS_TYPES",
    "ONE_SIDED_POLICIES",
    "SUBSET_BALANCES",
    "GroupSides",
    "aggregation_factor",
    "balance_group_weights",
    "transform_group_weights",
    "gradient_coefficients",
    "group_sides",
    "min_replace_on_subset",
]

CANCELLATION_TARGETS: tuple[str, ...] = ("weights", "gradient")
ONE_SIDED_POLICIES: tuple[str, ...] = ("keep", "zero")
# Transforms with a balance condition that "gradient" can retarget ("none" and "scale" have none): from the registry.
BALANCING_TRANSFORMS: tuple[str, ...] = tuple(name for name, t in TRANSFORMS.items() if t.balances)
# Loss types whose per-token coefficient carries the per-sequence mean's 1/L_i (TRL 1.16's "grpo").
_PER_SEQUENCE_MEAN_LOSSES = ("grpo",)
# Loss types normalised by the micro-batch's own token count (TRL 1.16's "bnpo").
_MICRO_BATCH_TOKEN_LOSSES = ("bnpo",)
# Token-sum losses with a normaliser shared by every row of a group.
_CONSTANT_FACTOR_LOSSES = ("dapo", "dr_grpo", "luspo")
#: TRL's clipped-surrogate loss types, each with a known aggregation factor c_i.
FACTOR_LOSS_TYPES: tuple[str, ...] = (*_PER_SEQUENCE_MEAN_LOSSES, *_MICRO_BATCH_TOKEN_LOSSES, *_CONSTANT_FACTOR_LOSSES)


def aggregation_factor(
    mask: torch.Tensor,
    loss_type: str,
    token_weights: torch.Tensor | None = None,
    micro_batch_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """c_i of eq. C3: the factor TRL's aggregation puts on member i's sequence term at each of its tokens.

    With sequence-level importance sampling ∂ρ_i/∂ℓ_{i,t} = 1/L_i, and member i's term enters the loss with the
    weight W_i = Σ_t m_{i,t} w_{i,t} (``token_weights`` w: TRL's vLLM importance-sampling ratio where it
    applies it, else 1) times the loss type's normaliser, so c_i = W_i / L_i × (1/L_i for ``"grpo"``,
    1/N_mb for ``"bnpo"`` with N_mb the micro-batch's token count, 1 for ``"dapo"``, ``"dr_grpo"``,
    ``"luspo"``, whose normalisers are shared by every row). Without ``token_weights`` W_i = L_i, so c is
    1/L_i, 1/N_mb or exactly 1. Rows with L_i = 0 get c_i = 0. ``mask`` is (B, T) (completion × tool mask);
    ``micro_batch_tokens`` is (B,) and required for ``"bnpo"``.
    """
    m = mask.to(torch.float64)
    lengths = m.sum(-1)
    weighted = lengths if token_weights is None else (m * token_weights.to(torch.float64)).sum(-1)
    per_length = weighted / lengths.clamp(min=1.0)
    if loss_type in _PER_SEQUENCE_MEAN_LOSSES:
        return per_length / lengths.clamp(min=1.0)
    if loss_type in _MICRO_BATCH_TOKEN_LOSSES:
        if micro_batch_tokens is None:
            raise ValueError("aggregation_factor for loss_type='bnpo' needs micro_batch_tokens (one count per row).")
        return per_length / micro_batch_tokens.to(torch.float64).clamp(min=1.0)
    if loss_type in _CONSTANT_FACTOR_LOSSES:
        return per_length
    raise ValueError(
        f"cancellation_target='gradient' has no aggregation factor for loss_type={loss_type!r}; use one of "
        f"{', '.join(repr(t) for t in FACTOR_LOSS_TYPES)}."
    )


def gradient_coefficients(advantages: torch.Tensor, factor: torch.Tensor, survives: torch.Tensor) -> torch.Tensor:
    """a_i = Â_i · c_i · 1[i ∈ U] (eq. C1): the coefficient a shared token's gradient gets per unit of s̃_i."""
    a = advantages.to(factor.dtype) * factor
    return torch.where(survives, a, torch.zeros_like(a))


class GroupSides(NamedTuple):
    """Per group (num_groups,) flags of eq. C8: which groups the gradient target can balance exactly."""

    has_signal: torch.Tensor  # some Â_i ≠ 0
    two_sided: torch.Tensor  # U holds both a positive and a negative a_i: an exact non-zero balance exists
    one_sided: torch.Tensor  # has_signal and not two_sided: no exact non-zero balance with one weight a member


def group_sides(advantages: torch.Tensor, a: torch.Tensor) -> GroupSides:
    """Classify groups by the signs of a over U (eq. C8). Inputs are (num_groups, G)."""
    _check_groups(advantages, a)
    has_signal = (torch.nan_to_num(advantages, nan=0.0) != 0).any(dim=-1)
    two_sided = (a > 0).any(dim=-1) & (a < 0).any(dim=-1)
    return GroupSides(has_signal, two_sided, has_signal & ~two_sided)


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
    handled here: see :func:`balance_group_weights`. Batched over groups, no Python loop, no host sync.
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


def balance_group_weights(
    transform: str | GroupTransform,
    s_bar: torch.Tensor,
    advantages: torch.Tensor,
    a: torch.Tensor,
    survives: torch.Tensor,
    one_sided: str = "keep",
    *,
    scale_factor: float = 0.5,
    truncate_floor: float = 1e-6,
) -> tuple[torch.Tensor, GroupSides]:
    """s̃ of ``cancellation_target="gradient"`` for (num_groups, G) tensors, and the groups' sides (eq. C8).

    ``transform`` is an entry of the registry (or its name). Two-sided groups: the transform runs on a instead of
    Â (Min-Replace: :func:`min_replace_on_subset`, see :data:`SUBSET_BALANCES`), members outside U keep s̄ (φ = 1),
    so Σ_i a_i s̃_i = 0. One-sided groups (signal, but U holds one sign of a, or none): ``"keep"`` gives the
    paper's ``"weights"`` result; ``"zero"`` gives s̃ = 0 to every member (exact cancellation, at the price of the
    group's update this step). Groups without signal keep the ``"weights"`` result (their policy gradient is 0
    either way).
    """
    transform = get_transform(transform)
    if not transform.balances:
        raise ValueError(
            f"cancellation_target='gradient' balances a transform's condition, but group_transform="
            f"{transform.name!r} has none; use one of {', '.join(repr(n) for n in BALANCING_TRANSFORMS)}."
        )
    if one_sided not in ONE_SIDED_POLICIES:
        raise ValueError(f"cancellation_one_sided={one_sided!r} is not valid; use 'keep' or 'zero'.")
    _check_groups(s_bar, advantages)
    sides = group_sides(advantages, a)
    by_weights = transform.apply(s_bar, advantages, scale_factor, truncate_floor)
    on_subset = SUBSET_BALANCES.get(transform.name)
    if on_subset is not None:
        by_gradient = on_subset(s_bar, a, survives)
    else:
        by_gradient = torch.where(survives, transform.apply(s_bar, a, scale_factor, truncate_floor), s_bar)
    two_sided = sides.two_sided.unsqueeze(-1)
    s_tilde = torch.where(two_sided, by_gradient, by_weights)
    if one_sided == "zero":
        s_tilde = torch.where(sides.one_sided.unsqueeze(-1), torch.zeros_like(s_tilde), s_tilde)
    return s_tilde, sides


#: Transforms whose balanced form on U is its own construction, not the transform run on a: Min-Replace's
#: minimal-change form (eq. C4–C7). The others run on a and keep s̄ outside U.
SUBSET_BALANCES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "min_replace": min_replace_on_subset,
}


def transform_group_weights(
    transform: str | GroupTransform,
    s_bar: torch.Tensor,
    advantages: torch.Tensor,
    survives: torch.Tensor,
    factor: torch.Tensor,
    target: str = "weights",
    one_sided: str = "keep",
    *,
    scale_factor: float = 0.5,
    truncate_floor: float = 1e-6,
) -> tuple[torch.Tensor, GroupSides]:
    """s̃ of the configured transform for (num_groups, G) tensors, and the groups' sides (eq. C8).

    ``transform``: an entry of the registry (or its name). ``target="weights"``: the paper's transform, balancing
    Σ_i Â_i s̃_i = 0; ``"gradient"``: it balances the coefficients a_i = Â_i c_i 1[i ∈ U] of the gradients that
    survive the clip (eq. C1, :func:`balance_group_weights`), with ``factor`` = c (eq. C3) and ``survives`` = U
    (eq. C2). The sides are reported under either target.
    """
    if target not in CANCELLATION_TARGETS:
        raise ValueError(f"cancellation_target={target!r} is not valid; use 'weights' or 'gradient'.")
    transform = get_transform(transform)
    a = gradient_coefficients(advantages.detach(), factor, survives)
    options = dict(scale_factor=scale_factor, truncate_floor=truncate_floor)
    if target == "gradient":
        return balance_group_weights(transform, s_bar, advantages, a, survives, one_sided, **options)
    by_weights = transform.apply(s_bar, advantages, scale_factor, truncate_floor)
    return by_weights, group_sides(advantages.detach(), a)
