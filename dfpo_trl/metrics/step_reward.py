"""The training reward of every optimizer step (``step_reward``): each completion's reward carried with its row.

TRL logs ``reward`` once per rollout (every ``steps_per_generation`` steps), as the mean over the whole generation
batch. With several optimizer steps per rollout that is one point per rollout, too coarse for a reward curve and
its EMA (eq. 19) over a short run. So each rollout row keeps TRL's weighted reward (:func:`row_rewards`, attached by
:func:`attach_row_rewards`), TRL's buffering and shuffling carry it with its row, and every training micro-step adds
its rows' rewards to the metric store (:func:`log_step_reward`): ``step_reward`` is the mean reward of the
completions the optimizer step actually trains on (averaged over its micro-steps and processes).
"""

from __future__ import annotations

from typing import Any

import torch

from .store import MetricStore

__all__ = ["ROW_REWARD_KEY", "STEP_REWARD_METRIC", "attach_row_rewards", "log_step_reward", "row_rewards"]

ROW_REWARD_KEY = "dfpo_row_reward"
STEP_REWARD_METRIC = "step_reward"


def row_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """TRL's weighted total per completion (of every process, as TRL's ``_calculate_rewards`` returns them), NaN
    where every reward function returned None."""
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    total = (rewards_per_func * weights).nansum(dim=1)
    return torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, total)


def attach_row_rewards(output: dict[str, Any], rewards: torch.Tensor | None, process_index: int) -> None:
    """Give each of this process's rollout rows its reward (TRL's own process slice of the gathered rows)."""
    local_rows = output["prompt_ids"].size(0)
    if rewards is not None and rewards.numel() >= local_rows * (process_index + 1):
        start = process_index * local_rows
        output[ROW_REWARD_KEY] = rewards[start : start + local_rows].to(output["prompt_ids"].device)


def log_step_reward(store: MetricStore, inputs: dict[str, Any]) -> None:
    """Add a training micro-batch's rewards to ``step_reward``, pooled over the step's rows on every process at the
    logging step (no host read and no collective per micro-step)."""
    rewards = inputs.get(ROW_REWARD_KEY)
    if rewards is not None:
        valid = ~torch.isnan(rewards)
        total = torch.where(valid, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32)).sum()
        store.add_mean("train", STEP_REWARD_METRIC, total, valid.sum())
