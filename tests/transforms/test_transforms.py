"""Tests of dfpo_trl.transforms.builtins and transforms (and s, s̄ of dfpo_trl.objectives.weights) against
the equations of arXiv 2604.13088 (Appendix B) and docs/source/concepts/design.md."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from tolerance import assert_close_to_rounding

import dfpo_trl.transforms.builtins as transforms_module
from dfpo_trl.objectives.weights import sequence_log_ratio, sign_aware_post_clip
from dfpo_trl.transforms import (
    GROUP_TRANSFORMS,
    W_MAX,
    get_transform,
    min_replace,
    orth_proj,
    positive_orth_proj,
    scale,
    truncate_rebalance,
)

ORTHOGONAL_TRANSFORMS = ("min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance")


def _zero_mean_advantages(num_groups: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """Group-standardised advantages from random rewards, with both signs in every group."""
    rewards = torch.randn(num_groups, group_size, generator=gen, dtype=torch.float64)
    adv = rewards - rewards.mean(dim=-1, keepdim=True)
    return adv / adv.std(dim=-1, keepdim=True)


def _binary_advantages(num_groups: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """GRPO-style advantages of 0/1 rewards (many ties, some all-equal groups)."""
    rewards = (torch.rand(num_groups, group_size, generator=gen, dtype=torch.float64) < 0.4).double()
    adv = rewards - rewards.mean(dim=-1, keepdim=True)
    return adv / (adv.std(dim=-1, keepdim=True) + 1e-4)


def _ratio_weights(num_groups: int, group_size: int, gen: torch.Generator, spread: float = 0.5) -> torch.Tensor:
    return torch.exp(spread * torch.randn(num_groups, group_size, generator=gen, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------
# eq. 44: sequence log-ratio
# ---------------------------------------------------------------------------------------------------


def test_sequence_log_ratio_is_masked_mean():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 0.3 - 2.0
    old = logp + 0.1 * torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    rho = sequence_log_ratio(logp, old, mask)
    for i in range(3):
        length = int(mask[i].sum())
        expected = (logp[i, :length] - old[i, :length]).mean()
        assert rho[i].item() == pytest.approx(expected.item(), abs=1e-12)
    assert rho[3].item() == 0.0  # zero-length row
    assert rho.shape == (4,) and rho.dtype == torch.float64


def test_sequence_log_ratio_clamps_and_stays_finite():
    logp = torch.tensor([[1e4, 1e4, 0.0], [-1e4, -1e4, -1e4], [0.5, float("inf"), 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [float("nan"), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 1, 1]])
    rho = sequence_log_ratio(logp, old, mask, max_abs=20.0)
    assert torch.isfinite(rho).all()
    assert rho.tolist() == pytest.approx([20.0, -20.0, 20.0, 0.0])
    assert torch.isfinite(torch.exp(rho)).all()
    # +Inf and -Inf in one row: no NaN.
    both = sequence_log_ratio(torch.tensor([[float("inf"), float("-inf")]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert torch.isfinite(both).all()


def test_sequence_log_ratio_masked_garbage_ignored_and_differentiable():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("-inf"), float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, 0.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rho = sequence_log_ratio(logp, old, mask)
    assert rho.tolist() == pytest.approx([0.25, -0.25])
    rho.sum().backward()
    assert torch.equal(logp.grad, torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))


def test_sequence_log_ratio_keeps_input_dtype():
    logp = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert sequence_log_ratio(logp, logp, torch.ones(2, 3)).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# eq. 46–49: sign-aware post-clip
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.28), (3e-4, 4e-4), (0.0, 0.0)])
def test_sign_aware_post_clip_identity_eq48_49(eps_low, eps_high):
    gen = torch.Generator().manual_seed(1)
    s = torch.exp(0.5 * torch.randn(64, 8, generator=gen, dtype=torch.float64))
    adv = torch.randn(64, 8, generator=gen, dtype=torch.float64)
    adv[0, :3] = 0.0
    c = s.clamp(1 - eps_low, 1 + eps_high)
    clipped = (s != c).sum().item()
    assert clipped > 50  # the identity is exercised on clipped entries too
    s_bar = sign_aware_post_clip(s, adv, eps_low, eps_high)
    lhs = torch.minimum(s * adv, c * adv).sum(dim=-1)
    rhs = (adv * s_bar).sum(dim=-1)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-12)
    # elementwise definition (eq. 47)
    expected = torch.where(adv >= 0, torch.minimum(s, c), torch.maximum(s, c))
    assert torch.equal(s_bar, expected)


def test_sign_aware_post_clip_gradient_zero_when_clipped():
    s = torch.tensor([0.5, 1.0, 1.5, 0.5, 1.0, 1.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    s_bar = sign_aware_post_clip(s, adv, 0.2, 0.2)
    assert s_bar.tolist() == pytest.approx([0.5, 1.0, 1.2, 0.8, 1.0, 1.5])
    (adv * s_bar).sum().backward()
    # GSPO: Â>0 clipped above (s=1.5) and Â<0 clipped below (s=0.5) carry no gradient.
    assert s.grad.tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, -1.0, -1.0])


def test_sign_aware_post_clip_rejects_negative_eps():
    with pytest.raises(ValueError, match="eps_low"):
        sign_aware_post_clip(torch.ones(2), torch.ones(2), -0.1, 0.2)


# ---------------------------------------------------------------------------------------------------
# Group transforms against their definitions
# ---------------------------------------------------------------------------------------------------


def test_min_replace_definition():
    gen = torch.Generator().manual_seed(2)
    w = _ratio_weights(20, 6, gen)
    adv = _zero_mean_advantages(20, 6, gen)
    out = min_replace(w, adv)
    assert torch.equal(out, w.min(dim=-1, keepdim=True).values.expand_as(w))


def test_orth_proj_definition_and_minimality():
    gen = torch.Generator().manual_seed(3)
    w = _ratio_weights(50, 5, gen)
    adv = torch.randn(50, 5, generator=gen, dtype=torch.float64)  # not zero-mean: projection still exact
    out = orth_proj(w, adv)
    coef = (adv * w).sum(-1, keepdim=True) / (adv * adv).sum(-1, keepdim=True)
    torch.testing.assert_close(out, w - coef * adv, rtol=0, atol=1e-12)
    torch.testing.assert_close((out * adv).sum(-1), torch.zeros(50, dtype=torch.float64), rtol=0, atol=1e-12)
    # w − out is parallel to Â (the projection moves w the least).
    diff = w - out
    cross = diff[:, :, None] * adv[:, None, :] - diff[:, None, :] * adv[:, :, None]
    assert cross.abs().max().item() < 1e-12


def test_orth_proj_can_go_negative():
    w = torch.tensor([[0.1, 2.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    out = orth_proj(w, adv)
    assert out.tolist()[0] == pytest.approx([1.05, 1.05])
    # (3, 0.01, 0.02) against (1, 1, −2): coefficient 2.97/6, so the second entry becomes −0.485.
    w = torch.tensor([[3.0, 0.01, 0.02]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    assert orth_proj(w, adv).tolist()[0] == pytest.approx([2.505, -0.485, 1.01])


def test_scale_definition():
    w = torch.tensor([[1.0, 2.0, 4.0]])
    assert scale(w, torch.zeros_like(w), factor=0.5).tolist() == [[0.5, 1.0, 2.0]]
    assert get_transform("scale").apply(w, torch.zeros_like(w), 0.25, 1e-6).tolist() == [[0.25, 0.5, 1.0]]
    with pytest.raises(ValueError, match="scale_factor"):
        scale(w, w, factor=-1.0)


@pytest.mark.parametrize("name", ORTHOGONAL_TRANSFORMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_orthogonal_on_zero_mean_groups(name, dtype):
    gen = torch.Generator().manual_seed(4)
    w = _ratio_weights(300, 16, gen, spread=1.0).to(dtype)
    adv = _zero_mean_advantages(300, 16, gen).to(dtype)
    out = get_transform(name).apply(w, adv, 0.5, 1e-6)
    assert out.dtype == dtype and out.shape == w.shape
    tol = 1e-10 if dtype == torch.float64 else 5e-5
    scale_ref = (adv.abs() * out.abs()).sum(-1).clamp(min=1.0)
    assert ((out * adv).sum(-1).abs() / scale_ref).max().item() < tol
    if name != "orth_proj":
        assert (out >= 0).all()


# ---------------------------------------------------------------------------------------------------
# positive_orth_proj: exact QP (eq. 51)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(params=["dense", "sorted"])
def bracket_path(request, monkeypatch):
    """Run a positive_orth_proj test through both of its root-bracketing paths."""
    monkeypatch.setattr(transforms_module, "_DENSE_MAX_ELEMENTS", 1 << 40 if request.param == "dense" else 0)
    return request.param


def _kkt_violation(v: np.ndarray, w: np.ndarray, a: np.ndarray) -> float:
    """Largest violation of the KKT conditions of min ½‖v − w‖² s.t. aᵀv = 0, v ≥ 0 at v.

    Stationarity: v − w + μa − ν = 0 with ν ≥ 0, ν_i v_i = 0. Members with v_i > 0 pin μ (or need
    v_i = w_i when a_i = 0); members with v_i = 0 need μ a_i ≥ w_i. We find the best μ and report the
    worst residual, so a small value certifies optimality (KKT is sufficient for this convex QP).
    """
    scale_ = max(1.0, float(np.abs(w).max()), float(np.abs(a).max()))
    tol = 1e-9 * scale_
    viol = [abs(float(a @ v)), float(max(0.0, -v.min()))]
    active = v > tol
    pin = active & (a != 0)
    free = active & (a == 0)
    if free.any():
        viol.append(float(np.abs(v[free] - w[free]).max()))
    zero = ~active
    if pin.any():
        mu = float(np.sum(a[pin] * (w[pin] - v[pin])) / np.sum(a[pin] ** 2))
        viol.append(float(np.abs(v[pin] - w[pin] + mu * a[pin]).max()))
    else:
        lower = [w[i] / a[i] for i in np.flatnonzero(zero & (a > 0))]
        upper = [w[i] / a[i] for i in np.flatnonzero(zero & (a < 0))]
        lo = max(lower, default=-np.inf)
        hi = min(upper, default=np.inf)
        mu = lo if np.isfinite(lo) else (hi if np.isfinite(hi) else 0.0)
        viol.append(max(0.0, lo - hi))
    nu = v - w + mu * a
    viol.append(float(max(0.0, -nu[zero].min())) if zero.any() else 0.0)  # ν ≥ 0 where v = 0
    viol.append(float(np.abs(nu * v).max()))  # complementary slackness
    return max(viol)


def _slsqp(w: np.ndarray, a: np.ndarray) -> np.ndarray | None:
    """A general-purpose solver's answer to eq. 51, or None where it reports no convergence."""
    res = minimize(
        lambda v: 0.5 * np.sum((v - w) ** 2),
        x0=np.clip(w, 0.0, None),
        jac=lambda v: v - w,
        method="SLSQP",
        bounds=[(0.0, None)] * len(w),
        constraints=[{"type": "eq", "fun": lambda v: a @ v, "jac": lambda v: a}],
        options={"ftol": 1e-12, "maxiter": 500},
    )
    return res.x if res.success else None


