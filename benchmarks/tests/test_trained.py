"""The trained-weights kit's meters (dfpo_bench.trained): the rebuilt vLLM support whose mass K explains TRL's
importance-sampling ratio under truncated sampling, the per-mode row factors."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dfpo_bench.trained.is_ratio import rebuild_support_log_mass, row_factors, slope_per_token

ROOT = Path(__file__).resolve().parents[2]


def brute_force_kept_mass(probs: list[float], top_p: float, top_k: int) -> float:
    """vLLM's order written out element by element: the top k tokens, renormalised; then, ascending, drop tokens
    while the running mass stays at or below 1 − top_p (the largest always kept); the kept tokens' original mass."""
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = ranked[:top_k] if top_k > 0 else ranked
    total = sum(probs[i] for i in kept)
    running, dropped = 0.0, set()
    for i in reversed(kept[1:]):  # ascending, the largest excluded
        running += probs[i] / total
        if running <= 1.0 - top_p:
            dropped.add(i)
        else:
            break
    return sum(probs[i] for i in kept if i not in dropped)


def test_support_mass_matches_hand_numbers():
    """p = (0.5, 0.3, 0.15, 0.05): top-p 0.8 drops 0.05 and 0.15 (running 0.05, 0.2 ≤ 0.2), K = 0.8; top-k 3 then
    top-p 0.9 keeps all three (0.15 / 0.95 > 0.1), K = 0.95; untruncated K = 1."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert math.isclose(float(rebuild_support_log_mass(logits, 1.0, 0.8, 0).exp()), 0.8, rel_tol=1e-6)
    assert math.isclose(float(rebuild_support_log_mass(logits, 1.0, 0.9, 3).exp()), 0.95, rel_tol=1e-6)
    assert float(rebuild_support_log_mass(logits, 1.0, 1.0, 0)) == 0.0


def test_support_mass_matches_the_element_by_element_rule_at_a_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    for temperature, top_p, top_k in ((0.7, 0.8, 20), (0.6, 0.95, 20), (1.0, 0.5, 0), (0.9, 1.0, 5)):
        got = rebuild_support_log_mass(logits, temperature, top_p, top_k).exp()
        probs = torch.softmax(logits / temperature, dim=-1)
        want = torch.tensor([brute_force_kept_mass(row.tolist(), top_p, top_k) for row in probs])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_row_factors_are_trls_formulas():
    """Two rows: gaps of −0.1 per token over 3 and 1 tokens; the second row's log K equals its gap."""
    gap = torch.tensor([[-0.1, -0.1, -0.1], [-0.1, 0.0, 0.0]])
    log_mass = torch.tensor([[0.0, 0.0, 0.0], [-0.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    factors = row_factors(gap, log_mass, mask)
    # float32 inputs: −0.1 is held to float32's rounding (relative 6e-8 per value)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(factors["sequence_mask"],
                                                                [math.exp(-0.3), math.exp(-0.1)], strict=True))
    assert factors["off"] == [1.0, 1.0]
    assert math.isclose(factors["token_truncate"][0], math.exp(-0.1), rel_tol=1e-6)
    assert math.isclose(factors["against_truncated_support"][0], math.exp(-0.3), rel_tol=1e-6)
    assert math.isclose(factors["against_truncated_support"][1], 1.0, rel_tol=1e-6)
    above = row_factors(torch.tensor([[2.0]]), torch.zeros(1, 1), torch.ones(1, 1))
    assert above["sequence_mask"] == [0.0] and above["sequence_truncate"] == [3.0]  # TRL's cap C_max 3


def test_slope_recovers_an_exponential_in_length():
    lengths = [10.0, 100.0, 1000.0]
    assert math.isclose(slope_per_token(lengths, [math.exp(-0.02 * x) for x in lengths]), -0.02, rel_tol=1e-9)
    assert slope_per_token(lengths, [1.0, 1.0, 1.0]) == 0.0
