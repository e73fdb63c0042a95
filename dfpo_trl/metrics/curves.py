"""Curve metrics of a training run (eq. 19, 20): EMA, Jitter₂ and steps to a threshold, on Python numbers.

They take a Python sequence or a 1-D tensor and return Python numbers (the main job's summary and the figure read
them: docs/source/concepts/metrics.md, "Curve metrics"). None of them returns NaN for valid input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ema", "jitter2", "steps_to_threshold"]


def _as_float_list(curve: Sequence[float] | torch.Tensor, name: str) -> list[float]:
    if isinstance(curve, torch.Tensor):
        if curve.dim() != 1:
            raise ValueError(f"{name} expects a 1-D curve, got a tensor of shape {tuple(curve.shape)}")
        return [float(v) for v in curve.detach().to("cpu", torch.float64).tolist()]
    return [float(v) for v in curve]


def jitter2(curve: Sequence[float] | torch.Tensor) -> float:
    """Jitter₂ (eq. 20): (1/(T−2)) Σ_{t=1}^{T−2} |m_{t+2} − 2m_{t+1} + m_t|, the mean absolute second
    difference of a training curve: 0 for a straight line, large for short-term oscillation.

    Raises ValueError for fewer than 3 points (the metric is undefined; we never log NaN).

    Args:
        curve: T ≥ 3 values m_t.

    Returns:
        Jitter₂.
    """
    m = _as_float_list(curve, "jitter2")
    if len(m) < 3:
        raise ValueError(f"jitter2 needs a curve of at least 3 points, got {len(m)}")
    return sum(abs(m[t + 2] - 2.0 * m[t + 1] + m[t]) for t in range(len(m) - 2)) / (len(m) - 2)


def ema(curve: Sequence[float] | torch.Tensor, alpha: float = 0.3) -> list[float]:
    """Exponential moving average e_0 = m_0, e_t = α m_t + (1 − α) e_{t−1}, used to smooth a reward
    curve before thresholding (eq. 19) so a single lucky step does not count as reaching the threshold.

    Args:
        curve: the values m_t.
        alpha: α in (0, 1].

    Returns:
        e_t, one per value.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    out: list[float] = []
    for value in _as_float_list(curve, "ema"):
        out.append(value if not out else alpha * value + (1.0 - alpha) * out[-1])
    return out


def steps_to_threshold(
    curve: Sequence[float] | torch.Tensor, threshold: float, alpha: float = 0.3
) -> int | None:
    """Steps(Score ≥ κ) (eq. 19): the first 0-based index where the EMA of ``curve`` is ≥ ``threshold``,
    or None if it never gets there.

    Args:
        curve: the values m_t.
        threshold: κ.
        alpha: the EMA's α.

    Returns:
        The first index whose EMA is ≥ κ, or None.
    """
    for index, value in enumerate(ema(curve, alpha=alpha)):
        if value >= threshold:
            return index
    return None
