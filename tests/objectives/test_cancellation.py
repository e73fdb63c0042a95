"""cancellation_target="gradient" (docs/source/concepts/cancellation.md): the pure math, then the real
`compute_loss`."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny import (
    capturing,
    loss_and_grads,
    make_trainer,
    random_batch,
    record_row_weights,
    shared_prefix_residual,
    with_old_logps,
)
from tolerance import assert_close_to_rounding

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.objectives.cancellation import (
    aggregation_factor,
    balance_group_weights,
    gradient_coefficients,
    group_sides,
    min_replace_on_subset,
    transform_group_weights,
)
from dfpo_trl.objectives.weights import clip_survivors
from dfpo_trl.transforms import GROUP_TRANSFORMS, TRANSFORMS, get_transform

# the built-in transforms whose balance condition cancellation_target="gradient" can retarget
BALANCING_TRANSFORMS = tuple(name for name in GROUP_TRANSFORMS if TRANSFORMS[name].retargetable)

GSPO = dict(importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.28, steps_per_generation=2)


# ----------------------------------------------------------------------------------------------- pure math
def test_clip_survivors_is_sign_aware_and_follows_delta():
    s = torch.tensor([0.5, 1.0, 1.3, 0.5, 1.0, 1.3, 1.5])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    expected = torch.tensor([True, True, False, False, True, True, True])
    assert torch.equal(clip_survivors(s, adv, 0.2, 0.28), expected)
    # TRL's two-sided delta caps the unclipped branch for negative advantages above delta.
    expected_delta = torch.tensor([True, True, False, False, True, True, False])
    assert torch.equal(clip_survivors(s, adv, 0.2, 0.28, two_sided_cap=1.4), expected_delta)
    # Boundaries keep their gradient in TRL's min.
    assert clip_survivors(torch.tensor([1.28, 0.8]), torch.tensor([1.0, -1.0]), 0.2, 0.28).all()


def test_aggregation_factor_per_loss_type():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    tokens = torch.full((3,), 6.0)
    assert torch.allclose(aggregation_factor(mask, "grpo"), torch.tensor([1 / 2, 1 / 4, 0.0], dtype=torch.float64))
    assert torch.equal(aggregation_factor(mask, "dapo"), torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    assert torch.equal(aggregation_factor(mask, "luspo"), aggregation_factor(mask, "dr_grpo"))
    assert torch.allclose(aggregation_factor(mask, "bnpo", micro_batch_tokens=tokens),
                          torch.tensor([1 / 6, 1 / 6, 0.0], dtype=torch.float64))
    ratio = torch.tensor([[2.0, 0.5, 9.0, 9.0], [1.0, 1.0, 1.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    # W_i = Σ_t m w: (2.5, 6.0); grpo c = W / L².
    assert torch.allclose(aggregation_factor(mask, "grpo", ratio),
                          torch.tensor([2.5 / 4, 6.0 / 16, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="bnpo.*micro_batch_tokens"):
        aggregation_factor(mask, "bnpo")
    with pytest.raises(ValueError, match="loss_type='cispo'"):
        aggregation_factor(mask, "cispo")


def box_qp_brute_force(m: float, a: list[float], members: list[bool]) -> list[float]:
    """min ½‖v − m‖² s.t. Σ a v = 0, 0 <= v <= m over U, by enumerating every assignment of the members to
    {at 0, at m, free} and solving each equality-constrained least squares exactly (eq. C4)."""
    idx = [i for i, inside in enumerate(members) if inside]
    best, best_cost = None, float("inf")
    for states in itertools.product(("low", "high", "free"), repeat=len(idx)):
        v = {i: (0.0 if st == "low" else m) for i, st in zip(idx, states, strict=True)}
        free = [i for i, st in zip(idx, states, strict=True) if st == "free"]
        fixed_sum = sum(a[i] * v[i] for i in idx if i not in free)
        norm = sum(a[i] ** 2 for i in free)
        if free and norm > 0:
            mu = (sum(a[i] * m for i in free) + fixed_sum) / norm
            for i in free:
                v[i] = m - mu * a[i]
        elif abs(fixed_sum) > 1e-12:
            continue
        if any(v[i] < -1e-12 or v[i] > m + 1e-12 for i in idx) or abs(sum(a[i] * v[i] for i in idx)) > 1e-9:
            continue
        cost = sum((v[i] - m) ** 2 for i in idx)
        if cost < best_cost - 1e-15:
            best, best_cost = v, cost
    assert best is not None
    return [best.get(i, float("nan")) for i in range(len(a))]


@pytest.mark.parametrize("seed", range(40))
def test_min_replace_on_subset_matches_brute_force_qp(seed):
    g = torch.Generator().manual_seed(seed)
    size = int(torch.randint(2, 7, (1,), generator=g))
    w = (1 + 0.3 * torch.randn(1, size, generator=g, dtype=torch.float64)).clamp(min=0.05)
    a = torch.randn(1, size, generator=g, dtype=torch.float64)
    a[0, int(torch.randint(0, size, (1,), generator=g))] = 0.0 if seed % 5 == 0 else a[0, 0]
    members = torch.rand(1, size, generator=g) > 0.25
    if not ((a[members] > 0).any() and (a[members] < 0).any()):
        members[:] = True
        a[0, 0], a[0, 1] = abs(a[0, 0]) + 0.1, -abs(a[0, 1]) - 0.1
    v = min_replace_on_subset(w, a, members)
    m = float(w[members].min())
    reference = box_qp_brute_force(m, a[0].tolist(), members[0].tolist())
    for i in range(size):
        if members[0, i]:
            assert v[0, i].item() == pytest.approx(reference[i], abs=1e-9)
        else:
            assert v[0, i] == w[0, i]  # outside U: φ = 1
    assert abs(float((a * v * members).sum())) < 1e-12
    assert (v[members] <= m + 1e-12).all() and (v >= 0).all()


def test_min_replace_on_subset_is_min_replace_when_already_balanced():
    w = torch.tensor([[1.1, 0.9, 1.05, 0.95]])
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    members = torch.ones_like(w, dtype=torch.bool)
    assert torch.equal(min_replace_on_subset(w, adv, members), get_transform("min_replace").apply(w, adv, 0.5, 1e-6))


def test_hand_derived_g3_example():
    """Â = (1, −0.5, −0.5), s = (1.1, 0.9, 0.7), L = (2, 4, 4), ε = 0.2/0.28, loss_type grpo.
    Member 3 is clipped (Â < 0, s < 0.8): U = {1, 2}, c = 1/L, a = (0.5, −0.125, 0). Min-Replace on U: m = 0.9,
    Σ_U a = 0.375 > 0, so the positive side drops to v_1 with 0.5 v_1 = 0.125 · 0.9: v_1 = 0.225 (eq. C5–C6)."""
    s = torch.tensor([[1.1, 0.9, 0.7]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -0.5, -0.5]], dtype=torch.float64)
    s_bar = torch.tensor([[1.1, 0.9, 0.8]], dtype=torch.float64)
    survives = clip_survivors(s, adv, 0.2, 0.28)
    assert survives.tolist() == [[True, True, False]]
    factor = aggregation_factor(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]), "grpo").view(1, 3)
    a = gradient_coefficients(adv, factor, survives)
    assert torch.allclose(a, torch.tensor([[0.5, -0.125, 0.0]], dtype=torch.float64))
    expected = {
        "min_replace": [0.225, 0.9, 0.8],
        "truncate_rebalance": [0.225, 0.9, 0.8],  # α = (0.125 · 0.9) / (0.5 · 1.1), on the positive side
        # s̄ − (aᵀs̄ / ‖a‖²) a on U: aᵀs̄ = 0.4375, ‖a‖² = 0.265625.
        "orth_proj": [1.1 - 0.4375 / 0.265625 * 0.5, 0.9 + 0.4375 / 0.265625 * 0.125, 0.8],
        "positive_orth_proj": [1.1 - 0.4375 / 0.265625 * 0.5, 0.9 + 0.4375 / 0.265625 * 0.125, 0.8],
    }
    for name, values in expected.items():
        s_tilde, sides = balance_group_weights(name, s_bar, adv, a, survives)
        assert sides.two_sided.tolist() == [True]
        assert torch.allclose(s_tilde, torch.tensor([values], dtype=torch.float64), atol=1e-12), name
        assert abs(float((a * s_tilde).sum())) < 1e-12


@pytest.mark.parametrize("name", BALANCING_TRANSFORMS)
def test_balance_group_weights_on_random_groups(name):
    g = torch.Generator().manual_seed(7)
    groups, size = 200, 4
    s = torch.exp(0.6 * torch.randn(groups, size, generator=g))
    adv = torch.randn(groups, size, generator=g)
    adv = adv - adv.mean(-1, keepdim=True)
    adv[:10] = 0.0  # no signal
    survives = clip_survivors(s, adv, 0.2, 0.28)
    s_bar = torch.where(adv >= 0, torch.minimum(s, s.clamp(0.8, 1.28)), torch.maximum(s, s.clamp(0.8, 1.28)))
    factor = 1 / torch.randint(3, 40, (groups, size), generator=g).double()
    a = gradient_coefficients(adv, factor, survives)
    s_tilde, sides = balance_group_weights(name, s_bar, adv, a, survives, "keep")
    two = sides.two_sided
    assert two.sum() > 50 and sides.one_sided.sum() > 5  # both kinds occur
    terms = a * s_tilde.double()  # s̃ is float32: Σ a s̃ = 0 up to its rounding, relative to Σ |a s̃|
    assert_close_to_rounding(terms.sum(-1)[two], 0.0, scale=terms.abs().sum(-1)[two], dtype=s_tilde.dtype)
    assert torch.equal(torch.where(survives, s_tilde, s_bar)[two], s_tilde[two])  # outside U: φ = 1
    if name != "orth_proj":
        assert (s_tilde >= 0).all()
    weights_result = get_transform(name).apply(s_bar, adv, 0.5, 1e-6)
    assert torch.equal(s_tilde[~two], weights_result[~two])  # one-sided "keep" and no-signal: as "weights"
    zeroed, _ = balance_group_weights(name, s_bar, adv, a, survives, "zero")
    assert (zeroed[sides.one_sided] == 0).all()
    assert torch.equal(zeroed[~sides.one_sided], s_tilde[~sides.one_sided])


def test_group_sides_counts_one_sided_groups():
    adv = torch.tensor([[1.0, -1.0], [1.0, -1.0], [0.0, 0.0], [1.0, -1.0]])
    a = torch.tensor([[0.5, -0.5], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    sides = group_sides(adv, a)
    assert sides.two_sided.tolist() == [True, False, False, False]
    assert sides.one_sided.tolist() == [False, True, False, True]
    assert sides.has_signal.tolist() == [True, True, False, True]


def test_degenerate_groups_stay_finite():
    s_bar = torch.tensor([[1e10, float("nan"), 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 2.0], [5.0, 5.0, 5.0]])
    adv = torch.tensor([[1.0, -2.0, 1.0], [0.0, 0.0, 0.0], [1e30, -1e30, 0.0], [1.0, -1.0, 0.0]])
    survives = torch.tensor([[True, True, True], [True, True, True], [True, True, False], [False, False, False]])
    a = gradient_coefficients(adv.double(), torch.ones(4, 3, dtype=torch.float64), survives)
    for name in BALANCING_TRANSFORMS:
        for policy in ("keep", "zero"):
            s_tilde, _ = balance_group_weights(name, s_bar, adv, a, survives, policy)
            assert torch.isfinite(s_tilde).all(), (name, policy)
    single = torch.ones(3, 1)
    s_tilde, sides = balance_group_weights("min_replace", single, torch.zeros(3, 1), torch.zeros(3, 1), single > 0)
    assert torch.equal(s_tilde, single) and not sides.has_signal.any()


def test_gradient_target_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="group_transform='none' has none"):
        DFPOConfig(output_dir="/tmp/x", **GSPO, cancellation_target="gradient")
    with pytest.raises(ValueError, match="cancellation_one_sided='zero' applies only"):
        DFPOConfig(output_dir="/tmp/x", **GSPO, group_transform="min_replace", cancellation_one_sided="zero")
    with pytest.raises(ValueError, match="transform_stop_gradient=False"):
        DFPOConfig(output_dir="/tmp/x", **GSPO, group_transform="min_replace", cancellation_target="gradient",
                   transform_stop_gradient=False)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        DFPOConfig(output_dir="/tmp/x", **GSPO, group_transform="min_replace", cancellation_target="gradient",
                   top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="cancellation_target='grad'"):
        DFPOConfig(output_dir="/tmp/x", **GSPO, group_transform="min_replace", cancellation_target="grad")


# ------------------------------------------------------------------------------- through the real compute_loss
ADVANTAGES = [1.0, 0.8, -0.3, -1.5]
# Member 4 (Â < 0, s = 0.6 < 1 − ε_low) is clipped; member 1 (Â > 0, s = 0.7) survives below the band, so
# Orth-Proj on a makes its weight negative (the flipped-sign case of the trainer).
RATIOS = [0.7, 1.2, 1.0, 0.6]
LENGTHS = [3, 5, 4, 5]


def clipped_group(trainer):
    """G = 4, a shared prefix of 2 tokens, unequal lengths, one clipped member: sequence ratios exactly RATIOS."""
    ids = torch.tensor([[16, 17, 5, 6, 7], [16, 17, 8, 9, 10], [16, 17, 4, 4, 11], [16, 17, 12, 3, 3]])
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in LENGTHS])
    log_ratio = torch.log(torch.tensor(RATIOS)).unsqueeze(1).expand(4, 5).clone()
    return with_old_logps(trainer, ids, mask, torch.tensor(ADVANTAGES), log_ratio)


def shared_residual(trainer, batch) -> float:
    loss_and_grads(trainer, batch)
    coefficients = trainer.captured.grad.detach()
    value, count = shared_prefix_residual(coefficients.unsqueeze(0), batch["completion_ids"].unsqueeze(0),
                                          batch["completion_mask"].unsqueeze(0))
    assert int(count) == 2
    return float(value)


@pytest.mark.parametrize("transform", BALANCING_TRANSFORMS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gradient_target_cancels_shared_tokens_through_compute_loss(transform, loss_type):
    residual = {}
    for target in ("weights", "gradient"):
        trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type=loss_type, num_generations=4,
                               group_transform=transform, cancellation_target=target)
        residual[target] = shared_residual(trainer, clipped_group(trainer))
        grads = trainer.captured.grad
        assert grads[:3, 2:].abs().max() > 1e-6  # the surviving members still learn their own tokens
        assert grads[3].abs().max() == 0  # the clipped member carries no gradient
    # the residual is |Σ_i c_i| / Σ_i |c_i|: float32 rounding of the coefficients, in units of their size (1)
    assert_close_to_rounding(residual["gradient"], 0.0, scale=1.0, dtype=torch.float32, msg=str(residual))
    assert residual["weights"] > 1e-2, residual


def test_hand_derived_g3_example_through_compute_loss():
    """The G = 3 example above, trained: the exact coefficient on each shared token is −Â_i s̃_i / (L_i B)."""
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo", num_generations=3,
                           per_device_train_batch_size=3, group_transform="min_replace",
                           cancellation_target="gradient")
    ids = torch.tensor([[16, 17, 0, 0], [16, 17, 5, 6], [16, 17, 7, 8]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    log_ratio = torch.log(torch.tensor([1.1, 0.9, 0.7])).unsqueeze(1).expand(3, 4).clone()
    batch = with_old_logps(trainer, ids, mask, torch.tensor([1.0, -0.5, -0.5]), log_ratio)
    loss_and_grads(trainer, batch)
    c = trainer.captured.grad
    expected = torch.tensor([-1.0 * 0.225 / (2 * 3), 0.5 * 0.9 / (4 * 3), 0.0])
    assert_close_to_rounding(c[:, 0], expected)
    assert_close_to_rounding(c[:, :2].sum(0), torch.zeros(2), scale=c[:, :2].abs().sum(0))
    logged = trainer._metrics["train"]
    assert_close_to_rounding(logged["cancellation/shared_prefix_residual_two_sided"][-1], 0.0, scale=1.0,
                             dtype=torch.float32)
    assert logged["cancellation/one_sided_groups"][-1] == 0.0


@pytest.mark.parametrize("transform", BALANCING_TRANSFORMS)
def test_gradient_equals_weights_when_nothing_is_clipped_and_c_is_constant(transform):
    ids, mask, adv, log_ratio = random_batch(spread=0.02)
    results = []
    for target in ("weights", "gradient"):
        trainer = make_trainer(DFPOTrainer, DFPOConfig, **{**GSPO, "epsilon": 0.5, "epsilon_high": 0.5},
                               loss_type="dapo", group_transform=transform, cancellation_target=target)
        batch = with_old_logps(trainer, ids, mask, adv, log_ratio)
        used = record_row_weights(trainer)
        results.append(loss_and_grads(trainer, batch))
        assert used[-1].survives.all()
    (loss_w, grads_w), (loss_g, grads_g) = results
    # the same s̃ reached by two code paths: equal up to float32 rounding, scaled by the size of what is summed (the
    # loss: a mean of terms Â_i s̃_i of either sign; a gradient: its largest entry)
    assert_close_to_rounding(loss_g, loss_w, scale=adv.abs().mean())
    for name in grads_w:
        assert_close_to_rounding(grads_g[name], grads_w[name], msg=name)


def test_one_sided_zero_removes_the_group_update_and_logs_the_fraction():
    """Both surviving members have Â > 0 (the negative ones are clipped): one-sided. 'zero' gives the group no
    policy gradient; 'keep' gives it the 'weights' gradient."""
    ids = torch.tensor([[16, 17, 5, 6], [16, 17, 7, 8], [16, 17, 9, 10], [16, 17, 11, 12]])
    mask = torch.ones(4, 4, dtype=torch.long)
    log_ratio = torch.log(torch.tensor([1.1, 0.95, 0.6, 0.5])).unsqueeze(1).expand(4, 4).clone()
    adv = torch.tensor([1.0, 0.5, -0.5, -1.0])
    out = {}
    for policy in ("keep", "zero"):
        trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo", num_generations=4,
                               group_transform="min_replace", cancellation_target="gradient",
                               cancellation_one_sided=policy)
        loss_and_grads(trainer, with_old_logps(trainer, ids, mask, adv, log_ratio))
        out[policy] = trainer.captured.grad.clone()
        assert trainer._metrics["train"]["cancellation/one_sided_groups"][-1] == 1.0
    weights = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo", num_generations=4,
                           group_transform="min_replace")
    loss_and_grads(weights, with_old_logps(weights, ids, mask, adv, log_ratio))
    assert out["zero"].abs().max() == 0
    assert_close_to_rounding(out["keep"], weights.captured.grad)
    assert out["keep"].abs().max() > 1e-4


def test_score_form_gradient_target_balances_every_member():
    """In the score form nothing is clipped (U is the whole group): with grpo the 1/L_i factor is balanced."""
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="grpo", num_generations=4,
                           group_transform="min_replace", transform_gradient="score", cancellation_target="gradient")
    assert_close_to_rounding(shared_residual(trainer, clipped_group(trainer)), 0.0, scale=1.0, dtype=torch.float32)
    assert trainer.captured.grad[3].abs().max() > 0  # the member the ratio form clips keeps its gradient here


def test_gradient_target_with_vllm_importance_sampling_folds_the_ratio_into_c():
    """TRL multiplies each token's loss by its vLLM importance-sampling ratio; c_i includes Σ_t ratio, so the
    shared tokens still cancel."""
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, loss_type="dapo", num_generations=4,
                           group_transform="positive_orth_proj", cancellation_target="gradient")
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    batch = clipped_group(trainer)
    g = torch.Generator().manual_seed(3)
    batch["importance_sampling_ratio"] = 0.7 + 0.6 * torch.rand(4, 1, generator=g)  # sequence-level ratios
    assert_close_to_rounding(shared_residual(trainer, batch), 0.0, scale=1.0, dtype=torch.float32)



@pytest.mark.parametrize("target", ["weights", "gradient"])
def test_transform_group_weights_is_the_configured_transform(target):
    """The trainer's one call: the paper's transform for "weights", the balanced form for "gradient"."""
    g = torch.Generator().manual_seed(3)
    s_bar = 0.8 + 0.4 * torch.rand(3, 4, generator=g)
    adv = torch.randn(3, 4, generator=g)
    survives = torch.rand(3, 4, generator=g) > 0.2
    factor = torch.full((3, 4), 0.25, dtype=torch.float64)
    s_tilde, sides = transform_group_weights(get_transform("orth_proj"), s_bar, adv, survives, factor, target)
    a = gradient_coefficients(adv, factor, survives)
    if target == "weights":
        assert torch.equal(s_tilde, get_transform("orth_proj").apply(s_bar, adv, 0.5, 1e-6))
    else:
        terms = (a * s_tilde)[sides.two_sided]
        assert_close_to_rounding(terms.sum(-1), 0.0, scale=terms.abs().sum(-1), dtype=s_tilde.dtype)
    assert torch.equal(sides.two_sided, group_sides(adv, a).two_sided)
