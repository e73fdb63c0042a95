"""TRL's ``rollout_func`` with an ``env_mask``, trained with Min-Replace off-policy (``steps_per_generation`` >
``gradient_accumulation_steps``) in the group-granular and pre-pass layouts.

A ``rollout_func`` replaces TRL's generation: it returns the prompt and completion ids and the sampler's
log-probs, and may return ``env_mask`` (1 on the policy's tokens, 0 on tokens an environment spliced in), which TRL
turns into its ``tool_mask``, so the loss mask is ``completion_mask * env_mask``. Here the rollout samples a few
tokens from the policy, splices in a fixed two-token environment reply, and lets the policy continue. Checked on
every micro-step (the helpers of ``masked_loss.py``, shared with the tool-call tests):

* the zeros of the mask TRL's loss reads sit exactly on the spliced reply of the row they belong to, after every
  regrouping;
* the loss's gradient with respect to each token's log-prob is exactly 0 on the environment's tokens and DFPO's
  -Â_i s̃_i / (B · accumulation · L_i) on the policy's own, with L_i counting only them;
* Min-Replace changed the weights (the steps are off-policy), and s̄ is the post-clip of ρ over the policy's tokens
  only (counting the reply's tokens would give a measurably different s̄).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from masked_loss import RecordingTrainer, check_token_gradient, sequence_weights, start_recording
from tiny import WORDS, addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer

from dfpo_trl import DFPOConfig

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning")]

ENV_REPLY = [WORDS.index("is"), WORDS.index("so")]  # the environment's reply, spliced into every completion
MIN_REPLACE = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                   group_transform="min_replace", learning_rate=0.05, temperature=1.0)
LAYOUTS = {
    "group_granular": dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
                           gradient_accumulation_steps=1, max_steps=4),
    "pre_pass": dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=4,
                     gradient_accumulation_steps=2, max_steps=4),
}


@torch.no_grad()
def sample(model: torch.nn.Module, ids: list[int], count: int) -> tuple[list[int], list[float]]:
    """``count`` tokens sampled from ``model`` after ``ids`` (temperature 1), with their log-probs."""
    tokens: list[int] = []
    logps: list[float] = []
    for _ in range(count):
        log_probs = model(torch.tensor([ids + tokens])).logits[0, -1].float().log_softmax(-1)
        token = int(torch.multinomial(log_probs.exp(), 1))
        tokens.append(token)
        logps.append(float(log_probs[token]))
    return tokens, logps


class EnvironmentRollout:
    """A ``rollout_func``: per prompt, 1–3 policy tokens, the environment's reply, 2 more policy tokens. Keeps
    where it spliced the reply in each completion it returned (``spans``, by completion ids)."""

    def __init__(self) -> None:
        self.spans: dict[tuple[int, ...], set[tuple[int, int]]] = {}
        self.calls = 0

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, list]:
        self.calls += 1
        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        for row, prompt in enumerate(prompts):
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            first, first_logps = sample(model, prompt_ids, 1 + row % 3)
            second, second_logps = sample(model, prompt_ids + first + ENV_REPLY, 2)
            completion = first + ENV_REPLY + second
            out["prompt_ids"].append(prompt_ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(first_logps + [0.0] * len(ENV_REPLY) + second_logps)  # the reply: not sampled
            out["env_mask"].append([1] * len(first) + [0] * len(ENV_REPLY) + [1] * len(second))
            self.spans.setdefault(tuple(completion), set()).add((len(first), len(first) + len(ENV_REPLY)))
        return out


def build_trainer(sizes: dict[str, Any], rollout: EnvironmentRollout) -> RecordingTrainer:
    return start_recording(RecordingTrainer(
        model=tiny_model(), reward_funcs=last_digit_reward, train_dataset=addition_dataset(),
        processing_class=tiny_tokenizer(), args=DFPOConfig(**base_args(**{**MIN_REPLACE, **sizes})),
        rollout_func=rollout,
    ))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_env_masked_tokens_carry_no_gradient_under_min_replace(layout: str) -> None:
    sizes = LAYOUTS[layout]
    rollout = EnvironmentRollout()
    trainer = build_trainer(sizes, rollout)
    assert trainer.group_layout == layout
    trainer.train()
    assert rollout.calls == sizes["max_steps"] * sizes["gradient_accumulation_steps"] // sizes["steps_per_generation"]
    assert len(trainer.records) == sizes["max_steps"] * sizes["gradient_accumulation_steps"]
    eps_low, eps_high = trainer.epsilon_low, trainer.epsilon_high
    transform_acted = mask_matters = graded_rows = 0.0
    for record in trainer.records:
        inputs = record["inputs"]
        assert torch.isfinite(record["loss"]), record["loss"]
        completion_mask, env_mask, ids = inputs["completion_mask"], inputs["tool_mask"], inputs["completion_ids"]
        for row in range(ids.size(0)):  # the zeros are exactly this row's spliced reply
            length = int(completion_mask[row].sum())
            zeros = (env_mask[row, :length] == 0).nonzero().squeeze(1).tolist()
            assert (zeros[0], zeros[-1] + 1) in rollout.spans[tuple(ids[row, :length].tolist())], (row, zeros)
            assert zeros == list(range(zeros[0], zeros[-1] + 1))
        loss_mask = completion_mask * env_mask
        check_token_gradient(record, loss_mask, eps_low, eps_high, sizes["gradient_accumulation_steps"])
        graded_rows += float((record["grad"] * loss_mask != 0).any(-1).sum())
        weights = record["weights"]
        torch.testing.assert_close(weights["s_bar"].double(), sequence_weights(record, loss_mask, eps_low,
                                                                               eps_high)[1], rtol=1e-4, atol=1e-5)
        unmasked = sequence_weights(record, completion_mask, eps_low, eps_high)[1]
        mask_matters = max(mask_matters, float((unmasked - weights["s_bar"].double()).abs().max()))
        transform_acted = max(transform_acted, float((weights["s_tilde"] - weights["s_bar"]).abs().max()))
    assert graded_rows > 0, "no row got a gradient on its own tokens"
    assert transform_acted > 1e-3, "Min-Replace never changed a weight: the run is on-policy"
    assert mask_matters > 1e-3, "counting the reply's tokens would not change s̄: the check above cannot fail"
