"""A rollout that no reward function scores: TRL 1.16 warns and trains on, and so does ``DFPOTrainer`` (it once
raised, and a long multi-task run died at the first such rollout). TRL's own test
(``test_warning_raised_all_rewards_none``, tests/test_grpo_trainer.py at v1.16) asserts that TRL's warning reaches
its logger and that training ends; the same assertion holds here, for GSPO and for Min-Replace, on a tiny model
built in the test, and the warning is one line with how many completions had no reward (trl_hooks/no_reward.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from tiny import addition_dataset, base_args, tiny_model, tiny_tokenizer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.trl_hooks.no_reward import NO_REWARD_WARNING, TRL_LOGGER

pytestmark = pytest.mark.usefixtures("one_thread")


def reward_that_never_applies(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [None] * len(completions)


def every_other(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Scores the even completions (their length), not the odd ones."""
    return [float(len(c)) if i % 2 == 0 else None for i, c in enumerate(completions)]


def _train(caplog: pytest.LogCaptureFixture, reward: Any, **fields: Any) -> tuple[DFPOTrainer, list[str]]:
    trainer = DFPOTrainer(
        model=tiny_model(), reward_funcs=reward, train_dataset=addition_dataset(), processing_class=tiny_tokenizer(),
        args=DFPOConfig(**base_args(max_steps=2, learning_rate=0.1, **fields)),
    )
    with caplog.at_level(logging.WARNING, logger=TRL_LOGGER):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if r.name == TRL_LOGGER and NO_REWARD_WARNING in r.getMessage()]
    return trainer, said


@pytest.mark.parametrize("fields", [
    {},
    dict(importance_sampling_level="sequence", loss_type="grpo", steps_per_generation=2, group_transform="min_replace"),
], ids=["grpo", "min_replace"])
def test_a_rollout_no_reward_applies_to_warns_in_one_line_and_trains_on(
    caplog: pytest.LogCaptureFixture, fields: dict[str, Any]
) -> None:
    start = {n: p.detach().clone() for n, p in tiny_model().named_parameters()}
    trainer, said = _train(caplog, reward_that_never_applies, **fields)
    assert NO_REWARD_WARNING in caplog.text  # TRL's own test's assertion
    assert trainer.state.global_step == 2 and trainer.state.log_history[-1]["train_loss"] is not None
    assert said and all("\n" not in line for line in said)
    rollout = 4 * fields.get("steps_per_generation", 1)
    assert f"(none of the rollout's {rollout} completions has a reward: their advantages are 0 and nothing is " \
           "learned from this rollout; training goes on, as in TRL). Please ensure that at least one reward function " \
           "returns a valid reward." in said[0]
    # nothing to learn from: every advantage is 0, so no weight moves (AdamW without weight decay)
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), start[name]), name


def test_some_unscored_completions_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    _, said = _train(caplog, every_other)
    assert said and "2 of the rollout's 4 completions have no reward (advantage 0); the others train" in said[0]
