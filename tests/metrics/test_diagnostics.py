"""Per-step diagnostics (dfpo_trl.metrics.diagnostics, docs/source/concepts/metrics.md "Diagnostics"): each on a
constructed batch whose value is known by hand, the pure functions and the trainer's logged values."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import make_trainer, random_batch, with_old_logps

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.metrics.diagnostics import ratio_spread, signal_clip_counts, zero_signal
from dfpo_trl.objectives.weights import clipped_ratios

pytestmark = pytest.mark.usefixtures("one_thread")


def test_clip_fraction_counts_only_rows_with_signal():
    """Sequence level, ratios 1.5, 0.5, 1.5, 1.0 with ε = 0.2: row 0 (Â > 0) is clipped above, row 1 (Â < 0) below,
    row 2 is above the range but has Â = 0 (no gradient to remove), row 3 inside. Among the 3 rows with signal, 2
    are clipped; TRL's count over every row would say 2 of 4."""
    log_ratio = torch.log(torch.tensor([1.5, 0.5, 1.5, 1.0])).unsqueeze(1).expand(4, 3)
    mask = torch.ones(4, 3)
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.5])
    clipped = clipped_ratios(log_ratio, torch.zeros(4, 3), advantages, mask, sequence_level=True, eps_low=0.2,
                             eps_high=0.2, symmetric=False)
    assert [int(x) for x in signal_clip_counts(clipped, advantages, mask)] == [2, 3]
    # token level: row 0's second token and row 2 padded; row 2 has no signal
    token_ratio = torch.tensor([[1.5, 1.0, 1.5], [0.5, 0.5, 1.0], [1.5, 1.5, 1.5], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    clipped = clipped_ratios(token_ratio.log(), torch.zeros(4, 3), advantages, mask, sequence_level=False,
                             eps_low=0.2, eps_high=0.2, symmetric=False)
    assert [int(x) for x in signal_clip_counts(clipped, advantages, mask)] == [4, 8]  # rows 0, 1, 3: 2+3+3 tokens


def test_zero_signal():
    assert zero_signal(torch.zeros(8)).item() == 1.0
    assert zero_signal(torch.tensor([0.0, 0.0, 1e-6, 0.0])).item() == 0.0


def test_ratio_spread_token_and_sequence_level():
    ratio = torch.tensor([[0.9, 1.2, 7.0], [1.1, 1.0, 0.8]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the 7.0 sits on padding: not counted
    spread = ratio_spread(ratio, mask)
    values = torch.tensor([0.9, 1.2, 1.1, 1.0, 0.8], dtype=torch.float64)
    assert spread.low.item() == pytest.approx(0.8) and spread.high.item() == pytest.approx(1.2)
    assert spread.count.item() == 5
    mean = spread.deviations.item() / 5
    std = math.sqrt(spread.squares.item() / 5 - mean**2)
    assert std == pytest.approx(values.std(correction=0).item(), rel=1e-6)
    rows = ratio_spread(torch.tensor([[0.5], [2.0]]), torch.zeros(2, 3))  # sequence level: every row counts
    assert (rows.low.item(), rows.high.item(), rows.count.item()) == (0.5, 2.0, 2)


MIN_REPLACE = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                   steps_per_generation=2, group_transform="min_replace")


def logged(trainer, batch) -> dict[str, float]:
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    trainer.flush_dfpo_metrics("train")
    return {key: values[-1] for key, values in trainer._metrics["train"].items() if values}


def test_trainer_logs_the_diagnostics_of_a_constructed_batch():
    """Two groups of four rows; the second group has equal rewards (Â = 0). Sequence ratios are set by hand:
    group 1 has one row clipped above (Â > 0, r = 1.5) and one inside; the Â = 0 rows of group 2 are above the
    range too but carry no gradient. On the first micro-step of the rollout φ is not logged as off-policy; on the
    second (the policy has stepped since the rollout) it is, equal to transform/phi_*. TRL's vLLM ratio, faked on,
    gives the spread of its known values."""
    trainer = make_trainer(DFPOTrainer, DFPOConfig, **MIN_REPLACE)
    ids, mask, _, _ = random_batch(rows=8)
    advantages = torch.tensor([1.0, -0.5, 0.5, -1.0, 0.0, 0.0, 0.0, 0.0])
    ratios = torch.tensor([1.5, 1.1, 0.95, 1.0, 1.5, 1.5, 0.5, 1.0])
    log_ratio = ratios.log().unsqueeze(1).expand_as(mask).float()
    is_ratio = torch.tensor([[0.9], [1.1], [1.0], [1.2], [0.8], [1.0], [1.0], [1.0]])
    batch = with_old_logps(trainer, ids, mask, advantages, log_ratio, importance_sampling_ratio=is_ratio)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # TRL applies the ratio in its loss

    trainer._step = 0  # first micro-step of the rollout: on-policy
    first = logged(trainer, batch)
    assert first["diagnostics/clip_fraction_signal"] == pytest.approx(1 / 4)  # row 0 of the 4 rows with signal
    assert first["diagnostics/zero_signal"] == 0.0
    assert first["diagnostics/zero_variance_groups"] == pytest.approx(0.5)
    assert first["cancellation/one_sided_groups"] == 0.0  # group 1 keeps both signs among its survivors
    assert not any("off_policy" in key for key in first)
    assert first["diagnostics/is_ratio_min"] == pytest.approx(0.8)
    assert first["diagnostics/is_ratio_max"] == pytest.approx(1.2)
    assert first["diagnostics/is_ratio_std"] == pytest.approx(is_ratio.double().std(correction=0).item(), rel=1e-6)

    trainer._step = 1  # second micro-step of a two-step rollout (gradient_accumulation_steps 1): off-policy
    second = logged(trainer, batch)
    assert second["diagnostics/phi_mean_off_policy"] == pytest.approx(second["transform/phi_mean"], rel=1e-6)
    assert second["diagnostics/phi_min_off_policy"] == pytest.approx(second["transform/phi_min"], rel=1e-6)
    assert second["diagnostics/phi_min_off_policy"] < 1.0  # Min-Replace shrank the rows above the group minimum


def test_zero_signal_step_and_off_switch():
    """Every group with equal rewards: zero_signal is 1 and nothing is clipped among rows with signal (there are
    none, so the fraction is not logged: a mean over nothing is not 0). log_mechanism_metrics=False logs none."""
    trainer = make_trainer(DFPOTrainer, DFPOConfig, **MIN_REPLACE)
    ids, mask, _, log_ratio = random_batch(rows=8)
    batch = with_old_logps(trainer, ids, mask, torch.zeros(8), log_ratio)
    values = logged(trainer, batch)
    assert values["diagnostics/zero_signal"] == 1.0 and values["diagnostics/zero_variance_groups"] == 1.0
    assert "diagnostics/clip_fraction_signal" not in values
    quiet = make_trainer(DFPOTrainer, DFPOConfig, **MIN_REPLACE, log_mechanism_metrics=False)
    assert not any(key.startswith("diagnostics/") for key in logged(quiet, batch))
