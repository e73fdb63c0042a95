"""``vllm_importance_sampling_support="truncated"`` through TRL's colocated vLLM path on the CPU (the stand-in engine
of ``test_vllm_colocate.py``, which truncates with min-p, top-k and top-p in vLLM's order and returns log-probs
renormalised over its support, as vLLM's ``processed_logprobs``).

With the engine computing what the trainer computes (float32, the policy's weights after the sync), the engines
agree, so the ratio against the truncated support (eq. S1 of trl_hooks/sampling_support.py) is 1 for every row in
every TRL mode, where TRL's own ratio is the product of the kept masses; the old log-probs the policy ratio reads are
TRL's untruncated ones, bit for bit; the sampler's log-probs TRL's loss reads are the engine's plus log K; and the
untruncated ratio and log K are logged beside TRL's metrics. A bf16 policy's log K comes from the bf16 products TRL's
kernel scores ℓ^old with.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest
import test_vllm_colocate
import torch
from test_vllm_colocate import COLOCATE, StandInEngine
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.trl_hooks.sampling_support import FULL_RATIO_METRIC, KEPT_MASS_METRIC, kept_log_mass, sampling_support

pytestmark = pytest.mark.usefixtures("one_thread")
stand_in_vllm = test_vllm_colocate.stand_in_vllm  # the fixture, shared

TRUNCATED = dict(top_k=5, top_p=0.8, min_p=0.02, temperature=0.7)


@pytest.fixture
def agreeing_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in engine in float32: after the weight sync it computes the trainer's distribution."""
    monkeypatch.setattr(StandInEngine, "dtype", torch.float32)


def rollout(stand_in_vllm: Any, **fields: Any) -> tuple[DFPOTrainer, dict[str, Any], StandInEngine]:
    """One training rollout of a fresh trainer (the engine synced to the policy first, as TRL does)."""
    policy = tiny_model()
    stand_in_vllm(policy)
    trainer = DFPOTrainer(model=policy, reward_funcs=last_digit_reward, train_dataset=addition_dataset(),
                          processing_class=tiny_tokenizer(),
                          args=DFPOConfig(**base_args(**{**COLOCATE, **TRUNCATED, **fields})))
    engine = StandInEngine.built[-1]
    trainer.model.train()
    prompts = [row for row in addition_dataset().select(range(2)) for _ in range(4)]
    torch.manual_seed(0)
    return trainer, trainer._generate_and_score_completions(prompts), engine


def engine_logps(output: dict[str, Any], engine: StandInEngine) -> torch.Tensor:
    """The engine's returned log-probs of each completion, padded as TRL pads them."""
    mask = output["completion_mask"]
    out = torch.zeros(mask.shape)
    for row in range(mask.size(0)):
        length = int(mask[row].sum())
        out[row, :length] = torch.tensor(engine.returned[tuple(output["completion_ids"][row, :length].tolist())])
    return out


