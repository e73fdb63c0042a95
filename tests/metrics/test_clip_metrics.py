"""TRL's `clip_ratio/*` under DFPO's rewrites: counted on the ratios and advantages before the rewrite, with the clip
DFPO applies (PPO's sign-aware region, or GRPO-fix's symmetric one), reduced as TRL reduces them; untouched when no
rewrite is active."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest
import torch
from tiny import hand_batch, make_trainer, observe_micro_steps, random_batch, with_old_logps
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.metrics.clip import CLIP_RATIO_METRICS, clip_fraction_terms
from dfpo_trl.objectives.weights import clipped_ratios
from dfpo_trl.trl_hooks.compat import TRLCompatibilityError, check_one_value_each, diverted_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
            steps_per_generation=2)
TOKEN = dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.2, epsilon_high=0.28, num_generations=2,
             steps_per_generation=2)


def logged_clip(trainer: Any, *batches: dict[str, Any]) -> dict[str, list[float]]:
    """The clip fractions the real `compute_loss` logs for each batch (one value per call), as `log` reads them."""
    for key in CLIP_RATIO_METRICS:
        trainer._metrics["train"].pop(key, None)
    with torch.no_grad():
        for batch in batches:
            trainer.compute_loss(trainer.model, dict(batch))
    if hasattr(trainer, "flush_dfpo_metrics"):
        trainer.flush_dfpo_metrics("train")
    return {key: list(trainer._metrics["train"][key]) for key in CLIP_RATIO_METRICS}


def assert_same_values(ours: dict[str, list[float]], theirs: dict[str, list[float]]) -> None:
    """Equal bit for bit, NaN where TRL has NaN (TRL's nanmin of rows that all lack tokens)."""
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert len(ours[key]) == len(theirs[key]), key
        for a, b in zip(ours[key], theirs[key], strict=True):
            assert a == b or (math.isnan(a) and math.isnan(b)), (key, ours[key], theirs[key])


def f32(count: int, of: int) -> float:
    """count / of divided in float32, as TRL divides its fractions."""
    return float(torch.tensor(float(count)) / torch.tensor(float(of)))


def row_ratio_batch(trainer: Any, ratios: list[float], advantages: list[float]) -> dict[str, Any]:
    """One completion per row, every token of row i off the current policy by the ratio ratios[i]."""
    rows = len(ratios)
    ids = torch.randint(3, 12, (rows, 3), generator=torch.Generator().manual_seed(0))
    log_ratio = torch.log(torch.tensor(ratios)).unsqueeze(1).expand(rows, 3)
    return with_old_logps(trainer, ids, torch.ones(rows, 3, dtype=torch.long), torch.tensor(advantages), log_ratio)


# ------------------------------------------------------------------------------------------------ the pure count
def test_ppo_region_counts_by_the_sign_of_the_advantage():
    ratio = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    clipped = clipped_ratios(torch.log(ratio), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3),
                             sequence_level=False, eps_low=0.2, eps_high=0.28, symmetric=False)
    assert clipped.low.tolist() == [[False, False, False], [False, True, False]]
    assert clipped.high.tolist() == [[True, False, False], [False, False, False]]


def test_grpo_fix_region_counts_both_signs_above_the_cap_and_nothing_below():
    ratio = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    clipped = clipped_ratios(torch.log(ratio), torch.zeros(3, 3), torch.tensor([1.0, -1.0, 0.0]), torch.ones(3, 3),
                             sequence_level=False, eps_low=1.0, eps_high=0.28, symmetric=True)
    assert not clipped.low.any()  # ε_low := 1: clip(r, 0, 1 + ε_high) has no lower clip
    assert clipped.high.tolist() == [[True, False, False], [True, False, False], [False, False, False]]


def test_sequence_level_counts_the_length_normalised_ratio_and_trls_delta_cap():
    log_ratio = torch.tensor([[0.5, 0.0, 9.0], [0.1, 0.1, 0.0]])  # row 0: ρ = 0.25 over its 2 tokens
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    args = dict(sequence_level=True, eps_low=0.2, eps_high=0.28, symmetric=False)
    clipped = clipped_ratios(log_ratio, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), mask, **args)
    assert clipped.high.tolist() == [[True], [False]]  # exp(0.25) = 1.284 > 1.28; row 1: exp(0.2 / 3)
    capped = clipped_ratios(log_ratio, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), mask, two_sided_cap=1.25, **args)
    assert not capped.high.any()  # TRL caps the ratio at delta before it counts


def test_rows_without_tokens_are_nan_in_the_row_extremes_as_in_trl():
    clipped = clipped_ratios(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2), torch.zeros(2, 2),
                             sequence_level=False, eps_low=0.2, eps_high=0.28, symmetric=False)
    terms = clip_fraction_terms(clipped, torch.zeros(2, 2))
    assert terms.count == 0 and math.isnan(terms.low_min) and math.isnan(terms.high_max)


