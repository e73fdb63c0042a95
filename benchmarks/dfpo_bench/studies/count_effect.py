"""The count effect read from run records: does a stretch of training in which the policy sampled more of one
rewarded form move the log-odds towards that form? Used by study_v3.py (confirmatory) and study_v2_findings.py
(exploratory, on study v2's records).

Per run, each window between two drift measurements gives one pair (x, y): y the change of the drift meter's
log-odds o (first form vs second) across the window, x the sampling surprise: the sampled share of the first form
("sum") among the rewarded completions of the rollouts that start in the window minus the share the policy's odds
predict at the window's start, σ(o). The raw share tracks the current odds, so regressing y on it mixes the count
effect with where the run already is (on study v2's records the raw share's slope has opposite signs within runs and
across them: ``raw_share`` in results/study_v2_findings.json); the surprise is the part of the count that sampling
drew. The arm's slope is the within-run
pooled least-squares slope Σ_r Σ (x − x̄_r)(y − ȳ_r) / Σ_r Σ (x − x̄_r)²: runs with little spread in x weigh little,
which a mean of per-run slopes does not do (with 4 windows a run, one run's slope can be any size). Its interval
resamples whole runs (seeds). σ(mean log-odds) stands in for the mean over prompts of σ(log-odds): an approximation.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

Pairs = list[tuple[float, float]]


def count_pairs(record: dict[str, Any], window: int, surprise: bool = True) -> Pairs:
    """(sampling surprise, Δ log-odds) per window (j·window, (j + 1)·window] with drift measured at both ends; the
    share is the mean of the ``drift/form_share/sum`` values logged in the window (one per rollout), the surprise
    that share minus σ(log-odds at the window's start) (``surprise=False``: the raw share)."""
    odds = {int(d["step"]): float(d["log_odds_mean"]) for d in (record.get("drift") or {}).get("curve") or []
            if d.get("log_odds_mean") is not None}
    shares: dict[int, list[float]] = {}
    for step, share in (record.get("series") or {}).get("drift/form_share/sum", []):
        shares.setdefault((int(step) - 1) // window, []).append(float(share))
    return [(statistics.fmean(v) - (sigmoid(odds[j * window]) if surprise else 0.0),
             odds[(j + 1) * window] - odds[j * window])
            for j, v in sorted(shares.items()) if j * window in odds and (j + 1) * window in odds]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def within_run_slope(runs: list[Pairs]) -> float | None:
    """The within-run pooled slope of y on x; None when x does not vary within any run."""
    sxy = sxx = 0.0
    for pairs in runs:
        if len(pairs) < 2:
            continue
        mx, my = statistics.fmean(x for x, _ in pairs), statistics.fmean(y for _, y in pairs)
        sxy += sum((x - mx) * (y - my) for x, y in pairs)
        sxx += sum((x - mx) ** 2 for x, _ in pairs)
    return sxy / sxx if sxx > 0 else None


def slope_interval(runs: dict[int, Pairs], other: dict[int, Pairs] | None = None, draws: int = 2000,
                   seed: int = 0) -> dict[str, Any] | None:
    """The within-run slope (minus ``other``'s, paired by seed: the same seeds resampled for both) with a 95%
    percentile interval over ``draws`` resamplings of the seeds; None below 2 seeds or without spread."""
    seeds = sorted(set(runs) & set(other)) if other is not None else sorted(runs)
    if len(seeds) < 2:
        return None

    def value(chosen: list[int]) -> float | None:
        a = within_run_slope([runs[s] for s in chosen])
        if other is None or a is None:
            return a
        b = within_run_slope([other[s] for s in chosen])
        return None if b is None else a - b

    point = value(seeds)
    if point is None:
        return None
    rng = random.Random(seed)
    boot = sorted(v for _ in range(draws) if (v := value([rng.choice(seeds) for _ in seeds])) is not None)
    return {"slope": point, "low": boot[int(0.025 * len(boot))], "high": boot[int(0.975 * len(boot)) - 1],
            "runs": len(seeds), "windows": sum(len(runs[s]) for s in seeds), "draws": len(boot)}
