"""The main job's figure: held-out accuracy panel, per-step reward with its EMA, residuals on readable scales."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from dfpo_trl.metrics import ema  # noqa: E402
from dfpo_trl.plotting import READING_GUIDE, RESIDUAL_FLOOR, plot_metrics  # noqa: E402


def history(steps: int = 12) -> list[dict[str, float]]:
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "step_reward": (step % 3) / 2, "transform/orth_residual": 3e-8 * step,
               "cancellation/shared_prefix_residual": 0.02 * step, "entropy": 1.0}  # fmt: skip
        if step % 4 == 1:
            row["reward"] = 0.5  # TRL's once-per-rollout mean: not drawn when step_reward is there
        rows.append(row)
    return rows


def axes_by_title(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_figure_shows_accuracy_reward_ema_and_readable_residuals() -> None:
    rows = history()
    fig = plot_metrics(rows, heldout={"n": 100, "before": 0.48, "after": 0.87})
    axes = axes_by_title(fig)
    accuracy = axes["held-out greedy accuracy (100 problems)"]
    assert sorted(round(p.get_height(), 2) for p in accuracy.patches) == [0.48, 0.87]
    reward = next(ax for title, ax in axes.items() if title.startswith("training reward"))
    points, line = reward.get_lines()
    assert list(points.get_ydata()) == [r["step_reward"] for r in rows]  # one point per step, not per rollout
    assert list(line.get_ydata()) == pytest.approx(ema([r["step_reward"] for r in rows], alpha=0.3))
    orth = next(ax for title, ax in axes.items() if title.startswith("orthogonality residual"))
    assert orth.get_yscale() == "log" and min(orth.get_lines()[0].get_ydata()) == RESIDUAL_FLOOR
    shared = next(ax for title, ax in axes.items() if title.startswith("shared-prefix residual"))
    assert shared.get_ylim() == pytest.approx((-0.02, 1.02))
    assert any(text.get_text() == READING_GUIDE for text in fig.texts)


def test_several_runs_and_no_heldout() -> None:
    fig = plot_metrics({"GSPO": history(), "DFPO": history()}, heldout={"GSPO": {"before": 0.4, "after": 0.6}})
    assert any(t.startswith("held-out") for t in axes_by_title(fig))
    fig = plot_metrics(history())
    assert not any(t.startswith("held-out") for t in axes_by_title(fig))
