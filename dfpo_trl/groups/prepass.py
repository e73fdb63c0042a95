"""The pre-pass layout's runner: s̄ and s̃ at each optimizer step's θ, from one no-grad forward (docs/layouts.md).

When groups are spread over micro-steps, a micro-step's loss cannot see the other members' s̄ at its θ. At the start
of each optimizer step the pre-pass forwards (no gradient) every member of every group that has a row in the step,
on any process, transforms the complete groups and attaches s̄, s̃, U and the two-sided flag to the step's
micro-batches under :data:`PRE_PASS_KEYS`, where the loss reads them. U includes TRL's off-policy mask when it is on,
computed from the same inputs as TRL's loss will compute it. In the first optimizer step after a rollout θ = θ_old,
so every s is 1 and the forward is skipped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..objectives.weights import bounded_old_logps, loss_mask
from ..trl_hooks.compat import disable_gradient_checkpointing, generate_every, trl_off_policy_keep
from .batches import concat_sequence_dicts
from .gather import gather_rows
from .ids import GROUP_IDS_KEY, ROW_IDS_KEY, positions_of

if TYPE_CHECKING:
    from .layout import GroupLayout

__all__ = ["PRE_PASS_KEYS", "PrePass"]

# Keys the pre-pass attaches to each micro-batch of the optimizer step: s̄, s̃, U and the two-sided flag at its θ.
PRE_PASS_KEYS = ("dfpo_s_bar", "dfpo_s_tilde", "dfpo_survives", "dfpo_two_sided")


class PrePass:
    """The pre-pass of one trainer: ``host`` is the trainer (its args, accelerator, policy model and TRL's log-prob
    helper, read at each call), ``layout`` the layout whose s̄ and transform it uses."""

    def __init__(self, host: Any, layout: GroupLayout) -> None:
        self.host = host
        self.layout = layout

    def policy_unchanged(self, step: int) -> bool:
        """True at micro-step ``step`` when it is in the first optimizer step after a rollout: θ = θ_old, so every
        s is 1 and the forward can be skipped (the old log-probs were computed by this model at this θ)."""
        return step % generate_every(self.host) == 0

    def run(self, buffered: list[dict[str, Any]], step: int) -> None:
        """At micro-step ``step``, the first of an optimizer step: compute s̄ at the step's θ for every member of
        every group that has a row in the step (on any process), transform the complete groups, and attach the
        weights to the step's micro-batches, so each micro-step's loss uses exact in-group coefficients."""
        args, accelerator = self.host.args, self.host.accelerator
        spg, accumulation = args.steps_per_generation, args.gradient_accumulation_steps
        start = step % spg
        for micro in buffered:  # the previous optimizer step's coefficients are stale now
            for key in PRE_PASS_KEYS:
                micro.pop(key, None)
        window = [buffered[(start + j) % spg] for j in range(accumulation)]
        full = concat_sequence_dicts(buffered)
        window_groups = torch.cat([micro[GROUP_IDS_KEY] for micro in window])
        active = torch.unique(gather_rows(accelerator, window_groups.double().unsqueeze(1))[:, 0]).to(torch.int64)
        rows = torch.isin(full[GROUP_IDS_KEY], active.to(full[GROUP_IDS_KEY].device)).nonzero().squeeze(1)
        survives = self.survivors_at_old_policy(full, rows) if self.policy_unchanged(step) else None
        skipped = survives is not None
        if skipped:
            s_bar = torch.ones(rows.numel(), device=full["advantages"].device)
        else:
            s_bar, survives = self.post_clip_weights(full, rows)
        self.layout.store.add_mean("train", "prepass/forward_skipped", torch.tensor(float(skipped)), 1.0)
        micro_tokens = torch.cat([loss_mask(micro).sum().expand(micro["advantages"].size(0)) for micro in buffered])
        factor = self.layout.aggregation_factor(full, loss_mask(full), micro_tokens)[rows]
        row_ids, weights = self.layout.transform_across_processes(
            full[ROW_IDS_KEY][rows], full[GROUP_IDS_KEY][rows], s_bar, full["advantages"][rows], survives, factor,
            "train",
        )
        for micro in window:
            position = positions_of(micro[ROW_IDS_KEY], row_ids)
            for key, values in zip(PRE_PASS_KEYS, weights, strict=True):
                micro[key] = values[position]

    def survivors_at_old_policy(self, full: dict[str, Any], rows: torch.Tensor) -> torch.Tensor | None:
        """U of the selected rows at θ = θ_old, without a forward: every s is 1, inside the clip, and TRL's
        off-policy mask (when on) reads the old log-probs as the current ones. None when that mask needs current
        log-probs the rollout did not keep (the sampler's log-probs without old ones): the pre-pass then forwards.
        The same answer on every process (it depends on the config only), so the forwards stay collective."""
        survives = torch.ones(rows.numel(), dtype=torch.bool, device=full["advantages"].device)
        old, sampling = full.get("old_per_token_logps"), full.get("sampling_per_token_logps")
        if self.host.off_policy_mask_threshold is None:
            return survives
        if old is None and sampling is not None:
            return None
        mask = loss_mask(full)[rows]
        # without old log-probs TRL's mask compares the current log-probs with themselves: any equal pair will do
        current = torch.zeros(mask.shape, device=mask.device) if old is None else old[rows]
        keep = trl_off_policy_keep(self.host, full["advantages"][rows], current, current,
                                   None if sampling is None else sampling[rows], mask)
        return survives & keep

    @torch.no_grad()
    def post_clip_weights(self, full: dict[str, Any], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s̄ and U of the selected rows of a rollout at the current θ, forwarded through TRL's log-prob helper in
        chunks of ``prepass_batch_size`` rows. Every process runs the same number of chunks (a ZeRO-3 forward is
        collective), padding with a repeat of one row where it has fewer."""
        host = self.host
        chunk = host.args.prepass_batch_size or 4 * host.args.per_device_train_batch_size
        local_chunks = math.ceil(rows.numel() / chunk)
        counts = gather_rows(host.accelerator, torch.tensor([[float(local_chunks)]], device=rows.device))
        total_chunks = int(counts.max().item())
        fallback = torch.zeros(1, dtype=rows.dtype, device=rows.device)
        s_bars, survives = [], []
        full_mask, sequence_level = loss_mask(full), self.layout.plan.sequence_level
        with disable_gradient_checkpointing(host.model, host.args.gradient_checkpointing_kwargs):
            for k in range(total_chunks):
                part = rows[k * chunk : (k + 1) * chunk]
                real = part.numel() > 0
                part = part if real else fallback
                ids = torch.cat([full["prompt_ids"][part], full["completion_ids"][part]], dim=1)
                attention = torch.cat([full["prompt_mask"][part], full["completion_mask"][part]], dim=1)
                logps, _, _ = host._get_per_token_logps_and_entropies(
                    model=host.model, input_ids=ids, attention_mask=attention,
                    logits_to_keep=full["completion_ids"].size(1), batch_size=chunk,
                )
                if not real:
                    continue
                old, sampling = full.get("old_per_token_logps"), full.get("sampling_per_token_logps")
                # the old log-probs as TRL's loss will read them (the trainer bounds them before the loss)
                old = logps if old is None else bounded_old_logps(logps, old[part], full_mask[part], sequence_level)
                weights = self.layout.post_clip_weights(logps, old, full_mask[part], full["advantages"][part], "train",
                                                        None if sampling is None else sampling[part])
                s_bars.append(weights.s_bar)
                survives.append(weights.survives)
        if not s_bars:
            return torch.ones(0, device=rows.device), torch.ones(0, dtype=torch.bool, device=rows.device)
        return torch.cat(s_bars), torch.cat(survives)
