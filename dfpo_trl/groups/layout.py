"""GroupDelivery: the chosen group layout at work, delivering every micro-batch's whole groups
(docs/source/concepts/layouts.md).

Built once by the trainer (the choice is :func:`~dfpo_trl.groups.choice.choose_layout`) from the run's shape
(:class:`~dfpo_trl.groups.shape.RunShape`) and the accelerator. It marks each rollout row with its group and row id,
regroups each rollout where its layout needs it (group-granular shuffle, redistribution), and at loss time
delivers the micro-batch's whole groups (:class:`~dfpo_trl.objectives.step.WholeGroups`): an index into its rows,
the pre-pass values (attached before the optimizer step and read back by :class:`~dfpo_trl.groups.prepass.PrePass`,
which also decides the pre-pass layout's order), or a gather that completes them across processes
(:mod:`dfpo_trl.groups.gather`). It computes no objective: that is
:func:`~dfpo_trl.objectives.step.objective_values`'s. (The config field ``group_layout`` names the layout asked for,
:data:`~dfpo_trl.config.options.GroupLayout` its values; this class is the chosen one at work.)
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor

from ..objectives.step import GatheredGroups, RowScalars, WholeGroups
from ..profiling import profiled
from ..trl_hooks.compat import split_tensor_dict
from .batches import concat_sequence_dicts, permute_sequence_dict
from .choice import (
    LAYOUT_GROUP_GRANULAR,
    LAYOUT_PRE_PASS,
    LAYOUT_REDISTRIBUTED,
    refuse_multimodal_batch,
    regroups_batches,
)
from .gather import gather_groups
from .ids import (
    GROUP_IDS_KEY,
    GROUP_SHUFFLE_STREAM,
    ROW_IDS_KEY,
    WHOLE_GROUPS_KEY,
    consecutive_group_ids,
    group_granular_order,
    group_index,
    holds_whole_groups,
    rollout_generator,
    rollout_ids,
)
from .prepass import PrePass
from .redistribute import redistribute
from .shape import RunShape

__all__ = ["GroupDelivery"]


class GroupDelivery:
    """The group layout of one trainer (docs/source/concepts/layouts.md): ``name`` is one of
    :mod:`dfpo_trl.groups.choice`'s, ``needs_groups`` whether any micro-batch's group view is read (a sequence rewrite
    or the group metrics), ``options`` the DFPO options that are on (for the multimodal refusal)."""

    def __init__(self, name: str, shape: RunShape, accelerator: Any, needs_groups: bool, options: str) -> None:
        self.name, self.shape, self.accelerator = name, shape, accelerator
        self.needs_groups, self.options = needs_groups, options

    # ------------------------------------------------------------------------------------------ rollout
    def add_ids(self, output: dict[str, Any], mode: str) -> None:
        """An explicit group id and global row id per rollout row (global row // G, as TRL's sampler lays rows
        out)."""
        rows, device = output["prompt_ids"].size(0), output["prompt_ids"].device
        output[GROUP_IDS_KEY], output[ROW_IDS_KEY] = rollout_ids(
            rows, self.shape.group_size(mode), self.shape.process_index, device
        )

    def regroup(self, buffered: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """TRL's buffered rollout as this layout trains on it, once per rollout generated at optimizer step
        ``step``: TRL's per-sample shuffle replaced by a shuffle of whole groups (group-granular and pre-pass
        layouts), or the rollout redistributed over processes; each micro-batch marked with whether it holds whole
        groups."""
        shape = self.shape
        if regroups_batches(self.name):
            refuse_multimodal_batch(buffered[0], self.name, self.options)
        if self.name in (LAYOUT_GROUP_GRANULAR, LAYOUT_PRE_PASS):
            # Whole groups in consecutive rows, groups in a random order: every micro-batch holds whole groups
            # (group_granular), or an optimizer step's rows come from as few groups as its size allows, the only
            # ones the pre-pass forwards (pre_pass, the order PrePass.order decides; docs/source/concepts/layouts.md,
            # "The pre-pass and its cost").
            full = concat_sequence_dicts(buffered)
            if self.name == LAYOUT_PRE_PASS:
                order = PrePass.order(full[GROUP_IDS_KEY], shape, step)
            else:  # DFPO's own draw: torch's global RNG stream stays TRL's
                generator = rollout_generator(shape.seed, shape.process_index, step, stream=GROUP_SHUFFLE_STREAM)
                order = group_granular_order(full[GROUP_IDS_KEY], generator)
            buffered = split_tensor_dict(permute_sequence_dict(full, order), shape.steps_per_generation)
        elif self.name == LAYOUT_REDISTRIBUTED:
            full = redistribute(buffered, self.accelerator, shape.num_generations, shape.per_device_batch,
                                shape.seed, step)
            buffered = split_tensor_dict(full, shape.steps_per_generation)
        self._mark_whole_groups(buffered)
        return buffered

    def _mark_whole_groups(self, buffered: list[dict[str, Any]]) -> None:
        """Record in each buffered micro-batch whether it holds whole groups (one host read per rollout, not one
        per micro-step); in the group-granular layout, check that it does."""
        if not self.needs_groups:
            return
        for micro in buffered:
            group_ids = micro[GROUP_IDS_KEY]
            if self.name == LAYOUT_REDISTRIBUTED:
                micro[WHOLE_GROUPS_KEY] = False  # whole across processes by construction, not locally
            elif self.name == LAYOUT_GROUP_GRANULAR:
                group_index(group_ids, self.shape.num_generations)  # raises with the fix if a group is cut apart
                micro[WHOLE_GROUPS_KEY] = True
            else:
                micro[WHOLE_GROUPS_KEY] = holds_whole_groups(group_ids, self.shape.num_generations)

    # --------------------------------------------------------------------------------------------- loss
    def whole_groups(self, inputs: dict[str, Any], mode: str) -> WholeGroups:
        """This micro-batch's whole groups.

        Args:
            inputs: the micro-batch TRL's loss reads. mode: ``"train"`` or ``"eval"`` (G of that mode).

        Returns:
            :class:`~dfpo_trl.objectives.step.WholeGroups`: the (num_groups, G) index when it holds whole groups
            (else None), the pre-pass values when attached, and otherwise a gather that completes its groups across
            processes.
        """
        with profiled("dfpo/whole_groups"):
            index = self.group_index(inputs, mode)
            precomputed = PrePass.attached(inputs)
            gather = None
            if index is None and precomputed is None:
                gather = partial(self._gather, self._row_ids(inputs), self._group_ids(inputs, mode), mode)
            return WholeGroups(index, precomputed, gather)

    def group_index(self, inputs: dict[str, Any], mode: str) -> Tensor | None:
        """The (num_groups, G) row index when this micro-batch holds whole groups, else None."""
        group_size, group_ids = self.shape.group_size(mode), self._group_ids(inputs, mode)
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
            group_ids = consecutive_group_ids(rows, self.shape.group_size(mode), device=device)
        return group_ids

    def _row_ids(self, inputs: dict[str, Any]) -> Tensor:
        row_ids = inputs.get(ROW_IDS_KEY)
        if row_ids is None:  # a hand-built batch: this process's block of the global batch
            rows, device = inputs["completion_ids"].size(0), inputs["completion_ids"].device
            _, row_ids = rollout_ids(rows, 1, self.shape.process_index, device)
        return row_ids

    def _gather(
        self, row_ids: Tensor, group_ids: Tensor, mode: str, rows: RowScalars, advantages: Tensor
    ) -> GatheredGroups:
        """Every process's rows of this micro-step, grouped; in the redistributed layout (training) the groups are
        whole across processes by construction, so no group check and no host read."""
        equal_rows = self.name == LAYOUT_REDISTRIBUTED and mode == "train"
        return gather_groups(self.accelerator, row_ids, group_ids, rows, advantages, self.shape.group_size(mode),
                             equal_rows)