def trainer_log_mass(trainer: DFPOTrainer, output: dict[str, Any]) -> torch.Tensor:
    """log K_t from an independent full-logit forward of the policy (transformers' own head, not TRL's)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    width = output["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -(width + 1):-1].float()
    support = sampling_support(trainer.temperature, trainer.top_k, trainer.top_p, trainer.min_p)
    return kept_log_mass(logits / trainer.temperature, support).reshape(output["completion_mask"].shape)


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_truncate", "token_mask"])
def test_ratio_against_the_truncated_support_is_one_when_the_engines_agree(
    stand_in_vllm: Any, agreeing_engine: None, mode: str
) -> None:
    kwargs = dict(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5)
    trainer, ours, engine = rollout(stand_in_vllm, vllm_importance_sampling_support="truncated", **kwargs)
    mask = ours["completion_mask"].bool()
    ratio = ours["importance_sampling_ratio"]
    values = ratio.reshape(-1) if ratio.size(-1) == 1 else ratio[mask]
    assert values.numel() > 0
    torch.testing.assert_close(values, torch.ones_like(values), rtol=0, atol=2e-5)  # float32 rounding of Σ_t
    # TRL's own ratio on the same kind of rollout: the kept masses, far from 1 (and masked or clipped by its mode)
    _, full, _ = rollout(stand_in_vllm, **kwargs)
    log_mass = trainer_log_mass(trainer, full) * full["completion_mask"]
    assert float(log_mass.sum()) < -1.0, "the stand-in's truncation keeps almost all the mass: nothing is tested"
    full_mask = full["completion_mask"].bool()
    gap = (full["old_per_token_logps"] - full["sampling_per_token_logps"]) * full["completion_mask"]
    torch.testing.assert_close(gap[full_mask], log_mass[full_mask], rtol=0, atol=2e-5)  # TRL's gap is log K


def test_old_log_probs_stay_trls_and_the_sampler_moves_to_the_untruncated_scale(
    stand_in_vllm: Any, agreeing_engine: None
) -> None:
    trainer, output, engine = rollout(stand_in_vllm, vllm_importance_sampling_support="truncated")
    mask = output["completion_mask"]
    # the policy ratio's π_old: TRL's own forward of the same rows at the same θ, bit for bit
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], mask], dim=1)
    with torch.no_grad():
        again, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, mask.size(1), batch_size=trainer.args.per_device_train_batch_size)
    assert torch.equal(output["old_per_token_logps"], again)
    # the sampler's log-probs: the engine's, plus log K (vLLM's kept-support probability on the untruncated scale)
    log_mass = trainer_log_mass(trainer, output)
    on_mask = mask.bool()
    torch.testing.assert_close(output["sampling_per_token_logps"][on_mask],
                               (engine_logps(output, engine) + log_mass)[on_mask], rtol=0, atol=2e-5)
    # ... which is the trainer's own untruncated log-prob when the engines agree
    torch.testing.assert_close(output["sampling_per_token_logps"][on_mask], again[on_mask], rtol=0, atol=2e-5)


def test_the_untruncated_ratio_and_the_kept_mass_are_logged_beside_trls(stand_in_vllm: Any) -> None:
    """The engine in bfloat16 (a real mismatch): TRL's metric is the truncated-support ratio, the full one beside it
    is exp(Σ_t (old − engine's)) per row, and the mean log K per loss token."""
    trainer, output, engine = rollout(stand_in_vllm, vllm_importance_sampling_support="truncated")
    metrics: dict[str, list[float]] = defaultdict(list)
    trainer.dfpo_metrics.flush_into(metrics, "train", trainer.accelerator)
    mask = output["completion_mask"].double()
    raw = ((output["old_per_token_logps"].double() - engine_logps(output, engine).double()) * mask).sum(-1).exp()
    assert metrics[f"{FULL_RATIO_METRIC}/mean"] == [pytest.approx(float(raw.mean()), rel=1e-5)]
    assert metrics[f"{FULL_RATIO_METRIC}/min"] == [pytest.approx(float(raw.min()), rel=1e-5)]
    assert metrics[f"{FULL_RATIO_METRIC}/max"] == [pytest.approx(float(raw.max()), rel=1e-5)]
    log_mass = trainer_log_mass(trainer, output).double()
    assert metrics[KEPT_MASS_METRIC] == [pytest.approx(float((log_mass * mask).sum() / mask.sum()), abs=1e-5)]
    ours = output["importance_sampling_ratio"].reshape(-1).double()
    ours_expected = (raw.log() - (log_mass * mask).sum(-1)).exp()
    torch.testing.assert_close(ours, ours_expected.clamp(max=3.0), rtol=1e-4, atol=0)
    assert float((ours - 1).abs().max()) < float((raw - 1).abs().max())


def test_full_support_is_trls_rollout_unchanged(stand_in_vllm: Any) -> None:
    """The default: nothing is added to TRL's rollout (no metric, the sampler's log-probs the engine's)."""
    trainer, output, engine = rollout(stand_in_vllm)
    metrics: dict[str, list[float]] = defaultdict(list)
    trainer.dfpo_metrics.flush_into(metrics, "train", trainer.accelerator)
    assert not any(name.startswith(FULL_RATIO_METRIC) or name == KEPT_MASS_METRIC for name in metrics)
    on_mask = output["completion_mask"].bool()
    assert torch.equal(output["sampling_per_token_logps"][on_mask], engine_logps(output, engine)[on_mask])
    gap = ((output["old_per_token_logps"] - output["sampling_per_token_logps"]) * output["completion_mask"]).sum(-1)
    torch.testing.assert_close(output["importance_sampling_ratio"].reshape(-1), gap.exp(), rtol=1e-6, atol=0)
    assert math.isfinite(float(gap.sum()))


def test_a_bf16_policys_kept_mass_is_from_the_logits_trl_scores_it_with(stand_in_vllm: Any) -> None:
    """A bf16 policy (no mixed precision): TRL's kernel multiplies h Wᵀ in bf16 for ℓ^old, so log K comes from the
    bf16 products too (the trainer's own full-logit forward in bf16, to float32 rounding), not from float32 ones,
    which differ by bf16's rounding (lm_head.trl_head_dtype)."""
    policy = tiny_model().to(torch.bfloat16)
    stand_in_vllm(policy)
    trainer = DFPOTrainer(model=policy, reward_funcs=last_digit_reward, train_dataset=addition_dataset(),
                          processing_class=tiny_tokenizer(),
                          args=DFPOConfig(**base_args(**{**COLOCATE, **TRUNCATED,
                                                         "vllm_importance_sampling_support": "truncated"})))
    engine = StandInEngine.built[-1]
    trainer.model.train()
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(
        [row for row in addition_dataset().select(range(2)) for _ in range(4)])
    mask = output["completion_mask"].bool()
    product = (output["sampling_per_token_logps"] - engine_logps(output, engine))[mask]
    bf16 = trainer_log_mass(trainer, output)[mask]
    trainer.accelerator.unwrap_model(trainer.model).float()
    wide = trainer_log_mass(trainer, output)[mask]
    scale = float(bf16.abs().max())
    assert scale > 0.1, "the truncation keeps almost all the mass: nothing is tested"
    atol = 1e-5 * scale
    torch.testing.assert_close(product, bf16, rtol=0, atol=atol)
    # float32 products lie far outside that tolerance, so the match above tells bf16's from float32's (their gap is
    # bf16's rounding: 6e-4 of the scale with transformers 5.25.0, above 1e-3 in the CI runs before 2026-12-04)
    assert float((wide - bf16).abs().max()) > 10 * atol
