"""``step_reward``: the mean reward of the completions each optimizer step trains on, logged every step."""

from __future__ import annotations

import pytest
from tiny import make_trainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.metrics.step_reward import STEP_REWARD_METRIC


@pytest.mark.parametrize("transform", ["none", "min_replace"])
def test_every_step_logs_the_reward_of_its_own_completions(transform: str) -> None:
    # 2 rollouts of 16 completions (4 prompts x G = 4), each trained in 4 optimizer steps of one group.
    trainer = make_trainer(
        DFPOTrainer, DFPOConfig, importance_sampling_level="sequence", loss_type="grpo",
        group_transform=transform, steps_per_generation=4, max_steps=8,
    )
    trainer.train()
    history = trainer.state.log_history
    rows = [row for row in history if STEP_REWARD_METRIC in row]
    assert [row["step"] for row in rows] == list(range(1, 9))
    step_rewards = [row[STEP_REWARD_METRIC] for row in rows]
    rollout_rewards = [row["reward"] for row in history if "reward" in row]
    assert len(rollout_rewards) == 2  # TRL: once per rollout
    for rollout, reward in enumerate(rollout_rewards):
        # The four steps of a rollout partition its completions, so their mean is the rollout's mean reward.
        steps = step_rewards[4 * rollout : 4 * rollout + 4]
        assert sum(steps) / 4 == pytest.approx(reward)
        assert all(s in (0.0, 0.25, 0.5, 0.75, 1.0) for s in steps)  # 4 completions of 0/1 rewards each
