"""The pre-pass layout's runner: s̄ and s̃ at each optimizer step's θ, from one no-grad forward (docs/layouts.md).

When groups are spread over micro-steps, a micro-step's loss cannot see the other members' s̄ at its θ. At the start
of each optimizer step the pre-pass forwards (no gradient) every member of every group that has a row in the step,
on any process, transforms the complete groups and returns s̄, s̃, U and the two-sided flag of each of the step's
micro-batches (:class:`PrePassValues`), which the layout attaches under :data:`PRE_PASS_KEYS` for the loss to read.
U includes TRL's off-policy mask when it is on, computed from the same inputs as TRL's loss will compute it. In the
first optimizer step after a rollout θ = θ_old, so every s is 1 and the forward is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..objectives.plan import ObjectivePlan
from ..objectives.step import ClipRange, GroupedWeights, RowScalars, aggregation_factors, clip_weights, transform_groups
from ..objectives.weights import RowWeights, bounded_old_logps, loss_mask
from ..trl_hooks.compat import OffPolicyKeep
from .batches import concat_sequence_dicts
from .gather import gather_groups, gather_rows
from .ids import GROUP_IDS_KEY, ROW_IDS_KEY, positions_of
from .shape import RunShape

__all__ = ["PRE_PASS_KEYS", "PolicyLogps", "PrePass", "PrePassValues", "attach_pre_pass"]

# Keys the pre-pass values go under in each micro-batch of the optimizer step: s̄, s̃, U and the two-sided flag.
PRE_PASS_KEYS = ("dfpo_s_bar", "dfpo_s_tilde", "dfpo_survives", "dfpo_two_sided")

#: The policy's per-token log-probs (rows, T) of (input ids, attention mask, logits_to_keep, batch size), no grad.
PolicyLogps = Callable[[Tensor, Tensor, int, int], Tensor]


class PrePassValues(NamedTuple):
    """What one pre-pass returns: the :class:`RowWeights` of each micro-batch of the optimizer step (in step
    order); the global row ids (N,) of every row it transformed, on any process, and the transformed groups (rows in
    that order), the (rows,) sanitised flags of each forward chunk (for the metrics), and whether the forward was
    skipped (θ = θ_old)."""

    weights: list[RowWeights]
    row_ids: Tensor
    grouped: GroupedWeights
    sanitised: list[Tensor]
    skipped: bool


class PrePass:
    """The pre-pass of one run: its ``shape``, the objective ``plan``, the ``accelerator`` (gathers) and the policy's
    no-grad log-prob ``forward``."""

    def __init__(self, shape: RunShape, plan: ObjectivePlan, accelerator: Any, forward: PolicyLogps) -> None:
        self.shape, self.plan, self.accelerator, self.forward = shape, plan, accelerator, forward

    def run(
        self, buffered: list[dict[str, Any]], step: int, clip: ClipRange, off_policy_keep: OffPolicyKeep | None,
        apply_is_ratio: bool, policy_unchanged: bool,
    ) -> PrePassValues:
        """At micro-step ``step``, the first of an optimizer step: s̄ at the step's θ for every member of every
        group that has a row in the step (on any process), the complete groups transformed.

        Args:
            buffered: TRL's buffered rollout, one dict per micro-batch. clip: TRL's clip settings.
            off_policy_keep: the rows TRL's off-policy mask keeps (trl_hooks/compat.py; None: the mask is off).
            apply_is_ratio: whether TRL's loss applies the vLLM importance-sampling ratio (c of eq. C3).
            policy_unchanged: θ = θ_old (the first optimizer step after a rollout): s = 1, no forward needed.

        Returns:
            :class:`PrePassValues`, the weights of the step's micro-batches in step order.
        """
        shape = self.shape
        spg, start = shape.steps_per_generation, step % shape.steps_per_generation
        window = [buffered[(start + j) % spg] for j in range(shape.gradient_accumulation_steps)]
        # the previous optimizer step's values are stale: never read, replaced by the layout
        full = concat_sequence_dicts([{k: v for k, v in micro.items() if k not in PRE_PASS_KEYS} for micro in buffered])
        window_groups = torch.cat([micro[GROUP_IDS_KEY] for micro in window])
        active = torch.unique(gather_rows(self.accelerator, window_groups.double().unsqueeze(1))[:, 0])
        rows = torch.isin(full[GROUP_IDS_KEY], active.to(torch.int64).to(full[GROUP_IDS_KEY].device))
        rows = rows.nonzero().squeeze(1)
        survives = self.survivors_at_old_policy(full, rows, off_policy_keep) if policy_unchanged else None
        skipped, sanitised = survives is not None, []
        if skipped:
            s_bar = torch.ones(rows.numel(), device=full["advantages"].device)
        else:
            s_bar, survives, sanitised = self.post_clip_weights(full, rows, clip, off_policy_keep)
        micro_tokens = torch.cat([loss_mask(micro).sum().expand(micro["advantages"].size(0)) for micro in buffered])
        ratio = full.get("importance_sampling_ratio") if apply_is_ratio else None
        factor = aggregation_factors(self.plan, loss_mask(full), ratio, micro_tokens)[rows]
        gathered = gather_groups(self.accelerator, full[ROW_IDS_KEY][rows], full[GROUP_IDS_KEY][rows],
                                 RowScalars(s_bar, survives, factor), full["advantages"][rows],
                                 shape.num_generations)
        grouped = transform_groups(self.plan, gathered.s_bar, gathered.advantages, gathered.survives,
                                   gathered.factor, gathered.index)
        weights = [RowWeights(*(values[positions_of(micro[ROW_IDS_KEY], gathered.row_ids)]
                                for values in grouped.rows)) for micro in window]
        return PrePassValues(weights, gathered.row_ids, grouped, sanitised, skipped)

    def survivors_at_old_policy(
        self, full: dict[str, Any], rows: Tensor, off_policy_keep: OffPolicyKeep | None
    ) -> Tensor | None:
        """U of the selected rows at θ = θ_old, without a forward: every s is 1, inside the clip, and TRL's
        off-policy mask (when on) reads the old log-probs as the current ones. None when that mask needs current
        log-probs the rollout did not keep (the sampler's log-probs without old ones): the pre-pass then forwards.
        The same answer on every process (it depends on the config only), so the forwards stay collective."""
        survives = torch.ones(rows.numel(), dtype=torch.bool, device=full["advantages"].device)
        old, sampling = full.get("old_per_token_logps"), full.get("sampling_per_token_logps")
        if off_policy_keep is None:
            return survives
        if old is None and sampling is not None:
            return None
        mask = loss_mask(full)[rows]
        # without old log-probs TRL's mask compares the current log-probs with themselves: any equal pair will do
        current = torch.zeros(mask.shape, device=mask.device) if old is None else old[rows]
        keep = off_policy_keep(full["advantages"][rows], current, current, None if sampling is None else sampling[rows],
                               mask)
        return survives & keep

    @torch.no_grad()
    def post_clip_weights(
        self, full: dict[str, Any], rows: Tensor, clip: ClipRange, off_policy_keep: OffPolicyKeep | None
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """s̄ and U of the selected rows of a rollout at the current θ, and each chunk's sanitised flags, forwarded
        through the policy in chunks of ``prepass_batch_size`` rows. Every process runs the same number of chunks (a
        ZeRO-3 forward is collective), padding with a repeat of one row where it has fewer."""
        chunk = self.shape.prepass_batch_size
        local_chunks = math.ceil(rows.numel() / chunk)
        counts = gather_rows(self.accelerator, torch.tensor([[float(local_chunks)]], device=rows.device))
        total_chunks = int(counts.max().item())
        fallback = torch.zeros(1, dtype=rows.dtype, device=rows.device)
        s_bars, survives, sanitised = [], [], []
        full_mask, sequence_level = loss_mask(full), self.plan.sequence_level
        for k in range(total_chunks):
            part = rows[k * chunk : (k + 1) * chunk]
            real = part.numel() > 0
            part = part if real else fallback
            ids = torch.cat([full["prompt_ids"][part], full["completion_ids"][part]], dim=1)
            attention = torch.cat([full["prompt_mask"][part], full["completion_mask"][part]], dim=1)
            logps = self.forward(ids, attention, full["completion_ids"].size(1), chunk)
            if not real:
                continue
            old, sampling = full.get("old_per_token_logps"), full.get("sampling_per_token_logps")
            # the old log-probs as TRL's loss will read them (the trainer bounds them before the loss)
            old = logps if old is None else bounded_old_logps(logps, old[part], full_mask[part], sequence_level)
            mask, advantages = full_mask[part], full["advantages"][part]
            keep = None if off_policy_keep is None else off_policy_keep(
                advantages, logps.detach(), old, None if sampling is None else sampling[part], mask
            )
            weights = clip_weights(self.plan, logps, old, mask, advantages, clip, keep)
            s_bars.append(weights.s_bar)
            survives.append(weights.survives)
            sanitised.append(weights.sanitised)
        if not s_bars:
            return torch.ones(0, device=rows.device), torch.ones(0, dtype=torch.bool, device=rows.device), sanitised
        return torch.cat(s_bars), torch.cat(survives), sanitised


def attach_pre_pass(buffered: list[dict[str, Any]], step: int, values: PrePassValues) -> None:
    """Attach the pre-pass ``values`` of the optimizer step starting at micro-step ``step`` to its micro-batches
    under :data:`PRE_PASS_KEYS`, dropping the previous step's, which are stale."""
    for micro in buffered:
        for key in PRE_PASS_KEYS:
            micro.pop(key, None)
    start = step % len(buffered)
    for j, weights in enumerate(values.weights):
        micro = buffered[(start + j) % len(buffered)]
        for key, value in zip(PRE_PASS_KEYS, weights, strict=True):
            micro[key] = value
