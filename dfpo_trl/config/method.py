"""Which method a ``DFPOConfig`` trains with, described once: the config's checks and properties, the objective's
plan, the run summary and the model card all read :func:`method_in_use` (it imports only
:mod:`dfpo_trl.config.options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .options import NO_TRANSFORM

__all__ = ["MethodInUse", "method_in_use"]


@dataclass(frozen=True)
class MethodInUse:
    """The DFPO options of a config that change the objective or what it logs, as set."""

    group_transform: str
    score_form: bool  # transform_gradient="score"
    stop_gradient: bool  # transform_stop_gradient
    symmetric_clip: bool  # GRPO-fix (App. H)
    sequence_level: bool  # importance_sampling_level="sequence" (GSPO, eq. 44–47)
    loss_type: str
    token_weighting: str
    energy_buckets: int  # log_energy_buckets (eq. 24), 0 = off

    @property
    def transform_active(self) -> bool:
        """Whether an in-group transform replaces s̄ (any ``group_transform`` but ``"none"``)."""
        return self.group_transform != NO_TRANSFORM

    @property
    def delta(self) -> bool:
        """Whether DelTA weights the tokens (``token_weighting="delta"``)."""
        return self.token_weighting == "delta"

    @property
    def rewrites_sequences(self) -> bool:
        """Whether the sequence-level loss is rewritten: any transform, the score form, or no stop-gradient."""
        return self.transform_active or self.score_form or not self.stop_gradient

    @property
    def sequence_options(self) -> str:
        """The options that rewrite the sequence-level loss, as set (for messages; empty when none is)."""
        parts = []
        if self.transform_active:
            parts.append(f"group_transform={self.group_transform!r}")
        if self.score_form:
            parts.append("transform_gradient='score'")
        if not self.stop_gradient:
            parts.append("transform_stop_gradient=False")
        return " with ".join(parts)

    @property
    def active_options(self) -> str:
        """Every DFPO option that is on, as set (empty when DFPO is off: TRL's own loss, bit for bit)."""
        parts = [self.sequence_options] if self.rewrites_sequences else []
        if self.symmetric_clip:
            parts.append("symmetric_clip=True")
        if self.delta:
            parts.append(f"token_weighting={self.token_weighting!r}")
        if self.energy_buckets:
            parts.append(f"log_energy_buckets={self.energy_buckets}")
        return ", ".join(parts)

    @property
    def label(self) -> str:
        """The method's name as the summary and the figure show it (e.g. ``"DFPO min_replace + DelTA"``)."""
        if self.symmetric_clip:
            method = "GRPO-fix (symmetric clip)"
        elif self.sequence_level:
            method = f"DFPO {self.group_transform}" if self.transform_active else "GSPO"
            if self.score_form:
                method += " (score form)"
        else:
            method = f"GRPO (loss_type={self.loss_type})"
        return method + (" + DelTA" if self.delta else "")


def method_in_use(config: Any) -> MethodInUse:
    """The method a config trains with.

    Args:
        config: a ``DFPOConfig`` (or anything with its fields ``group_transform``, ``transform_gradient``,
            ``transform_stop_gradient``, ``symmetric_clip``, ``importance_sampling_level``, ``loss_type``,
            ``token_weighting``, ``log_energy_buckets``).

    Returns:
        Its :class:`MethodInUse`.
    """
    return MethodInUse(
        group_transform=config.group_transform,
        score_form=config.transform_gradient == "score",
        stop_gradient=bool(config.transform_stop_gradient),
        symmetric_clip=bool(config.symmetric_clip),
        sequence_level=config.importance_sampling_level == "sequence",
        loss_type=config.loss_type,
        token_weighting=config.token_weighting,
        energy_buckets=config.log_energy_buckets,
    )
