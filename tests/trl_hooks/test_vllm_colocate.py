"""TRL's colocated vLLM path (``use_vllm=True, vllm_mode="colocate"``) run on the CPU through a stand-in engine.

TRL's ``VLLMGeneration`` builds its engine as ``vllm.LLM(...)`` and drives it through four calls: ``generate``
(token-id prompts, one completion each, with the sampled tokens' log-probs), the weight sync
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`` (one parameter at a time, at each
new optimizer step before a rollout), ``reset_prefix_cache`` and, with sleep mode, ``sleep``/``wake_up``. The stand-in
below is that surface and nothing more: a bfloat16 copy of the policy's architecture (vLLM serves in reduced
precision, so its log-probs differ from the trainer's float32 ones and TRL's importance-sampling ratio is not 1)
that starts from its own random weights, so it samples what the policy would only once the sync has pushed the
policy's weights. vLLM itself is not imported: TRL's module is told it is available and given the stand-in.

Checked on every micro-step of a Min-Replace run, off-policy, with TRL's default IS correction (``sequence_mask``):

* the sync ran before every rollout, every parameter under its name, and the engine's weights were the policy's
  (in bfloat16) at every generation, also after the policy had moved;
* TRL's ``sampling_per_token_logps`` are the engine's log-probs, and its ratio is exp(Σ_t (old − sampling)) per
  sequence;
* DFPO's transform balances without the ratio (Σ_i Â_i s̃_i = 0 in each group), and TRL multiplies the ratio in
  after it: each token's gradient is DFPO's -Â_i s̃_i / (B · accumulation · L_i) times the sequence's ratio.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trl.generation.vllm_generation as vllm_generation
from masked_loss import RecordingTrainer, expected_token_gradient, start_recording
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer
from tolerance import assert_close_to_rounding
from transformers import LlamaForCausalLM

from dfpo_trl import DFPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")

COLOCATE = dict(use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_correction=True,
                importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                group_transform="min_replace", learning_rate=0.05, temperature=1.0,
                per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
                gradient_accumulation_steps=1, max_steps=4, max_completion_length=6)
ENGINE_DTYPE = torch.bfloat16


def vllm_support(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[int]:
    """The token ids vLLM samples from, element by element in its order (its min-p processor, then
    ``apply_top_k_top_p``): min-p keeps p ≥ min_p · max p; top-k the k largest, ties at the k-th kept; top-p, on the
    distribution renormalised over those, drops tokens from the smallest up while their running mass is ≤ 1 − top_p,
    the largest always kept. ``probs``: the tempered distribution."""
    kept = list(range(len(probs)))
    if min_p > 0:
        kept = [i for i in kept if probs[i] >= min_p * max(probs)]
    if 0 < top_k < len(kept):
        kth = sorted((probs[i] for i in kept), reverse=True)[top_k - 1]
        kept = [i for i in kept if probs[i] >= kth]
    if top_p < 1.0:
        total = sum(probs[i] for i in kept)
        ascending = sorted(kept, key=lambda i: probs[i])
        running, dropped = 0.0, set()
        for i in ascending[:-1]:
            running += probs[i] / total
            if running > 1.0 - top_p:
                break
            dropped.add(i)
        kept = [i for i in kept if i not in dropped]
    return kept


class RunnerModel:
    """What TRL's colocated weight sync writes into: ``load_weights([(name, tensor)])``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.loads = model, []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor.to(StandInEngine.dtype))
                self.loads.append(name)


class StandInEngine:
    """``vllm.LLM`` as TRL's colocated path uses it, on the CPU (module docstring). ``policy`` is the model the
    trainer trains: the engine builds its own copy of its architecture and compares weights at each generation."""

    built: list[StandInEngine] = []
    dtype = ENGINE_DTYPE  # float32: the engine computes what the trainer does (the engines agree)

    def __init__(self, model: str, *, policy: torch.nn.Module, **settings: Any) -> None:
        self.name, self.settings, self.policy = model, settings, policy
        torch.manual_seed(1234)  # its own weights until the first sync: not the policy's
        self.runner = RunnerModel(LlamaForCausalLM(policy.config).to(StandInEngine.dtype).eval())
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.runner))))
        self.generations: list[dict[str, Any]] = []
        self.returned: dict[tuple[int, ...], list[float]] = {}
        self.prefix_resets = 0
        self.rng = torch.Generator().manual_seed(settings.get("seed", 0))
        StandInEngine.built.append(self)

    def reset_prefix_cache(self) -> None:
        self.prefix_resets += 1

    @torch.no_grad()
    def generate(self, prompts: list[dict[str, list[int]]], sampling_params: Any, use_tqdm: bool = False) -> list:
        engine = self.runner.model
        synced = all(torch.equal(mine, theirs.detach().to(StandInEngine.dtype)) for mine, theirs in
                     zip(engine.parameters(), self.policy.parameters(), strict=True))
        self.generations.append({"synced": synced, "loads": len(self.runner.loads),
                                 "policy": [p.detach().clone() for p in self.policy.parameters()]})
        eos, outputs = self.policy.config.eos_token_id, []
        for prompt in prompts:
            ids, tokens, logps = list(prompt["prompt_token_ids"]), [], []
            for _ in range(sampling_params.max_tokens):
                logits = engine(torch.tensor([ids + tokens])).logits[0, -1].float() / sampling_params.temperature
                # vLLM samples from its truncated support and returns log-probs renormalised over it
                support = vllm_support(logits.softmax(-1).tolist(), getattr(sampling_params, "top_k", 0) or 0,
                                       getattr(sampling_params, "top_p", 1.0), getattr(sampling_params, "min_p", 0.0))
                logits = torch.full_like(logits, float("-inf")).index_copy(0, torch.tensor(support), logits[support])
                log_probs = logits.log_softmax(-1)  # "processed_logprobs"
                token = int(torch.multinomial(log_probs.exp(), 1, generator=self.rng))
                tokens.append(token)
                logps.append(float(log_probs[token]))
                if token == eos:
                    break
            self.returned[tuple(tokens)] = logps
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[SimpleNamespace(
                token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(tokens, logps,
                                                                                                       strict=True)])]))
        return outputs


