"""DFPO's objective of a set of rows as one function, :func:`objective_values`, and the loss micro-step built on it,
:func:`micro_step_objective` (docs/source/concepts/architecture.md, "How a micro-step flows").

:func:`objective_values` turns rows (ℓ(θ), the old log-probs, Â, the loss mask) and the whole groups the layout
delivers into the rows' sequence weights, the transformed groups and what the metrics read: the old log-probs bounded
(eq. 44), s̄ and U (eq. 44–47, C2), c (eq. C3), the transform on (num_groups, G) (eq. 18, 50–55, C1). The loss
micro-step and the pre-pass (groups/prepass.py) both call it. :func:`micro_step_objective` adds what only a loss call
needs: the ratios TRL's clip removes (for the clip fractions and diagnostics) and the rewrite into TRL's loss inputs
(objectives/rewrite.py).

The group layout (``groups/``) only delivers whole groups, as :class:`WholeGroups`: an index into the rows, the
pre-pass values, or a gather that completes the groups across processes. Nothing here reads a trainer, a config
object or the metric store.
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
from .weights import ClippedRatios, RowWeights, bounded_old_logps, clipped_ratios, post_clip_weights

__all__ = [
    "GatheredGroups",
    "GroupedWeights",
    "ObjectiveValues",
    "RowScalars",
    "StepObjective",
    "TRLLoss",
    "WholeGroups",
    "micro_step_objective",
    "objective_values",
]


class TRLLoss(NamedTuple):
    """TRL's loss settings as its loss reads them at this call: ε_low, ε_high, the two-sided cap on the ratio of
    Â < 0 rows (TRL's ``args.delta``; None when off) and the (B,) rows TRL's off-policy mask keeps, of (Â, ℓ, old,
    the sampler's log-probs or None, mask) (None: the mask is off)."""

    eps_low: float
    eps_high: float
    two_sided_cap: float | None
    off_policy_keep: Callable[..., Tensor] | None = None


class RowScalars(NamedTuple):
    """Per row (B,): s̄ (eq. 47), U (eq. C2, narrowed by TRL's off-policy mask) and c (eq. C3, float64): what a
    transform reads of a row besides Â, and what a gather moves."""

    s_bar: Tensor
    survives: Tensor
    factor: Tensor


class GatheredGroups(NamedTuple):
    """Rows completed across processes: the global row id, s̄, Â, U, c of every gathered row (N,), the
    (num_groups, G) index into them, and ``position`` (B,): where each of the caller's rows sits among them."""

    row_ids: Tensor
    s_bar: Tensor
    advantages: Tensor
    survives: Tensor
    factor: Tensor
    index: Tensor
    position: Tensor


class WholeGroups(NamedTuple):
    """What the group layout delivers for a set of rows. ``index``: (num_groups, G) into the rows when they hold
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


class ObjectiveValues(NamedTuple):
    """What :func:`objective_values` returns: the old log-probs bounded as TRL's loss must read them (None
    on-policy); the rows' weights (None: no sequence-level rewrite); the transformed groups (None when no transform ran
    here) and, when a gather completed them, the global row ids of ``grouped.rows`` (else None: the rows' own order);
    the (B,) sanitised flags (None when s̄ was not computed here)."""

    old: Tensor | None
    weights: RowWeights | None
    grouped: GroupedWeights | None
    row_ids: Tensor | None
    sanitised: Tensor | None


class StepObjective(NamedTuple):
    """What one loss micro-step's objective returns: TRL's loss inputs, the :class:`ObjectiveValues`, the ratios
    TRL's clip removes (None when no metric counts them) and TRL's applied vLLM importance-sampling ratio (or None),
    the last two for the metrics."""

    loss_inputs: LossInputs
    values: ObjectiveValues
    clipped: ClippedRatios | None
    is_ratio: Tensor | None


def objective_values(
    plan: ObjectivePlan, logps: Tensor, old: Tensor | None, advantages: Tensor, mask: Tensor, groups: WholeGroups,
    trl: TRLLoss, *, sampling: Tensor | None = None, is_ratio: Tensor | None = None,
    micro_batch_tokens: Tensor | None = None,
) -> ObjectiveValues:
    """DFPO's sequence weights of a set of rows (the one place the objective is assembled).

    Args:
        plan: the objective as the config sets it.
        logps: ℓ(θ) (B, T); with its graph in a loss micro-step (the no-stop-gradient ablation differentiates).
        old: TRL's old log-probs (B, T) before the log-ratio bound; None on-policy (TRL uses sg(ℓ)).
        advantages: Â (B,). mask: the loss mask (B, T).
        groups: what the layout delivered (``WholeGroups()``: no group view). trl: TRL's loss settings.
        sampling: the sampler's log-probs (B, T), if any (TRL's off-policy mask reads them).
        is_ratio: TRL's vLLM importance-sampling ratio where its loss applies it (c of eq. C3).
        micro_batch_tokens: (B,) the loss tokens of each row's micro-batch (``loss_type="bnpo"``; default: the
            rows are one micro-batch).

    Returns:
        :class:`ObjectiveValues`.
    """
    if old is not None:  # docs/source/concepts/decisions.md, "Numerics": exp() never overflows, gradients unchanged
        old = bounded_old_logps(logps, old, mask, plan.sequence_level)
    if not plan.sequence_level or (groups.index is None and not plan.rewrites_sequences):
        return ObjectiveValues(old, None, None, None, None)
    if groups.precomputed is not None:
        return ObjectiveValues(old, groups.precomputed, None, None, None)
    differentiate = plan.differentiates(groups.index is not None)
    read_old = logps.detach() if old is None else old
    with torch.set_grad_enabled(differentiate):
        keep = None if trl.off_policy_keep is None else trl.off_policy_keep(advantages, logps.detach(), read_old,
                                                                            sampling, mask)
        post_clip = post_clip_weights(logps if differentiate else logps.detach(), read_old, mask, advantages,
                                      trl.eps_low, trl.eps_high, trl.two_sided_cap, score_form=plan.form.score_form)
        survives = post_clip.survives if keep is None else post_clip.survives & keep
        if micro_batch_tokens is None:
            micro_batch_tokens = mask.sum().expand(mask.size(0))
        rows = RowScalars(post_clip.s_bar, survives, _aggregation_factors(plan, mask, is_ratio, micro_batch_tokens))
        if groups.index is not None:
            grouped = _transform_groups(plan, rows.s_bar, advantages, rows.survives, rows.factor, groups.index)
            return ObjectiveValues(old, grouped.rows, grouped, None, post_clip.sanitised)
        if groups.gather is None:
            raise ValueError("The rows hold no whole groups and the layout gave no gather to complete them.")
        gathered = groups.gather(rows, advantages)  # the group's other members are on other processes
        grouped = _transform_groups(plan, gathered.s_bar, gathered.advantages, gathered.survives, gathered.factor,
                                    gathered.index)
    position = gathered.position
    weights = RowWeights(rows.s_bar, grouped.rows.s_tilde[position].to(rows.s_bar.dtype), rows.survives,
                         grouped.rows.two_sided[position])
    return ObjectiveValues(old, weights, grouped, gathered.row_ids, post_clip.sanitised)


def micro_step_objective(
    plan: ObjectivePlan, logps: Tensor, old: Tensor | None, advantages: Tensor, mask: Tensor, groups: WholeGroups,
    trl: TRLLoss, *, sampling: Tensor | None = None, is_ratio: Tensor | None = None, lambda_bar: Tensor | None = None,
) -> StepObjective:
    """DFPO's objective of one loss micro-step, expressed in the inputs TRL's loss reads next.

    Args:
        plan, logps, old, advantages, mask, groups, trl, sampling, is_ratio: as :func:`objective_values`, with
            ``logps`` from the loss's policy forward (its graph kept) and ``is_ratio`` where TRL's loss applies it.
        lambda_bar: DelTA's λ̄ (B, T) when it weights the tokens, else None.

    Returns:
        :class:`StepObjective`.
    """
    if advantages.dim() != 1:
        raise ValueError("DFPO needs one advantage per sequence (shape (B,)), as TRL's rollout produces.")
    values = objective_values(plan, logps, old, advantages, mask, groups, trl, sampling=sampling, is_ratio=is_ratio)
    clipped = None
    if plan.counts_clipped_ratios:  # TRL's inputs before the rewrite, DFPO's clip (metrics/clip.py)
        clipped = clipped_ratios(logps, logps.detach() if values.old is None else values.old, advantages, mask,
                                 sequence_level=plan.sequence_level, eps_low=trl.eps_low, eps_high=trl.eps_high,
                                 symmetric=plan.form.grpo_fix, two_sided_cap=trl.two_sided_cap)
    differentiate = plan.differentiates(groups.index is not None)
    loss_inputs = rewrite_loss_inputs(logps, values.old, advantages, mask, plan.form, eps_high=trl.eps_high,
                                      weights=values.weights, differentiate=differentiate, lambda_bar=lambda_bar)
    return StepObjective(loss_inputs, values, clipped, is_ratio)


def _scatter_from_groups(grouped: Tensor, index: Tensor) -> Tensor:
    """Inverse of ``x[index]``: put (num_groups, G, ...) values back into row order (B, ...)."""
    flat_index = index.reshape(-1)
    out = torch.empty((flat_index.numel(), *grouped.shape[2:]), dtype=grouped.dtype, device=grouped.device)
    out[flat_index] = grouped.reshape(flat_index.numel(), *grouped.shape[2:])
    return out


def _aggregation_factors(
    plan: ObjectivePlan, mask: Tensor, is_ratio: Tensor | None, micro_batch_tokens: Tensor
) -> Tensor:
    """c_i (eq. C3) of every row, (B,) float64; 1 for loss types without a known factor (no transform reaches them)."""
    if plan.loss_type not in CLIPPED_LOSS_TYPES:
        return torch.ones(mask.size(0), dtype=torch.float64, device=mask.device)
    return aggregation_factor(mask, plan.loss_type, is_ratio, micro_batch_tokens)


def _transform_groups(
    plan: ObjectivePlan, s_bar: Tensor, advantages: Tensor, survives: Tensor, factor: Tensor, index: Tensor
) -> GroupedWeights:
    """The configured transform on the (num_groups, G) view ``index`` of rows (N,), balancing Â
    (``cancellation_target="weights"``) or a = Â c 1[U] (``"gradient"``, eq. C1); the rows' s̄, s̃, U and
    two-sided flags back in row order, with the grouped views."""
    s_bar_g, adv_g, survives_g = s_bar[index], advantages[index].to(s_bar.dtype), survives[index]
    s_tilde_g, sides = transform_group_weights(
        plan.transform, s_bar_g, adv_g, survives_g, factor[index], plan.cancellation_target, plan.one_sided,
        scale_factor=plan.scale_factor, truncate_floor=plan.truncate_floor,
    )
    two_sided_g = sides.two_sided.unsqueeze(-1).expand_as(survives_g)
    rows = RowWeights(s_bar, _scatter_from_groups(s_tilde_g, index), survives,
                      _scatter_from_groups(two_sided_g, index))
    return GroupedWeights(rows, s_bar_g, s_tilde_g, adv_g, sides)
