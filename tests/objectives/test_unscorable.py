"""Completions TRL cannot score (every reward function returned None) and ``multi_objective_aggregation``, under a
balancing transform trained off-policy (docs/source/concepts/decisions.md, "TRL features on top": "Unscorable
completions").

TRL 1.16 marks an unscorable completion's reward NaN, centres its group over the *scorable* members only (nan-aware
mean and std; under ``"normalize_then_sum"`` each reward function separately, then over the batch), and only then
sets the unscorable advantage to 0. So each group's Â still sums to 0 and the unscorable members add nothing to
Σ_i Â_i s̃_i: DFPO trains them as zero-advantage members, nothing is refused. Checked on every micro-step of real
runs, where every third completion is unscorable and, with two reward functions, the second also skips others:

* an unscorable row has Â = 0 exactly and its tokens get exactly zero gradient; the other rows get DFPO's exact
  per-token gradient;
* every transformed group has Σ_i Â_i = 0 and Σ_i Â_i s̃_i = 0 to float rounding, also the groups holding
  unscorable members (some of which the transform changed: the steps are off-policy). The rounding is the group's
  own under ``"sum_then_normalize"``; ``"normalize_then_sum"`` centres the summed rewards over the whole batch, so a
  group without signal gets Â_i = -μ_batch/σ_batch with μ_batch zero only up to rounding: its Σ_i Â_i is the
  batch's rounding (1e-8 here, every member the same sign), held to that scale;
* Min-Replace gives every member the group's minimum s̄, the unscorable members' included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from masked_loss import GroupRecorder, RecordingTrainer, check_token_gradient, start_recording
from tiny import addition_dataset, base_args, tiny_model, tiny_tokenizer
from tolerance import assert_close_to_rounding

from dfpo_trl import DFPOConfig
from dfpo_trl.metrics.step_reward import ROW_REWARD_KEY

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(per_device_train_batch_size=8, num_generations=4, steps_per_generation=2,
             gradient_accumulation_steps=1, max_steps=4, max_completion_length=6)
SEQUENCE = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                learning_rate=0.05, temperature=1.0)


def graded_or_none(completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
    """The answer's last digit in the completion; a grader that cannot score every third completion (None)."""
    return [None if i % 3 == 0 else float(ans[-1] in comp)
            for i, (comp, ans) in enumerate(zip(completions, answer, strict=True))]


def digits_or_none(completions: list[str], **_: Any) -> list[float | None]:
    """A second objective: the digits written; None where the first is None, and on others too."""
    return [None if i % 3 == 0 or i % 4 == 1 else float(sum(ch.isdigit() for ch in comp))
            for i, comp in enumerate(completions)]


@pytest.mark.parametrize("transform", ["min_replace", "truncate_rebalance"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_unscorable_completions_keep_the_balance(aggregation: str, transform: str) -> None:
    rewards = [graded_or_none] if aggregation == "sum_then_normalize" else [graded_or_none, digits_or_none]
    trainer = start_recording(RecordingTrainer(
        model=tiny_model(), reward_funcs=rewards, train_dataset=addition_dataset(), processing_class=tiny_tokenizer(),
        args=DFPOConfig(**base_args(**SEQUENCE, **SIZES, group_transform=transform,
                                    multi_objective_aggregation=aggregation)),
    ))
    groups = GroupRecorder(trainer)
    assert trainer.group_layout == "group_granular"
    trainer.train()

    unscorable_rows = 0
    for record in trainer.records:
        inputs, grad = record["inputs"], record["grad"]
        unscorable = torch.isnan(inputs[ROW_REWARD_KEY])
        unscorable_rows += int(unscorable.sum())
        assert bool((inputs["advantages"][unscorable] == 0).all())
        assert bool((grad[unscorable] == 0).all())
        check_token_gradient(record, inputs["completion_mask"], trainer.epsilon_low, trainer.epsilon_high,
                             SIZES["gradient_accumulation_steps"])
    assert unscorable_rows > 0

    acted_with_unscorable = 0
    for grouped, advantages, row_rewards in groups.seen:
        torch.testing.assert_close(grouped.advantages, advantages.to(grouped.advantages.dtype))
        terms = grouped.advantages.double() * grouped.s_tilde.double()
        scales = [grouped.advantages.abs().sum(-1), terms.abs().sum(-1)]  # each group's own terms
        if aggregation == "normalize_then_sum":  # centred over the batch: a group's Â carries the batch's rounding
            scales = [scale.max().expand_as(scale) * SIZES["num_generations"] for scale in scales]
        assert_close_to_rounding(grouped.advantages.sum(-1), torch.zeros(len(advantages)), scale=scales[0])
        assert_close_to_rounding(terms.sum(-1), torch.zeros(len(advantages)), scale=scales[1],
                                 dtype=grouped.s_tilde.dtype)
        if transform == "min_replace":
            minimum = grouped.s_bar.amin(-1, keepdim=True).expand_as(grouped.s_bar)
            assert torch.equal(grouped.s_tilde, minimum)
        has_unscorable = torch.isnan(row_rewards).any(-1)
        changed = (grouped.s_tilde - grouped.s_bar).abs().amax(-1) > 1e-4
        acted_with_unscorable += int((has_unscorable & changed & (grouped.advantages != 0).any(-1)).sum())
    assert acted_with_unscorable > 0, "no off-policy group with an unscorable member was transformed"
