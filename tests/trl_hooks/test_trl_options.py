"""TRL 1.16 ``GRPOTrainer`` options that DFPO leaves to TRL, each trained with Min-Replace off-policy
(``steps_per_generation`` > ``gradient_accumulation_steps``, group-granular layout) on a tiny model: the reference
page "TRL features and versions" (docs/source/reference/trl.md) points here.

Each option changes what TRL hands the loss (how advantages are scaled or weighted, which rows the loss counts,
how rollouts are generated, buffered or scored, what is logged) but not the loss DFPO rewrites, so on every micro-step:

* the loss is finite and every transformed group balances, Σ_i Â_i s̃_i = 0 to float rounding, with the
  transform acting on some group;
* where TRL's loss is the clipped surrogate alone (no KL term, no entropy mask), each token's gradient is DFPO's
  exact -Â_i s̃_i / (B · accumulation · L_i) on the tokens TRL's loss counts and exactly 0 elsewhere.

With a KL term (β > 0, its reference model) or TRL's entropy mask (``top_entropy_quantile`` < 1), the gradient
adds the KL's or drops the masked tokens': the balance of the weights is checked, not the gradient's formula
(the entropy mask with the gradient target is refused at config time; docs/source/concepts/cancellation.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import IterableDataset
from masked_loss import GroupRecorder, RecordingTrainer, check_token_gradient, start_recording
from tiny import addition_dataset, base_args, last_digit_reward, save_tiny_chat_model, tiny_model, tiny_tokenizer
from tolerance import assert_close_to_rounding

from dfpo_trl import DFPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")

MIN_REPLACE = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                   group_transform="min_replace", learning_rate=0.05, temperature=1.0,
                   per_device_train_batch_size=8, num_generations=4, steps_per_generation=2,
                   gradient_accumulation_steps=1, max_steps=4, max_completion_length=6)


async def async_last_digit(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """TRL awaits coroutine reward functions concurrently."""
    return last_digit_reward(prompts, completions, answer)


def digits_written(completions: list[str], **_: Any) -> list[float]:
    return [float(sum(ch.isdigit() for ch in completion)) for completion in completions]


def iterable_addition() -> IterableDataset:
    rows = addition_dataset().to_list()
    return IterableDataset.from_generator(lambda: iter(rows))


# name: (config fields on top of MIN_REPLACE, reward functions, exact gradient formula, dataset)
OPTIONS: dict[str, tuple[dict[str, Any], list[Any], bool, Any]] = {
    "scale_rewards=batch": (dict(scale_rewards="batch"), [last_digit_reward], True, addition_dataset),
    "scale_rewards=none": (dict(scale_rewards="none"), [last_digit_reward], True, addition_dataset),
    "mask_truncated_completions": (dict(mask_truncated_completions=True, max_completion_length=3),
                                   [last_digit_reward], True, addition_dataset),
    "num_iterations=2": (dict(num_iterations=2), [last_digit_reward], True, addition_dataset),
    "generation_batch_size": (dict(steps_per_generation=None, generation_batch_size=16), [last_digit_reward], True,
                              addition_dataset),
    "reward_weights": (dict(reward_weights=[1.0, 0.25]), [last_digit_reward, digits_written], True,
                       addition_dataset),
    "async reward function": ({}, [async_last_digit], True, addition_dataset),
    "log_completions": (dict(log_completions=True, num_completions_to_print=2), [last_digit_reward], True,
                        addition_dataset),
    "cast_lm_head_to_fp32": (dict(cast_lm_head_to_fp32=True), [last_digit_reward], True, addition_dataset),
    "iterable dataset": (dict(max_steps=4), [last_digit_reward], True, iterable_addition),
    "beta=0.04 (reference model)": (dict(beta=0.04), [last_digit_reward], False, addition_dataset),
    "sync_ref_model": (dict(beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5),
                       [last_digit_reward], False, addition_dataset),
    "use_transformers_continuous_batching": (dict(use_transformers_continuous_batching=True), [last_digit_reward],
                                             True, addition_dataset),
    "top_entropy_quantile=0.5": (dict(top_entropy_quantile=0.5), [last_digit_reward], False, addition_dataset),
}


SLOW = {"use_transformers_continuous_batching"}  # about 90 s on a shared 2-core CPU: its batching threads poll


@pytest.mark.parametrize("option", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                    for name in OPTIONS])
def test_trl_option_keeps_dfpos_objective(option: str, tmp_path: Path) -> None:
    fields, rewards, exact, dataset = OPTIONS[option]
    # TRL loads the reference model from the policy's checkpoint: a saved one where β > 0
    model = str(save_tiny_chat_model(tmp_path / "policy")) if fields.get("beta") else tiny_model()
    trainer = start_recording(RecordingTrainer(
        model=model, reward_funcs=rewards, train_dataset=dataset(), processing_class=tiny_tokenizer(),
        args=DFPOConfig(**base_args(**{**MIN_REPLACE, **fields})),
    ))
    groups = GroupRecorder(trainer)
    assert trainer.group_layout == "group_granular"
    trainer.train()
    assert len(trainer.records) == MIN_REPLACE["max_steps"]
    truncated_rows = 0
    for record in trainer.records:
        inputs = record["inputs"]
        assert torch.isfinite(record["loss"]), record["loss"]
        truncated_rows += int((inputs["completion_mask"].sum(-1) == 0).sum())
        if exact:
            check_token_gradient(record, inputs["completion_mask"], trainer.epsilon_low, trainer.epsilon_high,
                                 MIN_REPLACE["gradient_accumulation_steps"])
    if fields.get("mask_truncated_completions"):
        assert truncated_rows > 0, "no completion was truncated: the mask is untested"
    acted = 0.0
    assert groups.seen
    for grouped, _, _ in groups.seen:
        terms = grouped.advantages.double() * grouped.s_tilde.double()
        assert_close_to_rounding(terms.sum(-1), torch.zeros(terms.size(0), dtype=torch.float64),
                                 scale=terms.abs().sum(-1), dtype=grouped.s_tilde.dtype)
        acted = max(acted, float((grouped.s_tilde - grouped.s_bar).abs().max()))
    assert acted > 1e-3, "Min-Replace never changed a weight: the run is on-policy"
