"""The metrics of DFPO's objective, logged from the objective's return values in one place
(docs/source/concepts/metrics.md).

:func:`log_objective_values` logs what :func:`~dfpo_trl.objectives.step.objective_values` returns, wherever it ran
(a loss micro-step or the pre-pass): the sanitised rows and the group metrics of the groups transformed there.
:func:`log_micro_step` adds what only a loss call has: the clip fractions DFPO recounts under TRL's names, the
diagnostics, GRPO-fix's capped tokens. :func:`log_pre_pass` adds whether the pre-pass skipped its forward. Nothing
here computes a ratio or a clip: the objective found them once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..config.options import CLIPPED_LOSS_TYPES
from .clip import clip_fraction_terms, log_clip_fractions
from .diagnostics import log_loss_diagnostics
from .mechanism import log_group_metrics

if TYPE_CHECKING:
    from ..objectives.plan import ObjectivePlan
    from ..objectives.step import ObjectiveValues, StepObjective
    from .store import MetricStore

__all__ = ["log_micro_step", "log_objective_values", "log_pre_pass"]


def log_objective_values(
    store: MetricStore, mode: str, values: ObjectiveValues, *, group_metrics: bool, off_policy: bool
) -> None:
    """The rows whose token log-ratios were sanitised (``transform/sanitised_weights``) and, with ``group_metrics``
    (``log_mechanism_metrics``), the group metrics of the groups transformed in this call (metrics/mechanism.py);
    ``off_policy``: the step trains on a rollout an optimizer step old or more."""
    if values.sanitised is not None:
        store.add_sum(mode, "transform/sanitised_weights", values.sanitised.sum())
    if values.grouped is not None and group_metrics:
        log_group_metrics(store, mode, values.grouped, off_policy=off_policy)


def log_micro_step(
    store: MetricStore, mode: str, step: StepObjective, advantages: Tensor, mask: Tensor, plan: ObjectivePlan, *,
    training: bool, off_policy: bool,
) -> None:
    """One loss call's metrics from its objective's return value: the clip fractions where DFPO recounts them
    (metrics/clip.py), the diagnostics in training (metrics/diagnostics.py), :func:`log_objective_values`, and the
    fraction of scored tokens GRPO-fix capped (pooled over tokens).

    Args:
        advantages: TRL's Â (B,) before the rewrite. mask: the loss mask (B, T). plan: the objective.
        training: the model is in training mode. off_policy: as :func:`log_objective_values`.
    """
    if step.clipped is not None and plan.recounts_clip_fractions:
        log_clip_fractions(store, mode, clip_fraction_terms(step.clipped, mask))
    if step.clipped is not None and plan.group_metrics and training and plan.loss_type in CLIPPED_LOSS_TYPES:
        log_loss_diagnostics(store, mode, advantages, mask, step.clipped, step.is_ratio)
    log_objective_values(store, mode, step.values, group_metrics=plan.group_metrics, off_policy=off_policy)
    capped = step.loss_inputs.capped
    if capped is not None:
        store.add_mean(mode, "grpo_fix/negative_capped_fraction", (capped & mask.bool()).sum(), mask.sum())


def log_pre_pass(
    store: MetricStore, values: ObjectiveValues, skipped: bool, *, group_metrics: bool, off_policy: bool
) -> None:
    """One pre-pass's metrics (training): :func:`log_objective_values` and ``prepass/forward_skipped`` (θ = θ_old)."""
    log_objective_values(store, "train", values, group_metrics=group_metrics, off_policy=off_policy)
    store.add_mean("train", "prepass/forward_skipped", torch.tensor(float(skipped)), 1.0)
