"""Tests of dfpo_trl.metrics.mechanism and .curves (docs/source/concepts/metrics.md; arXiv 2604.13088 eq. 19, 20,
23)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import shared_prefix_residual

from dfpo_trl.metrics.curves import ema, jitter2, steps_to_threshold
from dfpo_trl.metrics.mechanism import asym, orth_residual, phi_stats, shared_prefix_mask
from dfpo_trl.transforms import get_transform

# ---------------------------------------------------------------------------------------------------
# asym, orth_residual, phi_stats
# ---------------------------------------------------------------------------------------------------


def test_asym_matches_numpy_reference():
    rng = np.random.default_rng(0)
    coef = np.exp(0.5 * rng.standard_normal((30, 8)))
    adv = rng.standard_normal((30, 8))
    expected = np.mean(np.var(coef * adv, axis=1))  # population variance (ddof=0)
    got = asym(torch.from_numpy(coef), torch.from_numpy(adv))
    assert got.dim() == 0 and got.dtype == torch.float64
    assert got.item() == pytest.approx(expected, rel=1e-12)
    got32 = asym(torch.from_numpy(coef).float(), torch.from_numpy(adv).float())
    assert got32.dtype == torch.float32 and got32.item() == pytest.approx(expected, rel=1e-5)


def test_asym_hand_value_and_min_replace_effect():
    coef = torch.tensor([[1.0, 3.0]])
    adv = torch.tensor([[1.0, -1.0]])
    # products (1, −3): mean −1, population variance ((2)² + (−2)²)/2 = 4
    assert asym(coef, adv).item() == pytest.approx(4.0)
    # equal coefficients leave only the variance of Â (eq. 23 after Min-Replace)
    equal = get_transform("min_replace").apply(coef, adv, 0.5, 1e-6)
    assert asym(equal, adv).item() == pytest.approx(1.0)


def test_orth_residual():
    w = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 0.0, -1.0], [1.0, 0.0, -1.0]])
    assert orth_residual(w, adv).item() == pytest.approx((2.0 + 0.0) / 2)
    assert orth_residual(torch.zeros(0, 3), torch.zeros(0, 3)).item() == 0.0


def test_phi_stats():
    w_bar = torch.tensor([[1.0, 2.0], [0.5, 4.0]])
    w_tilde = torch.tensor([[1.0, 1.0], [0.5, 0.5]])
    phi_min, phi_mean = phi_stats(w_tilde, w_bar)
    assert phi_min.item() == pytest.approx(0.125)
    assert phi_mean.item() == pytest.approx((1.0 + 0.5 + 1.0 + 0.125) / 4)
    # a corrupted w̄ = 0 stays finite
    phi_min, phi_mean = phi_stats(torch.ones(1, 2), torch.tensor([[0.0, 1.0]]))
    assert torch.isfinite(phi_min) and torch.isfinite(phi_mean)
    zero_min, zero_mean = phi_stats(torch.zeros(0, 2), torch.zeros(0, 2))
    assert zero_min.item() == 0.0 and zero_mean.item() == 0.0


def test_group_metric_shape_errors():
    with pytest.raises(ValueError, match="num_groups, G"):
        asym(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="equal shapes"):
        phi_stats(torch.ones(2, 3), torch.ones(3, 2))


# ---------------------------------------------------------------------------------------------------
# shared prefix mask and residual
# ---------------------------------------------------------------------------------------------------


def _hand_group() -> tuple[torch.Tensor, torch.Tensor]:
    # group 0: three members agree at t = 0, 1, diverge at t = 2 (one member), agree again at t = 3
    # group 1: identical tokens but member 1 is padded from t = 2: sharing stops at t = 2
    ids = torch.tensor(
        [
            [[5, 6, 7, 9, 0], [5, 6, 7, 9, 0], [5, 6, 8, 9, 0]],
            [[1, 2, 3, 4, 5], [1, 2, 0, 0, 0], [1, 2, 3, 4, 5]],
        ]
    )
    mask = torch.tensor(
        [
            [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]],
            [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]],
        ]
    )
    return ids, mask


def test_shared_prefix_mask_hand_example():
    ids, mask = _hand_group()
    shared = shared_prefix_mask(ids, mask)
    assert shared.dtype == torch.bool
    expected = torch.tensor([[True, True, False, False, False], [True, True, False, False, False]])
    assert torch.equal(shared, expected)


def test_shared_prefix_mask_padding_and_leading_divergence():
    ids = torch.tensor([[[3, 4, 5], [3, 4, 5]], [[3, 4, 5], [2, 4, 5]]])
    mask = torch.tensor([[[1, 1, 1], [1, 1, 0]], [[1, 1, 1], [1, 1, 1]]])
    # padding at t = 2 in group 0 (even with equal ids there) and divergence at t = 0 in group 1
    assert shared_prefix_mask(ids, mask).tolist() == [[True, True, False], [False, False, False]]
    # a masked-out leading position breaks sharing for everything after it
    mask = torch.tensor([[[0, 1, 1], [0, 1, 1]], [[1, 1, 1], [1, 1, 1]]])
    assert shared_prefix_mask(ids, mask).tolist()[0] == [False, False, False]


def test_shared_prefix_mask_group_of_one_is_false():
    ids = torch.tensor([[[1, 2, 3]]])
    mask = torch.ones_like(ids)
    assert shared_prefix_mask(ids, mask).tolist() == [[False, False, False]]
    value, count = shared_prefix_residual(torch.ones(1, 1, 3), ids, mask)
    assert count.item() == 0 and value.item() == 0.0


def test_shared_prefix_residual_extremes():
    ids, mask = _hand_group()
    # coefficients summing to zero over members at every position: perfect cancellation
    cancel = torch.tensor(
        [[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0, -2.0]]
    )
    coef = torch.stack([cancel, cancel])
    value, count = shared_prefix_residual(coef, ids, mask)
    assert count.item() == 4  # two shared positions in each of the two groups
    assert value.item() == pytest.approx(0.0, abs=1e-7)
    # same sign everywhere: no cancellation
    value, count = shared_prefix_residual(coef.abs() * 0.3, ids, mask)
    assert count.item() == 4 and value.item() == pytest.approx(1.0)
    # all-zero coefficients at shared positions are skipped
    value, count = shared_prefix_residual(torch.zeros_like(coef), ids, mask)
    assert count.item() == 0 and value.item() == 0.0


def test_shared_prefix_residual_partial_value():
    ids = torch.tensor([[[1, 2], [1, 2]]])
    mask = torch.ones_like(ids)
    coef = torch.tensor([[[3.0, 1.0], [-1.0, 0.0]]])
    value, count = shared_prefix_residual(coef, ids, mask)
    # t = 0: |3 − 1| / 4 = 0.5; t = 1: |1| / 1 = 1 → mean 0.75
    assert count.item() == 2 and value.item() == pytest.approx(0.75)


def test_shared_prefix_residual_paper_toy_eq38():
    # G = 2, T = 3: the shared prefix "answer is" carries coefficients Â_i s_i (eq. 38). GSPO leaves
    # A ρ1ρ2 (λ2 − λ1) uncancelled; Min-Replace and Orth-Proj cancel it exactly.
    big_a, rho1, rho2, lam1, lam2 = 0.7, 1.1, 0.9, 1.3, 0.8
    adv = torch.tensor([[-big_a, big_a]], dtype=torch.float64)
    s = torch.tensor([[rho1 * rho2 * lam1, rho1 * rho2 * lam2]], dtype=torch.float64)
    ids = torch.tensor([[[10, 11, 25], [10, 11, 20]]])
    mask = torch.ones_like(ids)
    expected_gspo = abs(big_a * rho1 * rho2 * (lam2 - lam1)) / (big_a * rho1 * rho2 * (lam1 + lam2))
    for name, expected in (("none", expected_gspo), ("min_replace", 0.0), ("orth_proj", 0.0)):
        coefficients = (adv * get_transform(name).apply(s, adv, 0.5, 1e-6))[..., None].expand(1, 2, 3)
        value, count = shared_prefix_residual(coefficients, ids, mask)
        assert count.item() == 2
        assert value.item() == pytest.approx(expected, abs=1e-12), name


# ---------------------------------------------------------------------------------------------------
# Curve metrics: Jitter2 (eq. 20), EMA and steps-to-threshold (eq. 19)
# ---------------------------------------------------------------------------------------------------


def test_jitter2_known_values():
    assert jitter2([0.0, 1.0, 0.0, 1.0]) == pytest.approx(2.0)
    assert jitter2([0.5 + 0.1 * t for t in range(20)]) == pytest.approx(0.0, abs=1e-12)
    assert jitter2(torch.tensor([1.0, 2.0, 4.0])) == pytest.approx(1.0)
    # [0, 0, 1, 0]: second differences 1 and −2 → (1 + 2) / 2
    assert jitter2(np.array([0.0, 0.0, 1.0, 0.0])) == pytest.approx(1.5)
    assert isinstance(jitter2([1, 2, 3]), float)


def test_jitter2_rejects_short_or_bad_curves():
    with pytest.raises(ValueError, match="at least 3 points"):
        jitter2([1.0, 2.0])
    with pytest.raises(ValueError, match="1-D"):
        jitter2(torch.ones(2, 3))


def test_ema_and_steps_to_threshold():
    curve = [0.0, 1.0, 1.0, 1.0]
    # e = 0, 0.3, 0.51, 0.657
    assert ema(curve, alpha=0.3) == pytest.approx([0.0, 0.3, 0.51, 0.657])
    assert steps_to_threshold(curve, 0.5, alpha=0.3) == 2
    assert steps_to_threshold(curve, 0.0, alpha=0.3) == 0
    assert steps_to_threshold(curve, 0.7, alpha=0.3) is None
    assert steps_to_threshold(curve, 1.0, alpha=1.0) == 1  # alpha = 1: no smoothing
    assert steps_to_threshold([], 0.5) is None
    assert ema(torch.tensor([2.0, 4.0]), alpha=0.5) == pytest.approx([2.0, 3.0])
    with pytest.raises(ValueError, match="alpha"):
        ema(curve, alpha=0.0)
