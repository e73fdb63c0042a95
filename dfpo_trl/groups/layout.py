"""GroupLayout: the chosen layout at run time, which gives every micro-batch's transform whole groups.

Built once by the trainer (the choice is :func:`~dfpo_trl.groups.policy.choose_layout`). It marks each rollout row
with its group and row id, regroups each rollout where its layout needs it (group-granular shuffle, redistribution),
runs the pre-pass before an optimizer step (:mod:`dfpo_trl.groups.prepass`), and at loss time returns the rows'
sequence weights: from the pre-pass, from the micro-batch's own whole groups, or from groups completed by a
cross-process gather (:mod:`dfpo_trl.groups.gather`). The objective itself is the plan's
(:class:`~dfpo_trl.objectives.plan.ObjectivePlan`); ``host`` is the trainer, whose TRL settings (ε, the vLLM
importance-sampling switch, the accelerator) are read at each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..metrics.mechanism import log_group_metrics
from ..objectives.weights import PostClipWeights, RowWeights
from ..trl_hooks.compat import off_policy_step, split_tensor_dict, trl_off_policy_keep
from .batches import concat_sequence_dicts, permute_sequence_dict
from .gather import gather_row_scalars
from .ids import (
    GROUP_IDS_KEY,
    GROUP_SHUFFLE_STREAM,
    ROW_IDS_KEY,
    WHOLE_GROUPS_KEY,
    consecutive_group_ids,
    group_granular_order,
    group_index,
    holds_whole_groups,
    positions_of,
    rollout_generator,
    rollout_ids,
)
from .policy import (
    LAYOUT_GROUP_GRANULAR,
    LAYOUT_PRE_PASS,
    LAYOUT_REDISTRIBUTED,
    choose_layout,
    model_is_multimodal,
    multimodal_refusal,
    refuse_multimodal_batch,
    regroups_batches,
)
from .prepass import PRE_PASS_KEYS, PrePass
from .redistribute import redistribute

if TYPE_CHECKING:
    from ..metrics.store import MetricStore
    from ..objectives.plan import GroupedWeights, ObjectivePlan

__all__ = ["GroupLayout"]


class GroupLayout:
    """The group layout of one trainer (docs/layouts.md); ``name`` is one of :mod:`dfpo_trl.groups.policy`'s."""

    def __init__(self, host: Any, plan: ObjectivePlan, store: MetricStore) -> None:
        self.host, self.plan, self.store = host, plan, store
        self.name = choose_layout(host.args, host.accelerator.num_processes)
        self.pre_pass = PrePass(host, self) if self.name == LAYOUT_PRE_PASS else None
        model = host.accelerator.unwrap_model(host.model)
        if regroups_batches(self.name) and model_is_multimodal(model, host.processing_class):
            raise ValueError(
                multimodal_refusal(self.name, plan.active_options, "the model or its processor is multimodal")
            )

    def group_size(self, mode: str) -> int:
        """G of the batches of ``mode``: TRL's ``num_generations`` in training, ``num_generations_eval`` else."""
        return self.host.num_generations if mode == "train" else self.host.num_generations_eval

    # ------------------------------------------------------------------------------------------ rollout
    def add_ids(self, output: dict[str, Any], mode: str) -> None:
        """An explicit group id and global row id per rollout row (global row // G, as TRL's sampler lays rows
        out)."""
        rows, device = output["prompt_ids"].size(0), output["prompt_ids"].device
        process = self.host.accelerator.process_index
        output[GROUP_IDS_KEY], output[ROW_IDS_KEY] = rollout_ids(rows, self.group_size(mode), process, device)

    def regroup(self, buffered: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """TRL's buffered rollout as this layout trains on it, once per rollout: TRL's per-sample shuffle replaced
        by a group-granular one, or the rollout redistributed over processes; each micro-batch marked with
        whether it holds whole groups."""
        host, spg = self.host, self.host.args.steps_per_generation
        if regroups_batches(self.name):
            refuse_multimodal_batch(buffered[0], self.name, self.plan.active_options)
        if self.name == LAYOUT_GROUP_GRANULAR:
            full = concat_sequence_dicts(buffered)
            generator = rollout_generator(  # DFPO's own draw: torch's global RNG stream stays TRL's
                host.args.seed, host.accelerator.process_index, host.state.global_step, stream=GROUP_SHUFFLE_STREAM
            )
            buffered = split_tensor_dict(permute_sequence_dict(full, group_granular_order(full[GROUP_IDS_KEY],
                                                                                          generator)), spg)
        elif self.name == LAYOUT_REDISTRIBUTED:
            full = redistribute(buffered, host.accelerator, host.num_generations,
                                host.args.per_device_train_batch_size, host.args.seed, host.state.global_step)
            buffered = split_tensor_dict(full, spg)
        self._mark_whole_groups(buffered)
        return buffered

    def _mark_whole_groups(self, buffered: list[dict[str, Any]]) -> None:
        """Record in each buffered micro-batch whether it holds whole groups (one host read per rollout, not one
        per micro-step); in the group-granular layout, check that it does."""
        if not self.plan.needs_groups:
            return
        for micro in buffered:
            group_ids = micro[GROUP_IDS_KEY]
            if self.name == LAYOUT_REDISTRIBUTED:
                micro[WHOLE_GROUPS_KEY] = False  # whole across processes by construction, not locally
            elif self.name == LAYOUT_GROUP_GRANULAR:
                group_index(group_ids, self.host.num_generations)  # raises with the fix if a group is cut apart
                micro[WHOLE_GROUPS_KEY] = True
            else:
                micro[WHOLE_GROUPS_KEY] = holds_whole_groups(group_ids, self.host.num_generations)

    def before_micro_step(self, buffered: list[dict[str, Any]], step: int) -> None:
        """The pre-pass, at the first micro-step of each optimizer step (pre-pass layout only)."""
        if self.pre_pass is not None and step % self.host.args.gradient_accumulation_steps == 0:
            self.pre_pass.run(buffered, step)

    # --------------------------------------------------------------------------------------------- loss
    def group_index(self, inputs: dict[str, Any], mode: str) -> Tensor | None:
        """The (num_groups, G) row index when this micro-batch holds whole groups, else None."""
        group_size, group_ids = self.group_size(mode), self._group_ids(inputs, mode)
        whole = inputs.get(WHOLE_GROUPS_KEY)  # known for buffered training micro-batches (_mark_whole_groups)
        if whole is not None:
            return group_index(group_ids, group_size, validate=False) if whole else None
        if self.name == LAYOUT_GROUP_GRANULAR and mode == "train":
            return group_index(group_ids, group_size)  # raises with the fix if a group is cut apart
        return group_index(group_ids, group_size) if holds_whole_groups(group_ids, group_size) else None

    def _group_ids(self, inputs: dict[str, Any], mode: str) -> Tensor:
        group_ids = inputs.get(GROUP_IDS_KEY)
        if group_ids is None:  # a hand-built batch: consecutive blocks of num_generations
            rows, device = inputs["completion_ids"].size(0), inputs["completion_ids"].device
            group_ids = consecutive_group_ids(rows, self.group_size(mode), device=device)
        return group_ids

    def row_weights(
        self, inputs: dict[str, Any], per_token_logps: Tensor, old: Tensor, mask: Tensor, advantages: Tensor,
        index: Tensor | None, mode: str, differentiate: bool,
    ) -> RowWeights:
        """s̄, s̃, U and the two-sided flags of this micro-batch's rows: from the pre-pass (computed at this
        optimizer step's θ for whole groups), from this forward's whole groups (``index``), or gathered across
        processes. ``old``: the old log-probs TRL's loss reads (after the log-ratio bound; the detached current
        ones when TRL computed none). ``differentiate``: keep the graph through s̄ and the transform (the
        no-stop-gradient ablation)."""
        if PRE_PASS_KEYS[1] in inputs:
            return RowWeights(*(inputs[key] for key in PRE_PASS_KEYS))
        logps = per_token_logps if differentiate else per_token_logps.detach()
        with torch.set_grad_enabled(differentiate):
            post_clip = self.post_clip_weights(logps, old, mask, advantages, mode,
                                               inputs.get("sampling_per_token_logps"))
            factor = self.aggregation_factor(inputs, mask, mask.sum().expand(mask.size(0)))
            if index is not None:
                return self._transform(post_clip.s_bar, advantages, post_clip.survives, factor, index, mode).rows
            # the group's other members are on other processes in this micro-step
            return self._transform_gathered(inputs, post_clip, advantages, factor, mode)

    def post_clip_weights(
        self, logps: Tensor, old: Tensor, mask: Tensor, advantages: Tensor, mode: str,
        sampling: Tensor | None = None,
    ) -> PostClipWeights:
        """s̄ and U with TRL's clip range, U narrowed to the rows TRL's off-policy mask keeps when
        ``off_policy_mask_threshold`` is set (docs/cancellation.md, eq. C2), computed as TRL's loss will compute it
        from the same ``old`` (what TRL's loss reads) and ``sampling`` (the sampler's log-probs, if any); counts the
        sequences whose NaN/Inf token log-ratios were sanitised."""
        host = self.host
        weights = self.plan.post_clip_weights(
            logps, old, mask, advantages, host.epsilon_low, host.epsilon_high, host.args.delta
        )
        self.store.add_sum(mode, "transform/sanitised_weights", weights.sanitised.sum())
        keep = trl_off_policy_keep(host, advantages, logps.detach(), old, sampling, mask)
        return weights if keep is None else weights._replace(survives=weights.survives & keep)

    def aggregation_factor(self, inputs: dict[str, Any], mask: Tensor, micro_batch_tokens: Tensor) -> Tensor:
        """c_i (eq. C3) of every row, with TRL's vLLM importance-sampling ratio where TRL applies it to the loss."""
        host, ratio = self.host, None
        if host.use_vllm and host.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
            ratio = inputs["importance_sampling_ratio"]
        return self.plan.aggregation_factor(mask, ratio, micro_batch_tokens)

    def _transform(
        self, s_bar: Tensor, advantages: Tensor, survives: Tensor, factor: Tensor, index: Tensor, mode: str
    ) -> GroupedWeights:
        grouped = self.plan.transform_rows(s_bar, advantages, survives, factor, index)
        if self.plan.group_metrics:
            log_group_metrics(self.store, mode, grouped,
                              off_policy=mode == "train" and self.host.model.training and off_policy_step(self.host))
        return grouped

    def _transform_gathered(
        self, inputs: dict[str, Any], post_clip: PostClipWeights, advantages: Tensor, factor: Tensor, mode: str
    ) -> RowWeights:
        s_bar, survives = post_clip.s_bar, post_clip.survives
        row_ids = inputs.get(ROW_IDS_KEY)
        if row_ids is None:
            offset = self.host.accelerator.process_index * s_bar.size(0)
            row_ids = torch.arange(offset, offset + s_bar.size(0), device=s_bar.device)
        all_ids, gathered = self.transform_across_processes(
            row_ids, self._group_ids(inputs, mode), s_bar, advantages, survives, factor, mode,
            equal_rows=self.name == LAYOUT_REDISTRIBUTED and self.host.model.training,
        )
        position = positions_of(row_ids, all_ids)
        return RowWeights(s_bar, gathered.s_tilde[position].to(s_bar.dtype), survives, gathered.two_sided[position])

    def transform_across_processes(
        self, row_ids: Tensor, group_ids: Tensor, s_bar: Tensor, advantages: Tensor, survives: Tensor,
        factor: Tensor, mode: str, equal_rows: bool = False,
    ) -> tuple[Tensor, RowWeights]:
        """Gather (row id, group id, s̄, Â, U, c) from all processes, transform the complete groups, log the
        metrics. Returns every gathered row's id and weights (the same on every process). ``equal_rows``: groups
        whole across processes by construction (the redistributed layout), so no group check and no host read."""
        rows = gather_row_scalars(self.host.accelerator, row_ids, group_ids, s_bar, advantages, survives, factor,
                                  equal_rows)
        index = group_index(rows.group_ids, self.group_size(mode), validate=not equal_rows)
        grouped = self._transform(rows.s_bar, rows.advantages, rows.survives, rows.factor, index, mode)
        return rows.row_ids, grouped.rows
