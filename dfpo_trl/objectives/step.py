"""One loss micro-step's DFPO objective as one call: :func:`micro_step_objective`, tensors and whole groups in, TRL's
loss inputs, the weights and what the metrics need out (docs/README.md, "How a micro-step flows").

The group layout (``groups/``) only delivers whole groups, as :class:`WholeGroups`: an index into the micro-batch's
rows, the pre-pass values, or a gather that completes the groups across processes. Everything that computes is here
or below: s̄ and U (eq. 44–47, C2), c (eq. C3), the transform on (num_groups, G) (eq. 18, 50–55, C1), the rewrite
into TRL's inputs (objectives/rewrite.py). Nothing here reads a trainer, a config object or the metric store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..config.options import CLIPPED_LOSS_TYPES
from .cancellation import GroupSides, aggregation_factor, transform_group_weights
from .plan import ObjectivePlan
from .rewrite import LossInputs, rewrite_loss_inputs
from .weights import PostClipWeights, RowWeights, post_clip_weights

__all__ = [
    "ClipRange",
    "GatheredGroups",
    "GroupedWeights",
    "RowScalars",
    "StepObjective",
    "WholeGroups",
    "micro_step_objective",
    "clip_weights",
    "aggregation_factors",
    "scatter_from_groups",
    "transform_groups",
]


class ClipRange(NamedTuple):
    """TRL's clip settings as its loss reads them: ε_low, ε_high and the two-sided cap on the ratio of Â < 0 rows
    (TRL's ``args.delta``; None when off)."""

    eps_low: float
    eps_high: float
    two_sided_cap: float | None


class RowScalars(NamedTuple):
    """Per row (B,): s̄ (eq. 47), U (eq. C2, narrowed by TRL's off-policy mask) and c (eq. C3, float64): what a
    transform reads of a row besides Â, and what a gather moves."""

    s_bar: Tensor
    survives: Tensor
    factor: Tensor


class GatheredGroups(NamedTuple):
    """Rows completed across processes: the global row id, s̄, Â, U, c of every gathered row (N,), the
    (num_groups, G) index into them, and ``position`` (B,): where each of this micro-batch's rows sits among them."""

    row_ids: Tensor
    s_bar: Tensor
    advantages: Tensor
    survives: Tensor
    factor: Tensor
    index: Tensor
    position: Tensor


class WholeGroups(NamedTuple):
    """What the group layout delivers for one micro-batch. ``index``: (num_groups, G) into its rows when it holds
    whole groups; ``precomputed``: the pre-pass values at this optimizer step's θ (used first); ``gather``: completes
    the groups from every process's :class:`RowScalars` (when neither applies)."""

    index: Tensor | None = None
    precomputed: RowWeights | None = None
    gather: Callable[[RowScalars, Tensor], GatheredGroups] | None = None


class GroupedWeights(NamedTuple):
    """The transform of one set of whole groups: per row (:class:`RowWeights`), and the (num_groups, G) views of
    s̄, s̃ and Â with the groups' sides (eq. C8) that the group metrics read."""

    rows: RowWeights
    s_bar: Tensor
    s_tilde: Tensor
    advantages: Tensor
    sides: GroupSides


class StepObjective(NamedTuple):
    """What one micro-step's objective returns: TRL's loss inputs, the rows' weights (None: no sequence-level
    rewrite), the transformed groups (None when no transform ran here) and the (B,) sanitised flags (None when
    s̄ was not computed here) for the metrics."""

    loss_inputs: LossInputs
    weights: RowWeights | None
    grouped: GroupedWeights | None
    sanitised: Tensor | None


def scatter_from_groups(grouped: Tensor, index: Tensor) -> Tensor:
    """Inverse of ``x[index]``: put (num_groups, G, ...) values back into row order (B, ...)."""
    flat_index = index.reshape(-1)
    out = torch.empty((flat_index.numel(), *grouped.shape[2:]), dtype=grouped.dtype, device=grouped.device)
    out[flat_index] = grouped.reshape(flat_index.numel(), *grouped.shape[2:])
    return out


def clip_weights(
    plan: ObjectivePlan, logps: Tensor, old: Tensor, mask: Tensor, advantages: Tensor, clip: ClipRange,
    keep: Tensor | None,
) -> PostClipWeights:
    """s̄ and U of rows (eq. 44–47, C2; every row survives in the score form), U narrowed to the rows TRL's
    off-policy mask keeps.

    Args:
        logps: ℓ(θ) (B, T); differentiable when the no-stop-gradient ablation differentiates.
        old: the old log-probs TRL's loss reads (B, T), after the log-ratio bound.
        mask: the loss mask (B, T). advantages: Â (B,). clip: TRL's clip settings.
        keep: (B,) rows TRL's off-policy mask keeps (None: mask off).

    Returns:
        :class:`~dfpo_trl.objectives.weights.PostClipWeights` (B,) each.
    """
    weights = post_clip_weights(logps, old, mask, advantages, clip.eps_low, clip.eps_high, clip.two_sided_cap,
                                score_form=plan.form.score_form)
    return weights if keep is None else weights._replace(survives=weights.survives & keep)


def aggregation_factors(
    plan: ObjectivePlan, mask: Tensor, is_ratio: Tensor | None, micro_batch_tokens: Tensor
) -> Tensor:
    """c_i (eq. C3) of every row, (B,) float64; 1 for loss types without a known factor (no transform reaches them).

    Args:
        mask: the loss mask (B, T). is_ratio: TRL's vLLM importance-sampling ratio where its loss applies it.
        micro_batch_tokens: (B,) the loss tokens of each row's micro-batch (``loss_type="bnpo"``).
    """
    if plan.loss_type not in CLIPPED_LOSS_TYPES:
        return torch.ones(mask.size(0), dtype=torch.float64, device=mask.device)
    return aggregation_factor(mask, plan.loss_type, is_ratio, micro_batch_tokens)


def transform_groups(
    plan: ObjectivePlan, s_bar: Tensor, advantages: Tensor, survives: Tensor, factor: Tensor, index: Tensor
) -> GroupedWeights:
    """The configured transform on the (num_groups, G) view ``index`` of rows, balancing Â
    (``cancellation_target="weights"``) or a = Â c 1[U] (``"gradient"``, eq. C1).

    Args:
        s_bar, advantages, survives, factor: per row (N,). index: (num_groups, G) row indices, whole groups.

    Returns:
        :class:`GroupedWeights`: the rows' s̄, s̃, U and two-sided flags in row order, and the grouped views.
    """
    s_bar_g, adv_g, survives_g = s_bar[index], advantages[index].to(s_bar.dtype), survives[index]
    s_tilde_g, sides = transform_group_weights(
        plan.transform, s_bar_g, adv_g, survives_g, factor[index], plan.cancellation_target, plan.one_sided,
        scale_factor=plan.scale_factor, truncate_floor=plan.truncate_floor,
    )
    two_sided_g = sides.two_sided.unsqueeze(-1).expand_as(survives_g)
    rows = RowWeights(s_bar, scatter_from_groups(s_tilde_g, index), survives, scatter_from_groups(two_sided_g, index))
    return GroupedWeights(rows, s_bar_g, s_tilde_g, adv_g, sides)


def micro_step_objective(
    plan: ObjectivePlan, logps: Tensor, old: Tensor | None, advantages: Tensor, mask: Tensor, *, clip: ClipRange,
    groups: WholeGroups, off_policy_keep: Callable[..., Tensor] | None = None, sampling: Tensor | None = None,
    is_ratio: Tensor | None = None, token_weights: Tensor | None = None,
) -> StepObjective:
    """DFPO's objective of one loss micro-step, expressed in the inputs TRL's loss reads next.

    Args:
        plan: the objective as the config sets it.
        logps: ℓ(θ) (B, T) from the loss's policy forward, with its graph.
        old: the old log-probs (B, T) after the log-ratio bound; None on-policy (TRL uses sg(ℓ)).
        advantages: Â (B,). mask: the loss mask (B, T).
        clip: TRL's clip settings. groups: what the layout delivered (``WholeGroups()``: no group view).
        off_policy_keep: the (B,) rows TRL's off-policy mask keeps, of (Â, ℓ, old, ``sampling``, mask) (None: the
            mask is off); it narrows U. sampling: the sampler's log-probs (B, T), if any.
        is_ratio: TRL's applied vLLM importance-sampling ratio or None.
        token_weights: DelTA's λ̄ (B, T) when token weighting is on, else None.

    Returns:
        :class:`StepObjective`.
    """
    differentiate = plan.differentiates(groups.index is not None)
    weights = grouped = sanitised = None
    if plan.sequence_level and (groups.index is not None or plan.rewrites_sequences):
        if groups.precomputed is not None:
            weights = groups.precomputed
        else:
            current = logps if differentiate else logps.detach()
            read_old = logps.detach() if old is None else old
            with torch.set_grad_enabled(differentiate):
                keep = None if off_policy_keep is None else off_policy_keep(advantages, logps.detach(), read_old,
                                                                            sampling, mask)
                post_clip = clip_weights(plan, current, read_old, mask, advantages, clip, keep)
                factor = aggregation_factors(plan, mask, is_ratio, mask.sum().expand(mask.size(0)))
                rows = RowScalars(post_clip.s_bar, post_clip.survives, factor)
                sanitised = post_clip.sanitised
                if groups.index is not None:
                    grouped = transform_groups(plan, rows.s_bar, advantages, rows.survives, rows.factor, groups.index)
                    weights = grouped.rows
                else:  # the group's other members are on other processes in this micro-step
                    weights, grouped = _gathered_weights(plan, rows, advantages, groups)
    loss_inputs = rewrite_loss_inputs(logps, old, advantages, mask, plan.form, eps_high=clip.eps_high,
                                      weights=weights, differentiate=differentiate, token_weights=token_weights)
    return StepObjective(loss_inputs, weights, grouped, sanitised)


def _gathered_weights(
    plan: ObjectivePlan, rows: RowScalars, advantages: Tensor, groups: WholeGroups
) -> tuple[RowWeights, GroupedWeights]:
    """The rows' weights from groups completed across processes: transform every gathered group, keep ours."""
    if groups.gather is None:
        raise ValueError("The micro-batch holds no whole groups and the layout gave no gather to complete them.")
    gathered = groups.gather(rows, advantages)
    grouped = transform_groups(plan, gathered.s_bar, gathered.advantages, gathered.survives, gathered.factor,
                               gathered.index)
    position = gathered.position
    weights = RowWeights(rows.s_bar, grouped.rows.s_tilde[position].to(rows.s_bar.dtype), rows.survives,
                         grouped.rows.two_sided[position])
    return weights, grouped