@pytest.fixture
def stand_in_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """TRL's vLLM module with the stand-in engine; the process environment TRL's colocate set-up writes (rank,
    world size, rendezvous) restored afterwards."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "0")  # records the original value (or its absence) for the undo
        monkeypatch.delenv(key)
    StandInEngine.built = []
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(vllm_generation, "SamplingParams", SimpleNamespace, raising=False)

    def use(policy: torch.nn.Module) -> None:
        monkeypatch.setattr(vllm_generation, "LLM", partial(StandInEngine, policy=policy), raising=False)

    return use


def test_colocated_vllm_syncs_weights_and_applies_the_is_ratio_after_the_transform(stand_in_vllm: Any) -> None:
    policy = tiny_model()
    stand_in_vllm(policy)
    trainer = start_recording(RecordingTrainer(
        model=policy, reward_funcs=last_digit_reward, train_dataset=addition_dataset(),
        processing_class=tiny_tokenizer(), args=DFPOConfig(**base_args(**COLOCATE)),
    ))
    engine, = StandInEngine.built
    assert engine.settings["logprobs_mode"] == "processed_logprobs"
    trainer.train()

    rollouts = COLOCATE["max_steps"] * COLOCATE["gradient_accumulation_steps"] // COLOCATE["steps_per_generation"]
    assert len(engine.generations) == rollouts
    names = [name for name, _ in policy.named_parameters()]
    assert engine.runner.loads == names * rollouts  # every parameter, under its name, once before each rollout
    assert all(generation["synced"] for generation in engine.generations)
    assert engine.prefix_resets == rollouts
    moved = engine.generations[-1]["policy"]
    assert any(not torch.equal(a, b) for a, b in zip(engine.generations[0]["policy"], moved, strict=True))

    eps_low, eps_high = trainer.epsilon_low, trainer.epsilon_high
    ratio_spread = transform_acted = 0.0
    for record in trainer.records:
        inputs, weights = record["inputs"], record["weights"]
        mask = inputs["completion_mask"]
        sampling = inputs["sampling_per_token_logps"]
        for row in range(mask.size(0)):
            length = int(mask[row].sum())
            returned = engine.returned[tuple(inputs["completion_ids"][row, :length].tolist())]
            assert sampling[row, :length].tolist() == pytest.approx(returned, rel=1e-6, abs=1e-6)
        ratio = inputs["importance_sampling_ratio"]
        assert ratio.shape == (mask.size(0), 1)
        log_ratio = ((inputs["old_per_token_logps"] - sampling) * mask).sum(-1, keepdim=True)
        assert_close_to_rounding(ratio, log_ratio.exp(), scale=ratio.abs().max())
        ratio_spread = max(ratio_spread, float(ratio.max() - ratio.min()))
        # the transform as applied balances without the ratio: one group per micro-batch here
        terms = inputs["advantages"].double() * weights["s_tilde"].double()
        assert_close_to_rounding(terms.sum(), torch.zeros((), dtype=torch.float64), scale=terms.abs().sum(),
                                 dtype=torch.float32)
        transform_acted = max(transform_acted, float((weights["s_tilde"] - weights["s_bar"]).abs().max()))
        # and TRL's ratio multiplies DFPO's gradient afterwards
        expected = expected_token_gradient(record, mask, eps_low, eps_high, COLOCATE["gradient_accumulation_steps"])
        expected = expected * ratio.double()
        assert bool((record["grad"][mask == 0] == 0).all())
        torch.testing.assert_close(record["grad"].double(), expected, rtol=1e-4,
                                   atol=1e-6 * float(expected.abs().max().clamp(min=1e-30)))
    assert ratio_spread > 1e-4, "the engine's log-probs equal the trainer's: the ratio's place is untested"
    assert transform_acted > 1e-3, "Min-Replace never changed a weight: the run is on-policy"


@pytest.mark.parametrize("correction", [True, False])
def test_truncated_sampling_shrinks_trls_ratio_and_the_trainer_says_so_once(stand_in_vllm: Any, correction: bool,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Top-k sampling: the engine's log-probs are renormalised over the kept tokens, so TRL's sequence ratio is
    exp(Σ_t log K_t) < 1, falling with length; one warning names the fields, and none when the correction is off."""
    policy = tiny_model()
    stand_in_vllm(policy)
    args = DFPOConfig(**base_args(**{**COLOCATE, "top_k": 2, "vllm_importance_sampling_correction": correction}))
    trainer = start_recording(RecordingTrainer(model=policy, reward_funcs=last_digit_reward,
                                               train_dataset=addition_dataset(), processing_class=tiny_tokenizer(),
                                               args=args))
    with caplog.at_level("WARNING", logger="dfpo_trl.trl_hooks.sampling_ratio"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.name == "dfpo_trl.trl_hooks.sampling_ratio"]
    if not correction:
        assert lines == []
        assert all("importance_sampling_ratio" not in record["inputs"] for record in trainer.records)
        return
    ratios = torch.cat([record["inputs"]["importance_sampling_ratio"].reshape(-1) for record in trainer.records])
    assert float(ratios.mean()) < 0.5  # top-2 of a random model's vocabulary keeps little mass per token
    assert len(lines) == 1
    assert "top_k=2" in lines[0] and "vllm_importance_sampling_support: truncated" in lines[0]