def _random_qp_cases(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ws, advs = [], []
    for group_size in (2, 3, 4, 6, 8):
        n = 24
        w = _ratio_weights(n, group_size, gen, spread=1.0)
        w[: n // 3] = 3.0 * torch.rand(n // 3, group_size, generator=gen, dtype=torch.float64) - 1.0  # generic sign
        adv = _zero_mean_advantages(n, group_size, gen)
        adv[n // 2 : n // 2 + 4] = _binary_advantages(4, group_size, gen)
        adv[-3:] = torch.randn(3, group_size, generator=gen, dtype=torch.float64)  # not zero-mean
        pad = 8 - group_size
        # pad with zero-advantage members of weight 0.7 so every group fits one batch (tests batching too)
        ws.append(torch.cat([w, torch.full((n, pad), 0.7, dtype=torch.float64)], dim=-1))
        advs.append(torch.cat([adv, torch.zeros(n, pad, dtype=torch.float64)], dim=-1))
    return torch.cat(ws), torch.cat(advs)


def test_positive_orth_proj_matches_general_qp_solver_and_kkt(bracket_path):
    gen = torch.Generator().manual_seed(5)
    w, adv = _random_qp_cases(gen)
    out = positive_orth_proj(w, adv)
    binding = compared = 0
    for i in range(w.shape[0]):
        wi, ai, vi = w[i].numpy(), adv[i].numpy(), out[i].numpy()
        if not np.any(ai != 0):
            continue
        assert _kkt_violation(vi, wi, ai) < 1e-9, (wi, ai, vi)  # certificate of optimality
        ref = _slsqp(wi, ai)
        if ref is not None:
            np.testing.assert_allclose(vi, ref, atol=1e-5, rtol=0)
            compared += 1
        binding += int((vi == 0).any() and (wi > 0).all())
    assert compared >= 0.9 * w.shape[0]
    assert binding > 5  # the non-negativity constraint was active in a fair number of cases


def test_positive_orth_proj_batched_equals_single_group(bracket_path):
    gen = torch.Generator().manual_seed(6)
    w, adv = _random_qp_cases(gen)
    batched = positive_orth_proj(w, adv)
    single = torch.cat([positive_orth_proj(w[i : i + 1], adv[i : i + 1]) for i in range(w.shape[0])])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-12)


def test_positive_orth_proj_equals_orth_proj_when_that_is_nonnegative(bracket_path):
    gen = torch.Generator().manual_seed(7)
    w = 1.0 + 0.05 * torch.randn(200, 8, generator=gen, dtype=torch.float64)
    adv = _zero_mean_advantages(200, 8, gen)
    plain = orth_proj(w, adv)
    assert (plain > 0).all()
    torch.testing.assert_close(positive_orth_proj(w, adv), plain, rtol=0, atol=1e-12)


def test_positive_orth_proj_hand_example_unconstrained(bracket_path):
    # w = (0.1, 3, 1), Â = (1, −2, 1): with every member active, g(μ) = −4.9 − 6μ, so μ = −4.9/6 and
    # v = w − μÂ = (0.9167, 1.3667, 1.8167) > 0, the plain projection.
    w = torch.tensor([[0.1, 3.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 1.0]], dtype=torch.float64)
    mu = -4.9 / 6.0
    expected = w - mu * adv
    torch.testing.assert_close(positive_orth_proj(w, adv), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(orth_proj(w, adv), expected, rtol=0, atol=1e-12)


def test_positive_orth_proj_member_forced_to_zero(bracket_path):
    # Â = (1, 1, -2), w = (3, 0.01, 0.02): the negative side cannot balance; the positive side shrinks and
    # the smaller positive member hits 0 (v = max(w − μÂ, 0) with μ > 0.01).
    w = torch.tensor([[3.0, 0.01, 0.02]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    v = positive_orth_proj(w, adv)[0]
    # Active {1, 3}: (3 − μ) − 2(0.02 + 2μ) = 0 → μ = 2.96/5 = 0.592; member 2: 0.01 − 0.592 < 0 → 0.
    mu = 2.96 / 5.0
    torch.testing.assert_close(v, torch.tensor([3.0 - mu, 0.0, 0.02 + 2 * mu], dtype=torch.float64))
    assert (orth_proj(w, adv)[0] < 0).any()  # the plain projection would have gone negative


def test_positive_orth_proj_one_sided_groups(bracket_path):
    # Only positive advantages (not zero-mean): the QP optimum zeroes them; zero-advantage members keep
    # max(w, 0).
    w = torch.tensor([[1.0, 2.0, 0.5, -0.3]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 0.5, 0.0, 0.0]], dtype=torch.float64)
    assert positive_orth_proj(w, adv).tolist() == [[0.0, 0.0, 0.5, 0.0]]
    adv = torch.tensor([[-1.0, -0.5, 0.0, 0.0]], dtype=torch.float64)
    assert positive_orth_proj(w, adv).tolist() == [[0.0, 0.0, 0.5, 0.0]]
    # A negative weight on the only side is already at its optimum 0.
    w = torch.tensor([[-1.0, 2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert positive_orth_proj(w, adv).tolist() == [[0.0, 2.0]]


def test_positive_orth_proj_tied_breakpoints(bracket_path):
    w = torch.tensor([[1.0, 1.0, 2.0, 2.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 2.0, -1.0, -1.0, -2.0]], dtype=torch.float64)
    v = positive_orth_proj(w, adv)[0].numpy()
    assert _kkt_violation(v, w[0].numpy(), adv[0].numpy()) < 1e-12
    ref = _slsqp(w[0].numpy(), adv[0].numpy())
    assert ref is not None
    np.testing.assert_allclose(v, ref, atol=1e-6)


def test_positive_orth_proj_float32_agrees_with_float64(bracket_path):
    gen = torch.Generator().manual_seed(8)
    w = _ratio_weights(500, 32, gen, spread=1.0)
    adv = _binary_advantages(500, 32, gen)
    ref = positive_orth_proj(w, adv)
    for i in range(w.shape[0]):  # many ties in Â here: KKT must hold for every group
        if (adv[i] != 0).any():
            assert _kkt_violation(ref[i].numpy(), w[i].numpy(), adv[i].numpy()) < 1e-9
    out = positive_orth_proj(w.float(), adv.float())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_positive_orth_proj_float32_on_hard_groups(bracket_path):
    # Wide weight spreads, one-sided groups, tied advantages and tiny advantages whose breakpoints w/Â are
    # far out: float32 must stay within rounding of the float64 solution (a "total minus prefix" sum
    # in locating the root once put a member at 0.55 instead of 0 here).
    gen = torch.Generator().manual_seed(14)
    for trial in range(24):
        group_size = int(torch.randint(2, 65, (1,), generator=gen))
        spread = 4.0 * float(torch.rand(1, generator=gen))
        w = torch.exp(spread * torch.randn(32, group_size, generator=gen, dtype=torch.float64))
        kind = trial % 3
        if kind == 0:  # one-sided, about half the members at zero advantage
            keep = torch.rand(32, group_size, generator=gen) < 0.5
            adv = torch.rand(32, group_size, generator=gen, dtype=torch.float64) * keep
            adv[16:] *= -1
        elif kind == 1:
            adv = _binary_advantages(32, group_size, gen)
        else:  # integer advantages: many ties, not zero-mean
            adv = torch.randint(-2, 3, (32, group_size), generator=gen).double()
        ref = positive_orth_proj(w, adv)
        out = positive_orth_proj(w.float(), adv.float()).double()
        assert (out >= 0).all()
        err = (out - ref).abs() / w.abs().amax(-1, keepdim=True).clamp(min=1.0)
        assert err.max().item() < 1e-5, trial
    # one-sided group whose largest breakpoint belongs to a tiny advantage: every Â > 0 member must go to 0
    w = torch.tensor([[0.9, 600.0, 450.0, 400.0, 50.0, 0.1, 203.0, 121.0]])
    adv = torch.tensor([[2.6e-4, 0.74, 0.75, 0.7, 0.6, 0.0, 0.8, 0.9]])
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0]])
    torch.testing.assert_close(positive_orth_proj(w, adv), expected, rtol=0, atol=1e-6)


def test_positive_orth_proj_dense_and_sorted_paths_agree(monkeypatch):
    gen = torch.Generator().manual_seed(15)
    w = _ratio_weights(300, 12, gen, spread=2.0)
    adv = torch.randint(-3, 4, (300, 12), generator=gen).double()
    adv[:100] = _zero_mean_advantages(100, 12, gen)
    adv[100:110] = 0.0
    w[110:120, 3] = float("nan")
    w[120:130, 5] = float("inf")
    results = {}
    for path, limit in (("dense", 1 << 40), ("sorted", 0)):
        monkeypatch.setattr(transforms_module, "_DENSE_MAX_ELEMENTS", limit)
        results[path] = positive_orth_proj(w, adv)
    assert torch.isfinite(results["dense"]).all()
    torch.testing.assert_close(results["dense"], results["sorted"], rtol=1e-12, atol=1e-9)


# ---------------------------------------------------------------------------------------------------
# truncate_rebalance (eq. 52–55)
# ---------------------------------------------------------------------------------------------------


def test_truncate_rebalance_hand_examples():
    # δ < 0: M_P = 2·0.5 + 1·2 = 3, M_N = 1·1 + 2·1.5 = 4 → β = 3/4 (positive; eq. 55 prints −3/4).
    w = torch.tensor([[0.5, 2.0, 1.0, 1.5]], dtype=torch.float64)
    adv = torch.tensor([[2.0, 1.0, -1.0, -2.0]], dtype=torch.float64)
    assert truncate_rebalance(w, adv).tolist() == [pytest.approx([0.5, 2.0, 0.75, 1.125])]
    # δ > 0 with zero-advantage members: M_P = 2, M_N = 0.5 → α = 0.25; zero-advantage members unscaled.
    w = torch.tensor([[2.0, 1.0, 0.5, 1.3]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 0.0, -1.0, 0.0]], dtype=torch.float64)
    assert truncate_rebalance(w, adv).tolist() == [pytest.approx([0.5, 1.0, 0.5, 1.3])]
    # δ = 0: s⁺ unchanged.
    w = torch.tensor([[0.5, 2.0, 1.0, 1.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    assert truncate_rebalance(w, adv).tolist() == [[0.5, 2.0, 1.0, 1.5]]


def test_truncate_rebalance_result_can_fall_below_floor():
    # The paper says s̃ ⪰ ϵ; false once α < 1 scales a floored member.
    floor = 1e-6
    w = torch.tensor([[1e-9, 3.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    out = truncate_rebalance(w, adv, floor=floor)[0]
    alpha = 2.0 / (3.0 + floor)
    assert out.tolist() == pytest.approx([alpha * floor, alpha * 3.0, 1.0], rel=1e-12)
    assert out[0].item() < floor
    assert abs(float((out * adv[0]).sum())) < 1e-12


def test_truncate_rebalance_factors_in_unit_interval():
    gen = torch.Generator().manual_seed(9)
    w = _ratio_weights(400, 8, gen, spread=1.0)
    w[:50, 0] = -0.5  # exercise the truncation
    adv = _zero_mean_advantages(400, 8, gen)
    out = truncate_rebalance(w, adv)
    s_plus = w.clamp(min=1e-6)
    factor = out / s_plus
    pos, neg = adv > 0, adv < 0
    assert torch.all((factor > 0) & (factor <= 1.0 + 1e-12))
    # exactly one side is scaled, by one common factor, and that factor is positive (the corrected β)
    for i in range(400):
        fp, fn = factor[i][pos[i]], factor[i][neg[i]]
        assert (fp == 1).all() or (fn == 1).all()
        assert fp.max() - fp.min() < 1e-12 and fn.max() - fn.min() < 1e-12
    beta_rows = (factor * neg).amax(-1)
    assert ((beta_rows > 0) & (beta_rows <= 1)).all()
    torch.testing.assert_close((out * adv).sum(-1), torch.zeros(400, dtype=torch.float64), rtol=0, atol=1e-12)


def test_truncate_rebalance_is_not_the_exact_projection():
    gen = torch.Generator().manual_seed(10)
    w = _ratio_weights(100, 8, gen, spread=1.0)
    adv = _zero_mean_advantages(100, 8, gen)
    approx = truncate_rebalance(w, adv)
    exact = positive_orth_proj(w, adv)
    for out in (approx, exact):
        assert ((out * adv).sum(-1).abs() < 1e-10).all() and (out >= 0).all()
    assert (approx - exact).abs().amax(-1).min().item() > 1e-3  # they differ in every group here
    # and the exact one is the closer to w, as its definition demands
    assert torch.all(((exact - w) ** 2).sum(-1) <= ((approx - w) ** 2).sum(-1) + 1e-12)


def test_truncate_rebalance_rejects_bad_floor():
    with pytest.raises(ValueError, match="truncate_floor"):
        truncate_rebalance(torch.ones(1, 2), torch.ones(1, 2), floor=-1.0)


# ---------------------------------------------------------------------------------------------------
# Paper toy, eq. 35–38 (G = 2, T = 3)
# ---------------------------------------------------------------------------------------------------


def test_paper_toy_eq38():
    big_a, rho1, rho2, lam1, lam2 = 0.7, 1.1, 0.9, 1.3, 0.8
    # Per-token ratios r_{i,t} (eq. 35–36) as log-probabilities against a zero old policy.
    log_r = torch.tensor([[rho1, rho2, lam1], [rho1, rho2, lam2]], dtype=torch.float64).log()
    mask = torch.ones(2, 3)
    # Eq. 37 uses the product of ratios; sequence_log_ratio gives the length-normalised mean, so
    # s_i = exp(T · ρ_i) recovers the product.
    s = torch.exp(3.0 * sequence_log_ratio(log_r, torch.zeros_like(log_r), mask))
    torch.testing.assert_close(s, torch.tensor([rho1 * rho2 * lam1, rho1 * rho2 * lam2], dtype=torch.float64))
    adv = torch.tensor([[-big_a, big_a]], dtype=torch.float64)  # eq. 32
    gspo_sum = (adv * s).sum().item()
    assert gspo_sum == pytest.approx(big_a * rho1 * rho2 * (lam2 - lam1), abs=1e-12)
    assert abs(gspo_sum) > 0.1
    for name in ORTHOGONAL_TRANSFORMS:
        s_tilde = get_transform(name).apply(s[None], adv, 0.5, 1e-6)
        assert (adv * s_tilde).sum().item() == pytest.approx(0.0, abs=1e-12), name
    assert (adv * get_transform("none").apply(s[None], adv, 0.5, 1e-6)).sum().item() == pytest.approx(gspo_sum)
    assert (adv * get_transform("scale").apply(s[None], adv, 0.5, 1e-6)).sum().item() == pytest.approx(0.5 * gspo_sum)


# ---------------------------------------------------------------------------------------------------
# Degenerate inputs
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GROUP_TRANSFORMS)
def test_all_zero_advantages(name):
    w = torch.tensor([[0.9, 1.1, 1.3], [1.0, 1.0, 1.0]])
    out = get_transform(name).apply(w, torch.zeros_like(w), 0.5, 1e-6)
    assert torch.isfinite(out).all()
    if name in ("none", "orth_proj", "positive_orth_proj", "truncate_rebalance"):
        assert torch.equal(out, w)


@pytest.mark.parametrize("name", GROUP_TRANSFORMS)
def test_group_size_one(name):
    w = torch.tensor([[1.3], [0.7], [1.0]])
    adv = torch.tensor([[0.5], [-2.0], [0.0]])
    out = get_transform(name).apply(w, adv, 0.5, 1e-6)
    assert out.shape == (3, 1) and torch.isfinite(out).all()
    if name in ORTHOGONAL_TRANSFORMS and name != "min_replace":
        # the only vector orthogonal to a non-zero scalar advantage is 0
        assert out[:2].abs().max().item() < 1e-6
        assert out[2].item() == pytest.approx(1.0)


@pytest.mark.parametrize("name", GROUP_TRANSFORMS)
def test_one_side_empty(name):
    w = torch.tensor([[1.2, 0.8, 1.0, 0.9], [1.2, 0.8, 1.0, 0.9]])
    adv = torch.tensor([[1.0, 0.5, 0.0, 0.0], [0.0, -1.0, 0.0, -3.0]])
    out = get_transform(name).apply(w, adv, 0.5, 1e-6)
    assert torch.isfinite(out).all()
    if name in ("positive_orth_proj", "truncate_rebalance"):
        assert (out >= 0).all()
        assert (out * adv).sum(-1).abs().max().item() < 1e-6
        assert out[0, 2:].tolist() == pytest.approx([1.0, 0.9])  # zero-advantage members untouched


@pytest.mark.parametrize("name", GROUP_TRANSFORMS[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nonfinite_weights_are_sanitized(name, dtype):
    inf, nan = float("inf"), float("nan")
    w = torch.tensor([[inf, 1.0, 0.9, 1.1], [nan, 1.0, 1.2, 0.8], [-inf, 1.0, 1.0, 1.0]]).to(dtype)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]] * 3).to(dtype)
    out = get_transform(name).apply(w, adv, 0.5, 1e-6)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", GROUP_TRANSFORMS)
def test_extreme_advantages(name):
    w = torch.tensor([[0.9, 1.1, 1.3, 0.7]] * 4)
    adv = torch.tensor(
        [
            [1e30, -1e30, 1e30, -1e30],
            [1e-30, -1e-30, 2e-30, -2e-30],
            [float("inf"), -1.0, 0.0, 0.0],
            [3e38, -3e38, 1.0, -1.0],
        ]
    )
    out = get_transform(name).apply(w, adv, 0.5, 1e-6)
    assert torch.isfinite(out).all()
    if name in ORTHOGONAL_TRANSFORMS:
        a = adv.double().nan_to_num() / adv.double().nan_to_num().abs().amax(-1, keepdim=True)
        rows = [0, 1, 3] if name == "min_replace" else [0, 1, 2, 3]  # row 2 is not zero-mean
        # float32 weights: Σ = 0 up to their rounding, which is relative to the inputs (Σ |Â| max w), not to the
        # outputs (row 2's dominant member gets s̃ = 0)
        scale = a.abs().sum(-1) * w.double().abs().amax(-1)
        assert_close_to_rounding((out.double() * a).sum(-1)[rows], 0.0, scale=scale[rows], dtype=out.dtype)


def test_sanitization_bound_is_above_sequence_ratio_range():
    assert W_MAX > math.exp(20.0)
    w = torch.tensor([[math.exp(20.0), 1.0]], dtype=torch.float64)
    assert min_replace(w, torch.zeros_like(w)).tolist() == [[1.0, 1.0]]
    assert scale(w, torch.zeros_like(w), 1.0).tolist() == w.tolist()


# ---------------------------------------------------------------------------------------------------
# Dispatcher, shapes, autograd
# ---------------------------------------------------------------------------------------------------


def test_dispatcher_unknown_name():
    with pytest.raises(ValueError) as info:
        get_transform("min-replace").apply(torch.ones(1, 2), torch.zeros(1, 2), 0.5, 1e-6)
    message = str(info.value)
    assert "name='min-replace'" in message
    for valid in GROUP_TRANSFORMS:
        assert valid in message


def test_dispatcher_routes_to_functions():
    gen = torch.Generator().manual_seed(11)
    w = _ratio_weights(10, 4, gen)
    adv = _zero_mean_advantages(10, 4, gen)
    assert get_transform("none").apply(w, adv, 0.5, 1e-6) is w
    assert torch.equal(get_transform("min_replace").apply(w, adv, 0.5, 1e-6), min_replace(w, adv))
    assert torch.equal(get_transform("orth_proj").apply(w, adv, 0.5, 1e-6), orth_proj(w, adv))
    assert torch.equal(get_transform("positive_orth_proj").apply(w, adv, 0.5, 1e-6), positive_orth_proj(w, adv))
    assert torch.equal(
        get_transform("truncate_rebalance").apply(w, adv, 0.5, 0.9),
        truncate_rebalance(w, adv, 0.9),
    )
    assert GROUP_TRANSFORMS == (
        "none",
        "min_replace",
        "orth_proj",
        "positive_orth_proj",
        "truncate_rebalance",
        "scale",
    )


@pytest.mark.parametrize("name", GROUP_TRANSFORMS)
def test_shape_mismatch_raises(name):
    with pytest.raises(ValueError, match="num_groups, G"):
        get_transform(name).apply(torch.ones(2, 3), torch.ones(2, 4), 0.5, 1e-6)
    with pytest.raises(ValueError, match="num_groups, G"):
        get_transform(name).apply(torch.ones(6), torch.ones(6), 0.5, 1e-6)


def test_no_stop_gradient_min_replace_gives_zero_gradient():
    # Table 3's "no stop-grad" ablation: differentiating min_replace with Σ Â = 0 yields Σ_i Â_i s_min(θ),
    # whose gradient is (Σ Â) ∇s_min = 0 exactly (docs/source/concepts/design.md).
    gen = torch.Generator().manual_seed(12)
    w = _ratio_weights(5, 6, gen).requires_grad_(True)
    adv = _zero_mean_advantages(5, 6, gen)
    (adv * min_replace(w, adv)).sum().backward()
    assert w.grad.abs().max().item() < 1e-12


@pytest.mark.parametrize("name", GROUP_TRANSFORMS[1:])
def test_transforms_are_differentiable(name):
    gen = torch.Generator().manual_seed(13)
    w = _ratio_weights(4, 5, gen).requires_grad_(True)
    adv = _zero_mean_advantages(4, 5, gen)
    get_transform(name).apply(w, adv, 0.5, 1e-6).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