# ---------------------------------------------------------------------------------- through the real compute_loss
def test_score_form_counts_the_clipped_member_as_gspo_does():
    """The score form hands TRL ratio 1 (old := the detached current log-probs), so TRL counted nothing; the
    members outside the sign-aware clip are counted as GSPO counts them: 2 of 8 above, 1 of 8 below."""
    ratios = [1.5, 0.5, 1.0, 1.1, 2.0, 1.0, 0.9, 1.5]
    advantages = [1.0, -1.0, 0.5, -0.5, 1.0, 0.5, -1.0, -0.5]  # row 0 and 4 high, row 1 low; 6, 7 inside
    score = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, transform_gradient="score")
    gspo = make_trainer(GRPOTrainer, GRPOConfig, **GSPO)
    ours = logged_clip(score, row_ratio_batch(score, ratios, advantages))
    assert ours == {"clip_ratio/low_mean": [0.125], "clip_ratio/high_mean": [0.25], "clip_ratio/region_mean": [0.375],
                    "clip_ratio/low_min": [0.0], "clip_ratio/high_max": [1.0]}
    assert_same_values(ours, logged_clip(gspo, row_ratio_batch(gspo, ratios, advantages)))


def test_grpo_fix_counts_a_negative_advantage_token_above_the_cap():
    """GRPO-fix clips r > 1 + ε_high whatever the sign of Â (eq. 79): the negative member's first token is
    counted as high (TRL's PPO count, ε_low = 1, misses it), its 0.5-ratio token is not low (no lower clip)."""
    ids = torch.tensor([[16, 17, 5], [16, 17, 6]])
    mask = torch.ones(2, 3, dtype=torch.long)
    log_ratio = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.5, 1.0]]))
    fix = make_trainer(DFPOTrainer, DFPOConfig, **TOKEN, symmetric_clip=True)
    ours = logged_clip(fix, with_old_logps(fix, ids, mask, torch.tensor([-1.0, 1.0]), log_ratio))
    assert ours == {"clip_ratio/low_mean": [0.0], "clip_ratio/high_mean": [f32(2, 6)],
                    "clip_ratio/region_mean": [f32(2, 6)], "clip_ratio/low_min": [0.0],
                    "clip_ratio/high_max": [f32(1, 3)]}
    trl_count = make_trainer(GRPOTrainer, GRPOConfig, **{**TOKEN, "epsilon": 1.0})  # PPO's count, ε_low = 1
    theirs = logged_clip(trl_count, with_old_logps(trl_count, ids, mask, torch.tensor([-1.0, 1.0]), log_ratio))
    assert theirs["clip_ratio/high_mean"] == [f32(1, 6)]


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(group_transform="min_replace"), id="min_replace"),
        pytest.param(dict(group_transform="orth_proj", cancellation_target="gradient"), id="orth_proj_gradient"),
        pytest.param(dict(group_transform="orth_proj"), id="orth_proj_weights"),
        pytest.param(dict(group_transform="min_replace", transform_gradient="score"), id="score"),
        pytest.param(dict(group_transform="min_replace", transform_stop_gradient=False), id="no_stop_gradient"),
    ],
)
def test_sequence_rewrites_log_gspos_count_per_call(settings):
    """Every sequence-level rewrite keeps s and Â, so it logs what TRL's GSPO logs on the same batches, bit for bit,
    one value per loss call (two calls here, reduced and averaged by TRL as its own)."""
    ours = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, **settings)
    gspo = make_trainer(GRPOTrainer, GRPOConfig, **GSPO)
    batches = []
    for seed in (1, 2):
        ids, mask, adv, log_ratio = random_batch(seed=seed, spread=0.4)
        mask[3] = 0  # a row without tokens: TRL still counts it at sequence level
        batches.append((ids, mask, adv, log_ratio))
    mine = logged_clip(ours, *(with_old_logps(ours, *b) for b in batches))
    reference = logged_clip(gspo, *(with_old_logps(gspo, *b) for b in batches))
    assert len(reference["clip_ratio/region_mean"]) == 2
    assert 0 < reference["clip_ratio/low_mean"][0] and 0 < reference["clip_ratio/high_mean"][0]
    assert_same_values(mine, reference)


