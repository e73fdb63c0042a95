"""Statistics and number formatting shared by the benchmark scripts and reports: the percentile-bootstrap interval of a
median (over rounds) and the reports' number format. Pure Python; it imports no other benchmark module.
"""

from __future__ import annotations

import random
import statistics


def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def bootstrap_median(values: list[float], draws: int = 4000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the median of ``values`` (resampling rounds)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]]
