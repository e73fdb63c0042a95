"""The training reward of every optimizer step, not only of every rollout.

TRL logs ``reward`` once per rollout (every ``steps_per_generation`` steps), as the mean over the whole
generation batch. With several optimizer steps per rollout that is one point per rollout, too coarse for a
reward curve and its EMA (eq. 19) over a short run. ``StepRewardMixin`` carries each completion's reward with
its row through TRL's buffering and shuffling, and logs ``step_reward``: the mean reward of the completions the
optimizer step actually trains on (averaged over its micro-steps and processes).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROW_REWARD_KEY", "STEP_REWARD_METRIC", "StepRewardMixin"]

ROW_REWARD_KEY = "dfpo_row_reward"
STEP_REWARD_METRIC = "step_reward"


class StepRewardMixin:
    """For a ``trl.GRPOTrainer`` subclass: each rollout row keeps its reward; each training micro-step logs theirs."""

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> torch.Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # TRL's weighted total per completion (all processes), NaN where every reward function returned None.
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        total = (rewards_per_func * weights).nansum(dim=1)
        self._dfpo_rollout_rewards = torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, total)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._dfpo_rollout_rewards = None
        output = super()._generate_and_score_completions(inputs)
        rewards = self._dfpo_rollout_rewards
        self._dfpo_rollout_rewards = None
        local_rows = output["prompt_ids"].size(0)
        if rewards is not None and rewards.numel() >= local_rows * (self.accelerator.process_index + 1):
            start = self.accelerator.process_index * local_rows  # TRL's own process slice of the gathered rows
            output[ROW_REWARD_KEY] = rewards[start : start + local_rows].to(output["prompt_ids"].device)
        return output

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        rewards = inputs.get(ROW_REWARD_KEY)
        if rewards is not None and self.model.training:
            # pooled over the step's rows on every process at the logging step (metric_store): no host read and
            # no collective per micro-step
            valid = ~torch.isnan(rewards)
            total = torch.where(valid, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32)).sum()
            self.dfpo_metrics.add_mean("train", STEP_REWARD_METRIC, total, valid.sum())
        return super()._compute_loss(model=model, inputs=inputs)