def test_a_sign_flipped_effective_advantage_is_counted_by_the_sign_of_a_hat():
    """Orth-Proj (ratio form) can make φ < 0: here s̄ = (0.01, 0.8, 10, 10) with Â = (3, −1, −1, −1) gives
    k = Âᵀs̄/‖Â‖² ≈ −1.73 and s̃_2 = 0.8 − 1.73 < 0. Member 2 (Â < 0, s = 0.5) is outside the sign-aware clip
    (eq. 47: its weight is clipped to 0.8); TRL's count of the rewritten inputs, Â φ > 0, misses it."""
    ratios, advantages = [0.01, 0.5, 10.0, 10.0], [3.0, -1.0, -1.0, -1.0]
    ours = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, group_transform="orth_proj")
    rewritten: list[dict[str, Any]] = []
    observe_micro_steps(ours, lambda step: rewritten.append(dict(advantages=step.loss_inputs.advantages)))
    batch = row_ratio_batch(ours, ratios, advantages)
    mine = logged_clip(ours, batch)
    assert rewritten[0]["advantages"][1] > 0  # the flip
    assert mine["clip_ratio/low_mean"] == [0.25] and mine["clip_ratio/region_mean"] == [0.25]
    gspo = make_trainer(GRPOTrainer, GRPOConfig, **GSPO)
    assert_same_values(mine, logged_clip(gspo, batch))
    stale = logged_clip(gspo, {**batch, "advantages": rewritten[0]["advantages"]})
    assert stale["clip_ratio/low_mean"] == [0.0]


@pytest.mark.parametrize(
    ("settings", "dfpo"),
    [
        pytest.param(GSPO, {}, id="gspo"),
        pytest.param(GSPO, dict(group_granular_batches=True), id="gspo_group_metrics"),
        pytest.param(TOKEN, {}, id="token_dapo"),
        pytest.param({**TOKEN, "loss_type": "bnpo", "delta": 1.5}, {}, id="token_bnpo_delta"),
    ],
)
def test_without_a_rewrite_trls_own_count_is_logged(settings, dfpo):
    """DFPO off (transform "none", ratio form): TRL's own values, untouched, equal to GRPOTrainer's bit for bit."""
    ours = make_trainer(DFPOTrainer, DFPOConfig, **settings, **dfpo)
    assert not ours.plan.recounts_clip_fractions
    theirs = make_trainer(GRPOTrainer, GRPOConfig, **settings)
    ids, mask, adv, log_ratio = random_batch(spread=0.4)
    mask[3] = 0
    batch = with_old_logps(theirs, ids, mask, adv, log_ratio)
    reference = logged_clip(theirs, batch)
    assert 0 < reference["clip_ratio/region_mean"][0]
    assert_same_values(logged_clip(ours, batch), reference)


def test_eval_mode_recounts_into_the_eval_metrics():
    trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, transform_gradient="score")
    trainer.model.eval()
    batch = row_ratio_batch(trainer, [1.5, 1.0, 1.0, 1.0], [1.0, -1.0, 0.5, -0.5])
    with torch.no_grad():
        trainer.compute_loss(trainer.model, batch)
    assert "clip_ratio/high_mean" not in trainer._metrics["eval"]  # TRL's count never logged, DFPO's pending
    trainer.flush_dfpo_metrics("eval")
    assert trainer._metrics["eval"]["clip_ratio/high_mean"] == [0.25]
    assert "clip_ratio/high_mean" not in trainer._metrics["train"]


def test_hand_batch_without_old_logps_is_on_policy_and_counts_nothing():
    trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, transform_gradient="score")
    batch = hand_batch(torch.randint(3, 12, (4, 3)), torch.ones(4, 3, dtype=torch.long),
                       torch.tensor([1.0, -1.0, 0.5, -0.5]), None)
    logged = logged_clip(trainer, batch)
    assert logged["clip_ratio/region_mean"] == [0.0] and logged["clip_ratio/high_max"] == [0.0]


def test_trl_logging_other_than_one_value_per_call_stops_the_replacement():
    """TRL's appends to the clip names go to a sink, never to its logs; a TRL that appends none or two must not
    leave a mix."""
    metrics: dict[str, Any] = {"train": defaultdict(list, {"clip_ratio/high_mean": [0.5]})}
    with diverted_metrics(metrics, "train", CLIP_RATIO_METRICS) as sink:
        for name in CLIP_RATIO_METRICS:
            metrics["train"][name].append(0.25)  # as TRL's _compute_loss appends, once per call
        metrics["train"]["entropy"].append(2.0)  # every other name reaches the logs
    check_one_value_each(sink)
    assert metrics["train"] == {"clip_ratio/high_mean": [0.5], "entropy": [2.0]}
    assert sink == {name: [0.25] for name in CLIP_RATIO_METRICS}
    with diverted_metrics(metrics, "train", CLIP_RATIO_METRICS) as sink:
        metrics["train"]["clip_ratio/low_mean"].append(0.25)
    with pytest.raises(TRLCompatibilityError, match=r"appended 0 values to _metrics\['clip_ratio/high_mean'\]"):
        check_one_value_each(sink)
