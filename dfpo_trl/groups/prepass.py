"""The pre-pass layout's runner: s̄ and s̃ at each optimizer step's θ, from one no-grad forward (docs/layouts.md).

When groups are spread over micro-steps, a micro-step's loss cannot see the other members' s̄ at its θ. At the start
of each optimizer step the pre-pass forwards (no gradient) every member of every group that has a row in the step,
on any process, and hands the rows to the objective (:func:`~dfpo_trl.objectives.step.objective_values`, the one
the loss micro-step calls), which completes the groups across processes and transforms them. It returns s̄, s̃, U
and the two-sided flag of each of the step's micro-batches (:class:`PrePassValues`), which the layout attaches under
:data:`PRE_PASS_KEYS` for the loss to read. U includes TRL's off-policy mask when it is on, computed from the same
inputs as TRL's loss will compute it. In the first optimizer step after a rollout θ = θ_old, so every s is 1 and the
forward is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..objectives.plan import ObjectivePlan
from ..objectives.step import ObjectiveValues, TRLLoss, WholeGroups, objective_values
from ..objectives.weights import RowWeights, loss_mask
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
    order); the :class:`~dfpo_trl.objectives.step.ObjectiveValues` of every row it transformed (its transformed
    groups hold every member, on any process, in the order of its ``row_ids``), for the metrics; and whether the
    forward was skipped (θ = θ_old)."""

    weights: list[RowWeights]
    objective: ObjectiveValues
    skipped: bool


class PrePass:
    """The pre-pass of one run: its ``shape``, the objective ``plan``, the ``accelerator`` (gathers) and the policy's
    no-grad log-prob ``forward``. ``skip_forward_at_old_policy``: at the first optimizer step of a rollout θ = θ_old,
    so the rollout's old log-probs are the current ones and no forward runs; False for a hand-made rollout whose old
    log-probs are not this model's (a test, a benchmark)."""

    def __init__(self, shape: RunShape, plan: ObjectivePlan, accelerator: Any, forward: PolicyLogps) -> None:
        self.shape, self.plan, self.accelerator, self.forward = shape, plan, accelerator, forward
        self.skip_forward_at_old_policy = True

    def run(self, buffered: list[dict[str, Any]], step: int, trl: TRLLoss, apply_is_ratio: bool) -> PrePassValues:
        """At micro-step ``step``, the first of an optimizer step: s̄ at the step's θ for every member of every
        group that has a row in the step (on any process), the complete groups transformed.

        Args:
            buffered: TRL's buffered rollout, one dict per micro-batch. trl: TRL's loss settings.
            apply_is_ratio: whether TRL's loss applies the vLLM importance-sampling ratio (c of eq. C3).

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
        old, sampling = full.get("old_per_token_logps"), full.get("sampling_per_token_logps")
        mask = loss_mask(full)[rows]
        # θ = θ_old: the old log-probs are the current ones (every s is 1). Without old log-probs TRL's off-policy
        # mask compares the current log-probs with themselves (any equal pair will do), unless the rollout kept the
        # sampler's, which it compares with the current ones: then the pre-pass forwards. The same answer on every
        # process (it depends on the config only), so the forwards stay collective.
        skipped = (self.skip_forward_at_old_policy and step % shape.generate_every == 0
                   and (trl.off_policy_keep is None or old is not None or sampling is None))
        if skipped:
            logps = torch.zeros(mask.shape, device=mask.device) if old is None else old[rows]
        else:
            logps = self.policy_logps(full, rows)
        micro_tokens = torch.cat([loss_mask(micro).sum().expand(micro["advantages"].size(0)) for micro in buffered])
        ratio = full.get("importance_sampling_ratio") if apply_is_ratio else None
        groups = WholeGroups(gather=partial(gather_groups, self.accelerator, full[ROW_IDS_KEY][rows],
                                            full[GROUP_IDS_KEY][rows], group_size=shape.num_generations))
        values = objective_values(
            self.plan, logps, None if old is None else old[rows], full["advantages"][rows], mask, groups, trl,
            sampling=None if sampling is None else sampling[rows], is_ratio=None if ratio is None else ratio[rows],
            micro_batch_tokens=micro_tokens[rows],
        )
        if skipped:
            values = values._replace(sanitised=None)  # no log-probs were read
        weights = [RowWeights(*(w[positions_of(micro[ROW_IDS_KEY], values.row_ids)] for w in values.grouped.rows))
                   for micro in window]
        return PrePassValues(weights, values, skipped)

    @torch.no_grad()
    def policy_logps(self, full: dict[str, Any], rows: Tensor) -> Tensor:
        """The per-token log-probs (rows, T) of the selected rows of a rollout at the current θ, forwarded through
        the policy in chunks of ``prepass_batch_size`` rows. Every process runs the same number of chunks (a ZeRO-3
        forward is collective), padding with a repeat of one row where it has fewer."""
        chunk = self.shape.prepass_batch_size
        local_chunks = math.ceil(rows.numel() / chunk)
        counts = gather_rows(self.accelerator, torch.tensor([[float(local_chunks)]], device=rows.device))
        total_chunks = int(counts.max().item())
        fallback = torch.zeros(1, dtype=rows.dtype, device=rows.device)
        logps = []
        for k in range(total_chunks):
            part = rows[k * chunk : (k + 1) * chunk]
            real = part.numel() > 0
            part = part if real else fallback
            ids = torch.cat([full["prompt_ids"][part], full["completion_ids"][part]], dim=1)
            attention = torch.cat([full["prompt_mask"][part], full["completion_mask"][part]], dim=1)
            out = self.forward(ids, attention, full["completion_ids"].size(1), chunk)
            if real:
                logps.append(out)
        if not logps:
            return torch.zeros(0, full["completion_ids"].size(1), device=rows.device)
        return torch.cat(logps)


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
