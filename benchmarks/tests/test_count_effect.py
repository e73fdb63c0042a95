"""dfpo_bench.studies.count_effect: the sampling surprise against the odds, the within-run pooled slope (a planted
slope recovered; a run's own level does not leak in), and its seed-resampling interval."""

from __future__ import annotations

import math
import random

import pytest

from dfpo_bench.studies import count_effect as ce  # noqa: E402


def run_record(shares: dict[int, float], odds: dict[int, float]) -> dict:
    return {"drift": {"curve": [{"step": s, "log_odds_mean": v} for s, v in odds.items()]},
            "series": {"drift/form_share/sum": [[k, v] for k, v in shares.items()]}}


def test_pairs_are_the_surprise_against_the_odds_at_the_window_start() -> None:
    # windows of 2 steps; rollouts at steps 1 and 3 (one per window); odds 0 then 1 then 0.5
    record = run_record({1: 0.8, 3: 0.4}, {0: 0.0, 2: 1.0, 4: 0.5})
    pairs = ce.count_pairs(record, 2)
    flat = [v for pair in pairs for v in pair]
    assert flat == pytest.approx([0.8 - 0.5, 1.0, 0.4 - 1 / (1 + math.exp(-1.0)), -0.5], rel=1e-12)
    # an anchor with a rollout every step: the window's mean share
    anchor = run_record({1: 0.7, 2: 0.9, 3: 0.5, 4: 0.3}, {0: 0.0, 2: 1.0, 4: 0.5})
    assert ce.count_pairs(anchor, 2)[0][0] == pytest.approx(0.8 - 0.5, rel=1e-12)
    assert ce.count_pairs(run_record({1: 0.8}, {0: 0.0}), 2) == []  # no measurement at the window's end


def test_within_run_slope_recovers_a_planted_slope_despite_run_offsets() -> None:
    rng = random.Random(0)
    runs = []
    for r in range(20):  # each run its own level of x and y (what a pooled fit across runs would pick up)
        offset_x, offset_y = rng.uniform(-0.3, 0.3), rng.uniform(-5, 5) - 20 * r
        runs.append([(offset_x + x, offset_y + 1.5 * x) for x in (rng.uniform(-0.2, 0.2) for _ in range(6))])
    assert ce.within_run_slope(runs) == pytest.approx(1.5, rel=1e-9)
    assert ce.within_run_slope([[(0.1, 1.0), (0.1, 2.0)]]) is None  # no spread in x


def test_slope_interval_brackets_the_slope_and_pairs_by_seed() -> None:
    rng = random.Random(1)
    a = {s: [(x, 2.0 * x + rng.gauss(0, 0.05)) for x in (rng.uniform(-0.2, 0.2) for _ in range(8))] for s in range(30)}
    b = {s: [(x, 0.5 * x + rng.gauss(0, 0.05)) for x in (rng.uniform(-0.2, 0.2) for _ in range(8))] for s in range(30)}
    one = ce.slope_interval(a)
    assert one["low"] < one["slope"] < one["high"] and one["low"] > 1.5 and one["high"] < 2.5
    diff = ce.slope_interval(a, b)
    assert diff["slope"] == pytest.approx(ce.within_run_slope(list(a.values())) - ce.within_run_slope(list(b.values())),
                                          rel=1e-12)
    assert diff["low"] > 1.0 and diff["runs"] == 30
    assert ce.slope_interval({0: a[0]}) is None
