"""ObjectivePlan: the config's objective resolved once into the functions and constants the math takes.

A parameter goes from the config to the math in two hops a reader can follow: the config field is read here, once,
when the trainer is built (:meth:`ObjectivePlan.from_config`, hop 1), and the one call of a micro-step,
:func:`~dfpo_trl.objectives.step.micro_step_objective`, and the pre-pass, through
:func:`~dfpo_trl.objectives.step.objective_values`, read the plan's fields (hop 2). ``group_transform``, for
instance, becomes the transform's registry entry (:func:`~dfpo_trl.transforms.get_transform`, built-in
or registered), whose properties (balance condition, non-negative weights, balanced form on the clip survivors)
decide the rest, and :func:`~dfpo_trl.objectives.step.objective_values` hands it to
:func:`~dfpo_trl.objectives.cancellation.transform_group_weights`, which calls the entry's function. This is the one
place DFPO's objective compares a config string; the trainer and the layouts ask the plan.

TRL's own loss settings that TRL keeps on the trainer (ε_low, ε_high, the vLLM importance-sampling switch) are not
in the plan: the trainer reads them at each call (:class:`~dfpo_trl.objectives.step.TRLLoss`), where TRL's loss
reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config.method import method_in_use
from ..config.options import (
    CLIPPED_LOSS_TYPES,
    DOMAIN_MICRO_BATCH,
    LOSS_TYPES,
    CancellationTarget,
    EnergyForm,
    OneSidedPolicy,
)
from ..transforms import GroupTransform, get_transform
from .rewrite import RewriteForm

if TYPE_CHECKING:
    from ..config import DFPOConfig

__all__ = ["ObjectivePlan"]


@dataclass(frozen=True)
class ObjectivePlan:
    """DFPO's objective as the config sets it. Built once per trainer by :meth:`from_config`."""

    transform: GroupTransform  # group_transform's registry entry (eq. 18, 50–55, Table 3, or registered)
    scale_factor: float  # transform_scale (Table 3's κ)
    truncate_floor: float  # transform_truncate_floor (eq. 52's ϵ)
    # "weights" (the paper) or "gradient" (docs/source/concepts/cancellation.md, eq. C1)
    cancellation_target: CancellationTarget
    one_sided: OneSidedPolicy  # cancellation_one_sided (eq. C8)
    form: RewriteForm  # the constants of the loss-input rewrite
    sequence_level: bool  # importance_sampling_level="sequence": s, s̄ are per sequence (eq. 44–47)
    rewrites_sequences: bool  # a transform, the score form or no stop-gradient: the sequence weights change
    stop_gradient: bool  # transform_stop_gradient
    loss_type: str  # TRL's loss type, for the aggregation factor c_i (eq. C3)
    group_metrics: bool  # log_mechanism_metrics
    energy_buckets: int  # log_energy_buckets (eq. 24), 0 = off
    energy_form: EnergyForm  # energy_form: "aggregate" (per token type's LM-head row) or "per_position"
    uses_delta: bool  # token_weighting="delta": DelTA's λ̄ weights the tokens
    active_options: str  # the DFPO options that are on, as set ("" when DFPO is off)

    @classmethod
    def from_config(cls, config: DFPOConfig) -> ObjectivePlan:
        """Hop 1: every DFPO field the objective reads, read here once (the config has validated them)."""
        method = method_in_use(config)  # which options are on, described once (dfpo_trl/config/method.py)
        transform = get_transform(config.group_transform)  # the registry as it is now
        loss_type = LOSS_TYPES.get(config.loss_type)
        return cls(
            transform=transform,
            scale_factor=config.transform_scale,
            truncate_floor=config.transform_truncate_floor,
            cancellation_target=config.cancellation_target,
            one_sided=config.cancellation_one_sided,
            form=RewriteForm(
                grpo_fix=method.symmetric_clip,
                score_form=method.score_form,
                transform_active=method.transform_active,
                # Orth-Proj's negative weights under the gradient target
                flip_to_score=config.cancellation_target == "gradient" and not transform.nonnegative,
                renormalise_lambda_bar=method.delta and loss_type is not None
                and loss_type.delta_domain == DOMAIN_MICRO_BATCH,
            ),
            sequence_level=method.sequence_level,
            rewrites_sequences=method.rewrites_sequences,
            stop_gradient=method.stop_gradient,
            loss_type=config.loss_type,
            group_metrics=config.log_mechanism_metrics,
            energy_buckets=config.log_energy_buckets,
            energy_form=config.energy_form,
            uses_delta=method.delta,
            active_options=method.active_options,
        )

    @property
    def needs_groups(self) -> bool:
        """Whether a micro-batch's group view is needed: for a sequence rewrite or for the group metrics."""
        return self.group_metrics or self.rewrites_sequences

    @property
    def recounts_clip_fractions(self) -> bool:
        """Whether TRL's ``clip_ratio/*`` are recounted (metrics/clip.py): GRPO-fix clips another region, and a
        sequence rewrite hands TRL's count other ratios (score form, flipped rows) or advantages of another sign
        (Â φ with φ ≤ 0). DelTA's λ̄ > 0 changes neither, so TRL's own count stands there, as with DFPO off."""
        return self.form.grpo_fix or self.rewrites_sequences

    @property
    def counts_clipped_ratios(self) -> bool:
        """Whether a loss call finds the ratios TRL's clip removes: for the recount, or for the group metrics'
        diagnostics (docs/source/concepts/metrics.md, "Diagnostics") under a clipped loss type."""
        return self.recounts_clip_fractions or (self.group_metrics and self.loss_type in CLIPPED_LOSS_TYPES)

    def differentiates(self, whole_groups: bool) -> bool:
        """The no-stop-gradient ablation is differentiated here: whole groups in the micro-batch, grad enabled."""
        return not self.stop_gradient and whole_groups and torch.is_grad_enabled()
