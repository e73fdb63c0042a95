"""The pre-pass layout's one owner: s̄ and s̃ at each optimizer step's θ, from one no-grad forward
(docs/source/concepts/layouts.md).

When groups are spread over micro-steps, a micro-step's loss cannot see the other members' s̄ at its θ. At the start
of each optimizer step the pre-pass forwards (no gradient) every member of every group that has a row in the step,
on any process, and hands the rows to the objective (:func:`~dfpo_trl.objectives.step.objective_values`, the one
the loss micro-step calls), which completes the groups across processes and transforms them. It attaches s̄, s̃, U
and the two-sided flag of each of the step's micro-batches under :data:`PRE_PASS_KEYS`, where the loss reads them
back (:meth:`PrePass.attached`), and logs its metrics. U includes TRL's off-policy mask when it is on, computed from
the same inputs as TRL's loss will compute it. In the first optimizer step after a rollout θ = θ_old, so every s is
1 and the forward is skipped.

:class:`PrePass` decides all of it: when it runs, which rows, the rollout's group order that keeps those rows few,
the skip, the forward, the attach and the read-back; the trainer calls :meth:`PrePass.before_micro_step` once per
micro-step and nothing else. The integer rules (and the closed-form row count the start-up line prints) are in
:mod:`dfpo_trl.groups.prepass_schedule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..metrics.objective import log_pre_pass
from ..metrics.store import MetricStore
from ..objectives.plan import ObjectivePlan
from ..objectives.step import ObjectiveValues, TRLLoss, WholeGroups, objective_values
from ..objectives.weights import RowWeights, loss_mask
from ..profiling import profiled
from ..trl_hooks.compat import disable_gradient_checkpointing
from .batches import concat_sequence_dicts
from .gather import gather_groups, gather_rows
from .ids import (
    GROUP_IDS_KEY,
    PRE_PASS_ORDER_STREAM,
    ROW_IDS_KEY,
    group_granular_order,
    positions_of,
    rollout_generator,
)
from .prepass_schedule import at_old_policy, off_policy, starts_optimizer_step, step_window
from .shape import RunShape

__all__ = ["PRE_PASS_KEYS", "LogProbHelper", "PrePass", "PrePassValues"]

# Keys the pre-pass values go under in each micro-batch of the optimizer step: s̄, s̃, U and the two-sided flag.
PRE_PASS_KEYS = ("dfpo_s_bar", "dfpo_s_tilde", "dfpo_survives", "dfpo_two_sided")

#: TRL's ``_get_per_token_logps_and_entropies`` bound to the trainer: (per-token log-probs, entropies, ...) of
#: ``model=, input_ids=, attention_mask=, logits_to_keep=, batch_size=``.
LogProbHelper = Callable[..., tuple[Any, ...]]


class PrePassValues(NamedTuple):
    """What one pre-pass returns: the :class:`RowWeights` of each micro-batch of the optimizer step (in step
    order); the :class:`~dfpo_trl.objectives.step.ObjectiveValues` of every row it transformed (its transformed
    groups hold every member, on any process, in the order of its ``row_ids``), for the metrics; and whether the
    forward was skipped (θ = θ_old)."""

    weights: list[RowWeights]
    objective: ObjectiveValues
    skipped: bool


class PrePass:
    """The pre-pass of one run: its ``shape``, the objective ``plan``, the ``accelerator`` (gathers), the ``metrics``
    store, and ``log_probs``, TRL's log-prob helper bound to the trainer, with the run's
    ``gradient_checkpointing_kwargs`` (the forward turns checkpointing off: no backward follows it).

    Why the forward is a callable into the trainer: s̄ must be the log-probs TRL's loss computes, bit for bit (the
    temperature, ``logits_to_keep``, the chunking, the autocast and any model wrapper TRL's helper handles), and
    the trainer's ``_get_per_token_logps_and_entropies`` is where TRL keeps that, and where DFPO's own override
    sits; re-implementing it here would copy TRL. It is passed once, at construction, and called with the model of
    the micro-step (TRL may wrap the model after the trainer is built).

    ``skip_forward_at_old_policy``: at the first optimizer step of a rollout θ = θ_old, so the rollout's old
    log-probs are the current ones and no forward runs; False for a hand-made rollout whose old log-probs are not
    this model's (a test, a benchmark)."""

    def __init__(self, shape: RunShape, plan: ObjectivePlan, accelerator: Any, metrics: MetricStore,
                 log_probs: LogProbHelper, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        self.shape, self.plan, self.accelerator, self.metrics = shape, plan, accelerator, metrics
        self.log_probs, self.gradient_checkpointing_kwargs = log_probs, gradient_checkpointing_kwargs
        self.skip_forward_at_old_policy = True

    # ------------------------------------------------------------------------------------- the one entry
    def before_micro_step(self, buffered: list[dict[str, Any]], step: int, model: torch.nn.Module, trl: TRLLoss,
                          apply_is_ratio: bool) -> PrePassValues | None:
        """Before TRL's micro-step ``step`` reads its micro-batch: at the first micro-step of an optimizer step, run
        the pre-pass on TRL's ``buffered`` rollout (the policy ``model`` of this micro-step), attach its values to
        the step's micro-batches, log its metrics and return the values (for the trainer's observers); at the
        others, nothing (None).

        Args:
            trl: TRL's loss settings now. apply_is_ratio: whether TRL's loss applies the vLLM importance-sampling
                ratio (c of eq. C3).
        """
        if not starts_optimizer_step(step, self.shape.gradient_accumulation_steps):
            return None
        with profiled("dfpo/pre_pass"):
            values = self.run(buffered, step, trl, apply_is_ratio, model)
            self.attach(buffered, step, values)
            log_pre_pass(self.metrics, values.objective, values.skipped, group_metrics=self.plan.group_metrics,
                         off_policy=off_policy(step, self.shape.generate_every, self.shape.gradient_accumulation_steps))
            return values

    # ------------------------------------------------------------------------------------------- order
    @staticmethod
    def order(group_ids: Tensor, shape: RunShape, step: int) -> Tensor:
        """The row order of a rollout generated at optimizer step ``step`` (the layout's regroup applies it, with
        TRL's per-sample shuffle replaced): whole groups in consecutive rows, groups in a random order (DFPO's own
        draw, its own stream), so that an optimizer step's rows come from as few groups as its size allows, the only
        ones the pre-pass forwards."""
        generator = rollout_generator(shape.seed, shape.process_index, step, stream=PRE_PASS_ORDER_STREAM)
        return group_granular_order(group_ids, generator)

    # ---------------------------------------------------------------------------------------------- run
    def run(self, buffered: list[dict[str, Any]], step: int, trl: TRLLoss, apply_is_ratio: bool,
            model: torch.nn.Module | None = None) -> PrePassValues:
        """At micro-step ``step``, the first of an optimizer step: s̄ at the step's θ for every member of every
        group that has a row in the step (on any process), the complete groups transformed.

        Args:
            buffered: TRL's buffered rollout, one dict per micro-batch. trl: TRL's loss settings.
            apply_is_ratio: whether TRL's loss applies the vLLM importance-sampling ratio (c of eq. C3).
            model: the policy to forward (not needed when the forward is skipped).

        Returns:
            :class:`PrePassValues`, the weights of the step's micro-batches in step order.
        """
        shape = self.shape
        window = [buffered[i] for i in step_window(step, shape.steps_per_generation, shape.gradient_accumulation_steps)]
        # the previous optimizer step's values are stale: never read, replaced by attach
        full = concat_sequence_dicts([{k: v for k, v in micro.items() if k not in PRE_PASS_KEYS} for micro in buffered])
        rows = self.rows(full, window)
        old, sampling = full.get("old_per_token_logps"), full.get("sampling_per_token_logps")
        mask = loss_mask(full)[rows]
        skipped = self.skips_forward(step, trl, old, sampling)
        if skipped:
            logps = torch.zeros(mask.shape, device=mask.device) if old is None else old[rows]
        else:
            logps = self.policy_logps(full, rows, model)
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

    def rows(self, full: dict[str, Any], window: list[dict[str, Any]]) -> Tensor:
        """The local rows of the rollout ``full`` to forward: every row of a group that has a row in the optimizer
        step's ``window`` on any process (one all-gather of the window's group ids), by explicit group id."""
        window_groups = torch.cat([micro[GROUP_IDS_KEY] for micro in window])
        active = torch.unique(gather_rows(self.accelerator, window_groups.double().unsqueeze(1))[:, 0])
        rows = torch.isin(full[GROUP_IDS_KEY], active.to(torch.int64).to(full[GROUP_IDS_KEY].device))
        return rows.nonzero().squeeze(1)

    def skips_forward(self, step: int, trl: TRLLoss, old: Tensor | None, sampling: Tensor | None) -> bool:
        """Whether the optimizer step at micro-step ``step`` needs no forward: θ = θ_old, so the old log-probs are
        the current ones (every s is 1). Without old log-probs TRL's off-policy mask compares the current log-probs
        with themselves (any equal pair will do), unless the rollout kept the sampler's, which it compares with the
        current ones: then the pre-pass forwards. The same answer on every process (it depends on the config only),
        so the forwards stay collective."""
        return (self.skip_forward_at_old_policy and at_old_policy(step, self.shape.generate_every)
                and (trl.off_policy_keep is None or old is not None or sampling is None))

    # ------------------------------------------------------------------------------------------ forward
    @torch.no_grad()
    def policy_logps(self, full: dict[str, Any], rows: Tensor, model: torch.nn.Module | None) -> Tensor:
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
            out = self.forward(ids, attention, full["completion_ids"].size(1), chunk, model)
            if real:
                logps.append(out)
        if not logps:
            return torch.zeros(0, full["completion_ids"].size(1), device=rows.device)
        return torch.cat(logps)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, batch_size: int,
                model: torch.nn.Module) -> Tensor:
        """The policy's per-token log-probs of one pre-pass chunk, through TRL's log-prob helper, without gradient
        and with gradient checkpointing off (no backward follows)."""
        with disable_gradient_checkpointing(model, self.gradient_checkpointing_kwargs):
            logps, _, _ = self.log_probs(model=model, input_ids=input_ids, attention_mask=attention_mask,
                                         logits_to_keep=logits_to_keep, batch_size=batch_size)
        return logps

    # ------------------------------------------------------------------------------- attach, read back
    @staticmethod
    def attach(buffered: list[dict[str, Any]], step: int, values: PrePassValues) -> None:
        """Attach the pre-pass ``values`` of the optimizer step starting at micro-step ``step`` to its
        micro-batches under :data:`PRE_PASS_KEYS`, dropping the previous step's, which are stale."""
        for micro in buffered:
            for key in PRE_PASS_KEYS:
                micro.pop(key, None)
        start = step % len(buffered)
        for j, weights in enumerate(values.weights):
            micro = buffered[(start + j) % len(buffered)]
            for key, value in zip(PRE_PASS_KEYS, weights, strict=True):
                micro[key] = value

    @staticmethod
    def attached(inputs: dict[str, Any]) -> RowWeights | None:
        """The pre-pass values attached to a micro-batch TRL's loss reads (None when it has none: not the pre-pass
        layout, or not a training micro-batch)."""
        return RowWeights(*(inputs[key] for key in PRE_PASS_KEYS)) if PRE_PASS_KEYS[1] in inputs else None
