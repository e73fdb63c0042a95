"""Study v3's tasks, given to ``dfpo-train --task`` by import path (the runs start in the repository root):

* ``dfpo_bench.study_v3_tasks:strict`` — ``two_forms`` with both canonical forms rewarded 1 and every other wording 0
  (:class:`dfpo_trl.cli.TwoFormsReward` with ``unformatted=0``), so held-out accuracy is format accuracy and the
  rewarded forms are the only thing the policy is pushed towards;
* ``dfpo_bench.study_v3_tasks:equalised`` — the same, plus a second reward that equalises the two forms' counts among
  the rewarded completions of each group (the count-effect control arm, :func:`count_equalised_rewards`).

Why a reward and not a weight: with ``scale_rewards none`` TRL's advantage is r − mean(r) per group, and the rewards
below make it exactly w_f (1 − p) for a rewarded row of form f and −p for the others (p: the group's rewarded share),
with w_f = n_R / (m n_f): each of the m forms present among the n_R rewarded rows gets the same total advantage, the
group's mean reward is unchanged, and no trainer code changes. Groups are the runs of equal ``row_id`` (TRL repeats
each dataset row ``num_generations`` times in a row; a row id is unique, so adjacent groups never merge). That holds
for one training process, as study v3 launches every run; under data parallelism a group cut across processes would
be equalised part by part, so the arm is defined for one process only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset
from dfpo_trl import RewardFunc, safe_reward
from dfpo_trl.cli import TwoFormsReward, TwoFormsTask


def count_equalised_rewards(rewards: Sequence[float], forms: Sequence[int | None]) -> list[float]:
    """One group's rewards with the rewarded forms' counts equalised. ``rewards``: 0/1 per row; ``forms``: the
    canonical form of each row (None: none). A rewarded row of form f gets p + w_f (1 − p), p = n_R / G,
    w_f = n_R / (m n_f) (m forms present among the rewarded rows); others keep 0. Then mean and every centred
    unrewarded row are as before, and Σ_{i ∈ f} (r_i − p) = n_R (1 − p) / m for each present form."""
    if len(rewards) != len(forms):
        raise ValueError(f"got {len(rewards)} rewards but {len(forms)} forms")
    if any(r not in (0.0, 1.0) for r in rewards):
        raise ValueError("count_equalised_rewards needs 0/1 rewards (the strict two_forms reward)")
    rewarded = [i for i, r in enumerate(rewards) if r == 1.0]
    if not rewarded:
        return [float(r) for r in rewards]
    counts: dict[int | None, int] = {}
    for i in rewarded:
        counts[forms[i]] = counts.get(forms[i], 0) + 1
    p = len(rewarded) / len(rewards)
    out = [0.0] * len(rewards)
    for i in rewarded:
        weight = len(rewarded) / (len(counts) * counts[forms[i]])
        out[i] = p + weight * (1.0 - p)
    return out


def group_runs(ids: Sequence[Any]) -> list[range]:
    """The index ranges of consecutive equal ids (one group each)."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            runs.append(range(start, i))
            start = i
    return runs


class FormCountCorrection:
    """The second reward of ``equalised``: count_equalised_rewards − strict reward per row (its mean over a group is
    0, so TRL's logged mean reward is the strict one's)."""

    __name__ = "form_count_correction"

    def __init__(self, task: TwoFormsTask) -> None:
        self.task, self.strict = task, TwoFormsReward(unformatted=0.0)

    def __call__(self, prompts: list[Any], completions: list[Any], answer: list[int], row_id: list[int],
                 **kwargs: Any) -> list[float]:
        base = [float(r) for r in self.strict(prompts, completions, answer)]
        forms = [self.task.form_of(c, {"answer": a}) for c, a in zip(completions, answer, strict=True)]
        out = [0.0] * len(base)
        for group in group_runs(row_id):
            equal = count_equalised_rewards([base[i] for i in group], [forms[i] for i in group])
            for i, value in zip(group, equal, strict=True):
                out[i] = value - base[i]
        return out


@dataclass
class StrictTwoFormsTask(TwoFormsTask):
    """``two_forms`` with other wordings rewarded 0; rows carry ``row_id`` (their index) for the equalised arm."""

    name: str = "two_forms_strict"
    reward_funcs: list[RewardFunc] = field(default_factory=lambda: [safe_reward(TwoFormsReward(unformatted=0.0))])

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        data = super().build_dataset(split, n, seed)
        return data.add_column("row_id", list(range(len(data))))


def strict() -> StrictTwoFormsTask:
    return StrictTwoFormsTask()


def equalised() -> StrictTwoFormsTask:
    task = StrictTwoFormsTask(name="two_forms_equalised")
    task.reward_funcs = [*task.reward_funcs, safe_reward(FormCountCorrection(task))]
    return task
