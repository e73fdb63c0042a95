"""DFPOTrainer through the real `compute_loss`: TRL equality, cancellation, GRPO-fix, gradient forms."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from tiny import capturing, loss_and_grads, make_trainer, random_batch, tiny_model, with_old_logps
from tolerance import assert_close_to_rounding
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer

GSPO = dict(importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.28, steps_per_generation=2)


def assert_same(a: tuple, b: tuple) -> None:
    """DFPO off runs TRL's loss on the same inputs with the same operations (docs/source/concepts/design.md): bit for
    bit."""
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize(
    "extra",
    [
        dict(loss_type="grpo"),
        dict(loss_type="dapo"),
        dict(loss_type="bnpo", epsilon=3e-4, epsilon_high=4e-4),
        dict(loss_type="dr_grpo", delta=1.1),
        dict(loss_type="luspo"),
        dict(loss_type="grpo", entropy_coef=0.01, top_entropy_quantile=0.5),
    ],
)
def test_none_equals_trl_gspo_loss_and_gradient(extra):
    ours = make_trainer(DFPOTrainer, DFPOConfig, **{**GSPO, **extra})
    theirs = make_trainer(GRPOTrainer, GRPOConfig, **{**GSPO, **extra})
    ids, mask, adv, log_ratio = random_batch()
    batch = with_old_logps(theirs, ids, mask, adv, log_ratio)
    assert_same(loss_and_grads(ours, batch), loss_and_grads(theirs, batch))


def test_none_equals_trl_with_kl_and_vllm_importance_sampling(tmp_path):
    tiny_model().save_pretrained(tmp_path)  # with beta != 0 TRL loads the reference model from a path
    ours = make_trainer(DFPOTrainer, DFPOConfig, model=str(tmp_path), **GSPO, loss_type="grpo", beta=0.04)
    theirs = make_trainer(GRPOTrainer, GRPOConfig, model=str(tmp_path), **GSPO, loss_type="grpo", beta=0.04)
    for trainer in (ours, theirs):  # vLLM cannot run here: exercise its loss path with a given IS ratio
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    ids, mask, adv, log_ratio = random_batch()
    g = torch.Generator().manual_seed(5)
    extra = dict(
        ref_per_token_logps=-torch.rand(ids.shape, generator=g) * 4,
        importance_sampling_ratio=0.5 + torch.rand(ids.shape, generator=g),
    )
    batch = with_old_logps(theirs, ids, mask, adv, log_ratio, **extra)
    assert_same(loss_and_grads(ours, batch), loss_and_grads(theirs, batch))


def toy_group(trainer, rho1=1.01, rho2=0.99, lam1=1.05, lam2=0.97, adv=1.0):
    """The G = 2, T = 3 toy of eq. 33–37: shared tokens at t = 1, 2, equal ratios, different last tokens."""
    ids = torch.tensor([[16, 17, 5], [16, 17, 6]])  # "Answer: is 2" vs "Answer: is 3"
    mask = torch.ones(2, 3, dtype=torch.long)
    log_ratio = torch.log(torch.tensor([[rho1, rho2, lam1], [rho1, rho2, lam2]]))
    return with_old_logps(trainer, ids, mask, torch.tensor([-adv, adv]), log_ratio)


def token_coefficients(trainer, batch) -> torch.Tensor:
    loss_and_grads(trainer, batch)
    return trainer.captured.grad.detach()


def test_gspo_toy_does_not_cancel_and_matches_eq_38():
    rho1, rho2, lam1, lam2, a = 1.01, 0.99, 1.05, 0.97, 1.0
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo", num_generations=2)
    c = token_coefficients(trainer, toy_group(trainer, rho1, rho2, lam1, lam2, a))
    # TRL's GSPO takes s_i = (Π_t r_{i,t})^{1/L}; eq. 38 with that s: Â1 s1 + Â2 s2 = A (s2 - s1), and the
    # loss -(1/B) Σ_i Â_i s_i gives ∂L/∂ℓ_{i,t} = -Â_i s_i / (B L).
    s1, s2 = (rho1 * rho2 * lam1) ** (1 / 3), (rho1 * rho2 * lam2) ** (1 / 3)
    expected = -(a * (s2 - s1)) / (2 * 3)
    shared_sum = c[:, :2].sum(0)  # a difference of the members' coefficients: rounded relative to their size
    assert_close_to_rounding(shared_sum, torch.full((2,), expected), scale=c[:, :2].abs().sum(0))
    assert abs(expected) > 1e-3


CANCELLING = ["min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance"]


@pytest.mark.parametrize("transform", CANCELLING)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_transforms_cancel_shared_prefix_gradient(transform, loss_type):
    trainer = make_trainer(
        capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type=loss_type, num_generations=2,
        group_transform=transform,
    )
    c = token_coefficients(trainer, toy_group(trainer))
    assert c[:, :2].abs().max() > 1e-4  # the shared tokens do get gradient from each member ...
    # ... which cancels in the group, up to the float32 rounding of the members' coefficients
    assert_close_to_rounding(c[:, :2].sum(0), torch.zeros(2), scale=c[:, :2].abs().sum(0))
    assert c[:, 2].abs().min() > 1e-4  # the distinguishing tokens still learn


def test_logged_shared_prefix_residual_separates_gspo_from_min_replace():
    residual = {}
    for transform in ("none", "min_replace"):
        trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, loss_type="grpo", num_generations=2,
                               group_transform=transform)
        trainer._metrics["train"].clear()
        loss_and_grads(trainer, toy_group(trainer))
        residual[transform] = trainer._metrics["train"]["cancellation/shared_prefix_residual"][-1]
    assert_close_to_rounding(residual["min_replace"], 0.0, scale=1.0, dtype=torch.float32)  # |Σ c| / Σ |c|
    assert residual["none"] > 1e-3


def sequence_stats(trainer, batch):
    mask = batch["completion_mask"].float()
    with torch.no_grad():
        cur = trainer.captured.detach()
    rho = ((cur - batch["old_per_token_logps"]) * mask).sum(1) / mask.sum(1)
    s = rho.exp()
    adv = batch["advantages"]
    c = s.clamp(1 - 0.2, 1 + 0.28)
    s_bar = torch.where(adv >= 0, torch.minimum(s, c), torch.maximum(s, c))
    clipped = ((adv >= 0) & (s > 1.28)) | ((adv < 0) & (s < 0.8))
    return mask, s, s_bar, clipped


def test_ratio_form_min_replace_coefficients():
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo",
                           group_transform="min_replace")
    ids, mask, adv, log_ratio = random_batch()
    batch = with_old_logps(trainer, ids, mask, adv, log_ratio)
    c = token_coefficients(trainer, batch)
    m, s, s_bar, clipped = sequence_stats(trainer, batch)
    assert clipped.any() and (~clipped).any()
    s_min = s_bar.view(-1, 4).min(1).values.repeat_interleave(4)
    # eq. 87–88: Â φ s on unclipped sequences, GSPO's zero gradient on clipped ones
    expected = -adv * (s_min / s_bar) * s * (~clipped) / (m.sum(1) * ids.size(0))
    assert torch.allclose(c, expected[:, None] * m, atol=1e-7)


def test_score_form_gives_every_sequence_its_gradient():
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo",
                           group_transform="none", transform_gradient="score")
    ids, mask, adv, log_ratio = random_batch()
    batch = with_old_logps(trainer, ids, mask, adv, log_ratio)
    c = token_coefficients(trainer, batch)
    m, s, s_bar, clipped = sequence_stats(trainer, batch)
    assert clipped.any()
    expected = -adv * s_bar / (m.sum(1) * ids.size(0))  # ∂/∂ℓ of -(1/B) Σ Â sg(s̃) ρ, clipped rows included
    assert torch.allclose(c, expected[:, None] * m, atol=1e-7)


def test_no_stop_gradient_min_replace_has_zero_policy_gradient():
    ids, mask, adv, log_ratio = random_batch(spread=0.05)
    grads = {}
    for stop in (True, False):
        trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, loss_type="grpo",
                               group_transform="min_replace", transform_stop_gradient=stop)
        batch = with_old_logps(trainer, ids, mask, adv, log_ratio)
        _, g = loss_and_grads(trainer, batch)
        grads[stop] = torch.cat([v.flatten() for v in g.values()])
    # Σ_i Â_i s̄_min(θ) = s̄_min(θ) Σ_i Â_i = 0 for every θ: the differentiated transform kills the gradient.
    assert grads[True].abs().max() > 1e-4
    assert_close_to_rounding(grads[False], torch.zeros(1), scale=grads[True].abs().max())


def shared_token_batch(trainer, ratio: float):
    """G = 2, Â = (-1, +1), one shared first token whose ratio is `ratio` in both members (App. F)."""
    ids = torch.tensor([[16, 17, 5], [16, 17, 6]])
    mask = torch.ones(2, 3, dtype=torch.long)
    log_ratio = torch.zeros(2, 3)
    log_ratio[:, 0] = math.log(ratio)
    return with_old_logps(trainer, ids, mask, torch.tensor([-1.0, 1.0]), log_ratio)


@pytest.mark.parametrize("ratio", [1.5, 0.5])
def test_grpo_fix_cancels_where_dapo_clip_does_not(ratio):
    token = dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
                 num_generations=2, steps_per_generation=2)
    dapo = make_trainer(capturing(DFPOTrainer), DFPOConfig, **token)
    fix = make_trainer(capturing(DFPOTrainer), DFPOConfig, **token, symmetric_clip=True)
    c_dapo = token_coefficients(dapo, shared_token_batch(dapo, ratio))
    c_fix = token_coefficients(fix, shared_token_batch(fix, ratio))
    n = 6 / 2  # DAPO's normaliser: tokens of the generation batch / steps_per_generation
    # eq. 75/76: sign-asymmetric clipping leaves one member's gradient alone on the shared token.
    assert abs(c_dapo[:, 0].sum().item()) == pytest.approx(ratio / n, rel=1e-5)
    # eq. 82: clip(r, 0, 1+ε) is the same for both signs, so the shared token cancels.
    assert_close_to_rounding(c_fix[:, 0].sum(), 0.0, scale=c_fix[:, 0].abs().sum())
    expected_weight = min(ratio, 1.28) if ratio < 1.28 else 0.0  # above the cap: constant, zero gradient
    assert torch.allclose(c_fix[:, 0], torch.tensor([1.0, -1.0]) * expected_weight / n, atol=1e-7)


def test_grpo_fix_capped_loss_value_is_the_clipped_objective():
    fix = make_trainer(DFPOTrainer, DFPOConfig, importance_sampling_level="token", loss_type="dapo",
                       epsilon_high=0.28, num_generations=2, steps_per_generation=2, symmetric_clip=True)
    loss, _ = loss_and_grads(fix, shared_token_batch(fix, 1.5))
    # -(1/N) Σ Â_i clip(r, 0, 1.28): shared token capped at 1.28 for both signs; other tokens at r = 1. The two
    # members' terms cancel: 0 up to the rounding of terms of size (1.28 + 2) / 3 each.
    assert_close_to_rounding(loss, -(1.0 * (1.28 + 2) - 1.0 * (1.28 + 2)) / 3, scale=2 * (1.28 + 2) / 3)


def test_group_ids_are_used_not_row_order():
    """A permuted batch with explicit ids gives the permuted coefficients of the ordered batch."""
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="dapo",
                           group_transform="positive_orth_proj")
    ids, mask, adv, log_ratio = random_batch()
    batch = with_old_logps(trainer, ids, mask, adv, log_ratio)
    c_ordered = token_coefficients(trainer, batch)
    perm = torch.tensor([3, 6, 0, 5, 1, 7, 2, 4])
    permuted = {k: (v[perm] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()}
    permuted["group_ids"] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])[perm]
    c_permuted = token_coefficients(trainer, permuted)
    assert_close_to_rounding(c_permuted, c_ordered[perm])  # rows forwarded in another order: rounding apart


def test_extreme_log_ratios_and_uniform_rewards_stay_finite():
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="dapo",
                           group_transform="truncate_rebalance")
    ids, mask, _, _ = random_batch()
    adv = torch.zeros(8)
    adv[4:] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    log_ratio = torch.full(ids.shape, 500.0)
    log_ratio[4:] = -800.0
    loss, grads = loss_and_grads(trainer, with_old_logps(trainer, ids, mask, adv, log_ratio))
    assert torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize(
    ("sizes", "layout"),
    [
        (dict(per_device_train_batch_size=4, num_generations=2, steps_per_generation=2), "group_granular"),
        (dict(per_device_train_batch_size=3, num_generations=2, steps_per_generation=2), "pre_pass"),
    ],
)
def test_cheapest_exact_layout_is_chosen(sizes, layout):
    trainer = make_trainer(DFPOTrainer, DFPOConfig, **{**GSPO, **sizes}, group_transform="min_replace")
    assert trainer.group_layout == layout


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(per_device_train_batch_size=3, num_generations=2, transform_stop_gradient=False),
         "transform_stop_gradient=False .* per_device_train_batch_size=3"),
        (dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=6, gradient_accumulation_steps=4),
         "set steps_per_generation to a multiple of gradient_accumulation_steps=4"),
    ],
)
def test_layouts_that_cannot_be_exact_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(DFPOTrainer, DFPOConfig, **{**GSPO, **sizes}, group_transform="min_replace")


class RecordingTrainer(DFPOTrainer):
    seen: list[torch.Tensor]

    def _compute_loss(self, model, inputs):
        self.seen.append(inputs["group_ids"].clone())
        return super()._compute_loss(model, inputs)


def test_training_micro_batches_hold_whole_groups_and_transform_acts():
    trainer = make_trainer(
        RecordingTrainer, DFPOConfig, **{**GSPO, "steps_per_generation": 4}, loss_type="grpo",
        per_device_train_batch_size=4, num_generations=2, group_transform="min_replace", max_steps=8,
        temperature=1.5, learning_rate=0.05,
    )
    trainer.seen = []
    trainer.train()
    assert len(trainer.seen) == 8
    for ids in trainer.seen:
        assert set(Counter(ids.tolist()).values()) == {2}, ids
    for start in (0, 4):  # each generation's 8 groups appear exactly once across its 4 micro-batches
        assert sorted(torch.cat(trainer.seen[start:start + 4]).tolist()) == sorted(list(range(8)) * 2)
    logs = [h for h in trainer.state.log_history if "transform/phi_min" in h]
    assert len(logs) == 8
    assert min(h["transform/phi_min"] for h in logs) < 1.0  # off-policy micro-steps: the transform acts
    assert all(h["transform/orth_residual"] < 1e-5 for h in logs)
    assert any(h["asym/after"] != h["asym/before"] for h in logs)
