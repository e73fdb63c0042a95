"""Gradient-exact cancellation (``cancellation_target="gradient"``): pure functions of per-sequence tensors.

The paper's transforms balance Σ_i Â_i s̃_i = 0 over the whole group. What cancels a token that every member
shares is the sum of the members' *gradient* coefficients on it. In TRL's sequence-level loss (ratio form,
J_i = Â_i φ_i s̄_i(θ)) member i contributes to a shared token t

    ∂L/∂ℓ_{i,t} ∝ Â_i s̃_i c_i 1[i ∈ U]

where U is the set of members whose gradient survives the sign-aware clip (eq. 44–47) and c_i the loss
aggregation's per-member factor (1/L_i under ``loss_type="grpo"``, 1 under the token-sum losses). So the
gradient cancels exactly when Σ_i a_i s̃_i = 0 with a_i = Â_i c_i 1[i ∈ U] (docs/source/concepts/cancellation.md, eq.
C1). This module computes c and a (U is :func:`~dfpo_trl.objectives.weights.clip_survivors`), and runs each transform
on a instead of Â, with members outside U kept at φ = 1 and Min-Replace replaced on U by its minimal-change
balanced version (eq. C4–C7).

Every function takes explicit tensors: per-row ``(B,)`` / ``(B, T)`` or per-group ``(num_groups, G)``; no
function infers groups from row order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config.options import (
    AGGREGATION_CONSTANT,
    AGGREGATION_MICRO_BATCH_TOKENS,
    AGGREGATION_SEQUENCE_MEAN,
    CLIPPED_LOSS_TYPES,
    LOSS_TYPES,
    CancellationTarget,
    OneSidedPolicy,
)
from ..transforms import GroupTransform, get_transform, min_replace_on_subset, not_retargetable
from ..transforms.builtins import SCALE_FACTOR_DEFAULT, TRUNCATE_FLOOR_DEFAULT, _check_groups

__all__ = [
    "GroupSides",
    "aggregation_factor",
    "balance_group_weights",
    "transform_group_weights",
    "gradient_coefficients",
    "group_sides",
    "min_replace_on_subset",
]


def aggregation_factor(
    mask: torch.Tensor,
    loss_type: str,
    is_ratio: torch.Tensor | None = None,
    micro_batch_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """c_i of eq. C3: the factor TRL's aggregation puts on member i's sequence term at each of its tokens.

    With sequence-level importance sampling ∂ρ_i/∂ℓ_{i,t} = 1/L_i, and member i's term enters the loss with the
    weight W_i = Σ_t m_{i,t} w_{i,t} (``is_ratio`` w: TRL's vLLM importance-sampling ratio where it
    applies it, else 1) times the loss type's normaliser, so c_i = W_i / L_i × (1/L_i for ``"grpo"``,
    1/N_mb for ``"bnpo"`` with N_mb the micro-batch's token count, 1 for ``"dapo"``, ``"dr_grpo"``,
    ``"luspo"``, whose normalisers are shared by every row). Without ``is_ratio`` W_i = L_i, so c is
    1/L_i, 1/N_mb or exactly 1. Rows with L_i = 0 get c_i = 0. ``mask`` is (B, T) (completion × tool mask);
    ``micro_batch_tokens`` is (B,) and required for ``"bnpo"``.
    """
    m = mask.to(torch.float64)
    lengths = m.sum(-1)
    weighted = lengths if is_ratio is None else (m * is_ratio.to(torch.float64)).sum(-1)
    per_length = weighted / lengths.clamp(min=1.0)
    aggregation = LOSS_TYPES[loss_type].aggregation if loss_type in LOSS_TYPES else None  # options.py's table
    if aggregation == AGGREGATION_SEQUENCE_MEAN:
        return per_length / lengths.clamp(min=1.0)
    if aggregation == AGGREGATION_MICRO_BATCH_TOKENS:
        if micro_batch_tokens is None:
            raise ValueError(f"aggregation_factor for loss_type={loss_type!r} needs micro_batch_tokens (one count per "
                             "row).")
        return per_length / micro_batch_tokens.to(torch.float64).clamp(min=1.0)
    if aggregation == AGGREGATION_CONSTANT:
        return per_length
    raise ValueError(
        f"cancellation_target='gradient' has no aggregation factor for loss_type={loss_type!r}; use one of "
        f"{', '.join(repr(t) for t in CLIPPED_LOSS_TYPES)}."
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


def balance_group_weights(
    transform: str | GroupTransform,
    s_bar: torch.Tensor,
    advantages: torch.Tensor,
    a: torch.Tensor,
    survives: torch.Tensor,
    one_sided: OneSidedPolicy = "keep",
    *,
    scale_factor: float = SCALE_FACTOR_DEFAULT,
    truncate_floor: float = TRUNCATE_FLOOR_DEFAULT,
) -> tuple[torch.Tensor, GroupSides]:
    """s̃ of ``cancellation_target="gradient"`` for (num_groups, G) tensors, and the groups' sides (eq. C8).

    ``transform`` is an entry of the registry (or its name). Two-sided groups: the transform runs on a instead of
    Â, or its entry's ``subset_balance`` does (Min-Replace: :func:`min_replace_on_subset`); members outside U keep
    s̄ (φ = 1), so Σ_i a_i s̃_i = 0. One-sided groups (signal, but U holds one sign of a, or none): ``"keep"`` gives the
    paper's ``"weights"`` result; ``"zero"`` gives s̃ = 0 to every member (exact cancellation, at the price of the
    group's update this step). Groups without signal keep the ``"weights"`` result (their policy gradient is 0
    either way).
    """
    return _balanced(get_transform(transform), s_bar, advantages, a, survives, one_sided, scale_factor,
                     truncate_floor)


def _balanced(
    transform: GroupTransform, s_bar: torch.Tensor, advantages: torch.Tensor, a: torch.Tensor, survives: torch.Tensor,
    one_sided: OneSidedPolicy, scale_factor: float, truncate_floor: float,
) -> tuple[torch.Tensor, GroupSides]:
    """:func:`balance_group_weights` with the registry entry already looked up."""
    if not transform.retargetable:  # the config refuses this combination (config/combinations.py); a direct call too
        raise ValueError(not_retargetable(transform))
    _check_groups(s_bar, advantages)
    sides = group_sides(advantages, a)
    by_weights = transform.apply(s_bar, advantages, scale_factor, truncate_floor)
    if transform.subset_balance is not None:
        by_gradient = transform.subset_balance(s_bar, a, survives)
    else:
        by_gradient = torch.where(survives, transform.apply(s_bar, a, scale_factor, truncate_floor), s_bar)
    two_sided = sides.two_sided.unsqueeze(-1)
    s_tilde = torch.where(two_sided, by_gradient, by_weights)
    if one_sided == "zero":
        s_tilde = torch.where(sides.one_sided.unsqueeze(-1), torch.zeros_like(s_tilde), s_tilde)
    elif one_sided != "keep":  # options.OneSidedPolicy; the config validates it, so only a direct call gets here
        raise ValueError(f"cancellation_one_sided={one_sided!r} is not valid; use 'keep' or 'zero'.")
    return s_tilde, sides


def transform_group_weights(
    transform: GroupTransform,
    s_bar: torch.Tensor,
    advantages: torch.Tensor,
    survives: torch.Tensor,
    factor: torch.Tensor,
    target: CancellationTarget = "weights",
    one_sided: OneSidedPolicy = "keep",
    *,
    scale_factor: float = SCALE_FACTOR_DEFAULT,
    truncate_floor: float = TRUNCATE_FLOOR_DEFAULT,
) -> tuple[torch.Tensor, GroupSides]:
    """s̃ of the configured transform for (num_groups, G) tensors, and the groups' sides (eq. C8).

    ``transform``: an entry of the registry (:func:`~dfpo_trl.transforms.get_transform`, which the
    objective's plan looks up once). ``target="weights"``: the paper's transform, balancing
    Σ_i Â_i s̃_i = 0; ``"gradient"``: it balances the coefficients a_i = Â_i c_i 1[i ∈ U] of the gradients that
    survive the clip (eq. C1, :func:`balance_group_weights`), with ``factor`` = c (eq. C3) and ``survives`` = U
    (eq. C2). The sides are reported under either target.
    """
    a = gradient_coefficients(advantages.detach(), factor, survives)
    if target == "gradient":
        return _balanced(transform, s_bar, advantages, a, survives, one_sided, scale_factor, truncate_floor)
    if target != "weights":  # options.CancellationTarget; the config validates it, so only a direct call gets here
        raise ValueError(f"cancellation_target={target!r} is not valid; use 'weights' or 'gradient'.")
    by_weights = transform.apply(s_bar, advantages, scale_factor, truncate_floor)
    return by_weights, group_sides(advantages.detach(), a)
