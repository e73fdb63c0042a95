"""Statistics and number formatting shared by the benchmark reports (report.py, report_long_run.py, learning.py,
long_run.py, study_v2.py): 95% Student-t intervals over seeds and Welch intervals of differences. Pure Python (scipy
when installed, for the t quantile); it imports no other benchmark module.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["clean", "diff_ci", "fmt", "fmt_ci", "mean_ci", "t_quantile"]


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
