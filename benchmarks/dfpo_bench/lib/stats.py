"""Statistics and number formatting shared by the benchmark scripts and reports: 95% Student-t intervals over seeds,
Welch intervals of differences, the MDE with t, the bootstrap interval of a median, cluster bootstraps (of any
statistic, and of a least-squares fit from the clusters' sums). Pure Python (scipy when installed, for the t
quantile); it imports no other benchmark module.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

__all__ = ["bootstrap_median", "clean", "cluster_bootstrap", "cluster_bootstrap_ols", "diff_ci", "fmt", "fmt_ci",
           "mean_ci", "mde_t", "ols", "t_ppf", "t_quantile"]


def t_quantile(df: float) -> float:
    """Two-sided 95% Student-t quantile."""
    try:
        from scipy import stats

        return float(stats.t.ppf(0.975, df))
    except ImportError:  # Cornish-Fisher expansion; within 0.2% of the exact value for df >= 2
        z = 1.959964
        g1 = (z**3 + z) / 4
        g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
        g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
        return z + g1 / df + g2 / df**2 + g3 / df**3


def t_ppf(p: float, df: float) -> float:
    """The p quantile of Student's t with ``df`` degrees of freedom (power calculations need p = 0.8 as well as
    0.975). scipy when installed, else the Cornish-Fisher expansion around the normal quantile."""
    if not 0 < p < 1 or not df > 0:
        raise ValueError(f"t_ppf needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    try:
        from scipy import stats

        return float(stats.t.ppf(p, df))
    except ImportError:
        z = statistics.NormalDist().inv_cdf(p)
        g1 = (z**3 + z) / 4
        g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
        g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
        return z + g1 / df + g2 / df**2 + g3 / df**3


def mde_t(se: float, df: float, power: float = 0.8) -> float:
    """Minimum detectable difference at ``power``, two-sided α = 0.05, for a difference with standard error ``se``
    and (Welch) ``df`` degrees of freedom: (t_0.975,df + t_power,df) · se. With few runs a side z understates it."""
    return (t_ppf(0.975, df) + t_ppf(power, df)) * se


def clean(values: list[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def mean_ci(values: list[Any]) -> tuple[float, float, float, int] | None:
    """(mean, low, high, n) with a 95% t-interval; low = high = mean for n = 1; None when empty."""
    v = clean(values)
    if not v:
        return None
    m = statistics.fmean(v)
    if len(v) < 2:
        return m, m, m, 1
    half = t_quantile(len(v) - 1) * statistics.stdev(v) / math.sqrt(len(v))
    return m, m - half, m + half, len(v)


def diff_ci(a: list[Any], b: list[Any]) -> tuple[float, float, float] | None:
    """mean(a) - mean(b) with a 95% Welch interval; None unless both have >= 2 values."""
    a, b = clean(a), clean(b)
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    d = statistics.fmean(a) - statistics.fmean(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return d, d, d
    df = (va + vb) ** 2 / ((va**2 / (len(a) - 1)) + (vb**2 / (len(b) - 1)))
    half = t_quantile(df) * se
    return d, d - half, d + half


def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def fmt_ci(stats: tuple[float, float, float, int] | None, digits: int = 3) -> str:
    if stats is None:
        return "–"
    m, lo, hi, n = stats
    return f"{m:.{digits}f}" if n < 2 else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def bootstrap_median(values: list[float], draws: int = 4000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the median of ``values`` (resampling rounds)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]]


def ols(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of y on x; None below 2 points or when x does not vary."""
    if len(points) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def cluster_bootstrap(clusters: dict[Any, list[Any]], statistic: Any, draws: int = 4000,
                      seed: int = 0) -> dict[str, Any] | None:
    """``statistic`` (a function of a list of items, returning a float or None) on every item of ``clusters`` pooled,
    with a 95% percentile interval from ``draws`` resamplings of whole clusters with replacement (items of one cluster,
    e.g. the branch points of one trajectory, are not independent); None below 2 clusters or without a value."""
    keys = sorted(clusters, key=str)
    if len(keys) < 2:
        return None
    point = statistic([item for k in keys for item in clusters[k]])
    if point is None:
        return None
    rng = random.Random(seed)
    boot = sorted(v for _ in range(draws)
                  if (v := statistic([item for k in rng.choices(keys, k=len(keys)) for item in clusters[k]]))
                  is not None)
    if not boot:
        return None
    return {"value": point, "low": boot[int(0.025 * len(boot))], "high": boot[int(0.975 * len(boot)) - 1],
            "se": statistics.stdev(boot) if len(boot) > 1 else 0.0, "clusters": len(keys),
            "items": sum(len(clusters[k]) for k in keys), "draws": len(boot)}


def cluster_bootstrap_ols(clusters: dict[Any, list[tuple[float, float]]], draws: int = 4000, seed: int = 0
                          ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(slope, intercept) of :func:`ols` over the (x, y) pairs of ``clusters`` pooled, each as
    :func:`cluster_bootstrap` gives it with ``ols``'s slope or intercept as the statistic: the same resamplings (the
    same seed and key order), the same percentile interval. A resampling's fit needs only its clusters' sums (n, Σx,
    Σy, Σx², Σxy), so each draw costs the number of clusters, not of points; the sums are centred on the pooled means
    first, so the result equals ``ols`` on the pooled points to rounding."""
    keys = sorted(clusters, key=str)
    pooled = [point for k in keys for point in clusters[k]]
    if len(keys) < 2 or ols(pooled) is None:
        return None, None
    mx, my = statistics.fmean(x for x, _ in pooled), statistics.fmean(y for _, y in pooled)
    sums = {k: (len(clusters[k]), sum(x - mx for x, _ in clusters[k]), sum(y - my for _, y in clusters[k]),
                sum((x - mx) ** 2 for x, _ in clusters[k]), sum((x - mx) * (y - my) for x, y in clusters[k]))
            for k in keys}
    scale = max(s[3] for s in sums.values())

    def fit(chosen: list[Any]) -> tuple[float, float] | None:
        n, sx, sy, sxx, sxy = (sum(sums[k][i] for k in chosen) for i in range(5))
        if n < 2 or sxx - sx * sx / n <= 1e-12 * scale * len(chosen):  # x does not vary (ols: None)
            return None
        slope = (sxy - sx * sy / n) / (sxx - sx * sx / n)
        return slope, my + sy / n - slope * (mx + sx / n)

    rng = random.Random(seed)
    boot = [f for _ in range(draws) if (f := fit(rng.choices(keys, k=len(keys)))) is not None]
    point = ols(pooled)
    entries = []
    for i in range(2):
        values = sorted(f[i] for f in boot)
        entries.append({"value": point[i], "low": values[int(0.025 * len(values))],
                        "high": values[int(0.975 * len(values)) - 1],
                        "se": statistics.stdev(values) if len(values) > 1 else 0.0, "clusters": len(keys),
                        "items": len(pooled), "draws": len(values)} if values else None)
    return entries[0], entries[1]
