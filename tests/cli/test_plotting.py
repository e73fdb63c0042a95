"""The main job's figure: held-out accuracy panel, per-step reward with its EMA, residuals on readable scales."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from dfpo_trl.cli.plotting import READING_GUIDE, RESIDUAL_FLOOR, plot_metrics  # noqa: E402
from dfpo_trl.metrics.curves import ema  # noqa: E402

SHARED_STEPS = (3, 7, 10)  # the shared-prefix residual is measured at some steps only


def history(steps: int = 12, orth_scale: float = 3e-8) -> list[dict[str, float]]:
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "step_reward": (step % 3) / 2, "transform/orth_residual": orth_scale * (step % 4),
               "entropy": 1.0}  # fmt: skip
        if step in SHARED_STEPS:
            row["cancellation/shared_prefix_residual"] = 0.02 * step
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
    # Min-Replace: every residual is float rounding (<= 1e-6): said in the panel, not drawn as a flat line
    orth = next(ax for title, ax in axes.items() if title.startswith("orthogonality residual"))
    assert orth.get_yscale() == "log"
    assert [list(line.get_ydata()) for line in orth.get_lines()] == [[RESIDUAL_FLOOR, RESIDUAL_FLOOR]]  # the floor
    assert any("all 12 logged steps <= 1e-06 (max 9e-08)" in t.get_text() for t in orth.texts)
    # measured at 3 of the 12 steps: dots at those steps, not a line through values never measured
    shared = next(ax for title, ax in axes.items() if title.startswith("shared-prefix residual"))
    assert shared.get_ylim() == pytest.approx((-0.02, 1.02))
    (dots,) = shared.get_lines()
    assert dots.get_linestyle() == "None" and dots.get_marker() == "o"
    assert list(dots.get_xdata()) == list(SHARED_STEPS) and dots.get_label() == "3 of 12 steps"
    assert shared.get_xlim() == pytest.approx((0.5, 12.5)) == orth.get_xlim()  # every panel spans the run
    entropy = axes["entropy"]
    assert entropy.get_lines()[0].get_linestyle() == "-"  # logged every step: a line
    # the caption speaks only of panels the figure has: no phi, no Asym here
    (caption,) = [t.get_text() for t in fig.texts if t.get_text().startswith("How to read")]
    assert "Shared-prefix residual" in caption and "Orthogonality residual" in caption
    assert "phi" not in caption and "Asym" not in caption
    full = history()
    for row in full:
        row.update({"asym/before": 0.5, "asym/after": 0.4, "transform/phi_min": 0.9})
    assert READING_GUIDE in [t.get_text() for t in plot_metrics(full).texts]


def test_sparse_label_counts_optimizer_steps_not_the_step_0_row() -> None:
    """A run's log holds a step-0 row (the held-out accuracy before training) and repeats its last step (the train
    summary): a metric measured at 3 of 12 optimizer steps is "3 of 12 steps", not "3 of 13"."""
    rows = [{"heldout/accuracy_before_training": 0.48, "heldout/problems": 100, "step": 0}, *history(),
            {"train_runtime": 300.0, "step": 12}]  # fmt: skip
    shared = next(ax for title, ax in axes_by_title(plot_metrics(rows)).items() if title.startswith("shared-prefix"))
    assert [line.get_label() for line in shared.get_lines()] == ["3 of 12 steps"]
    assert shared.get_xlim() == pytest.approx((0.5, 12.5))  # the optimizer steps: no empty step 0
    rows[0]["cancellation/shared_prefix_residual"] = 0.5  # also measured before training
    axes = axes_by_title(plot_metrics(rows))
    shared = next(ax for title, ax in axes.items() if title.startswith("shared-prefix"))
    assert [line.get_label() for line in shared.get_lines()] == ["3 of 12 steps and before training"]
    assert shared.get_xlim() == pytest.approx((-0.5, 12.5)) and axes["entropy"].get_xlim() == pytest.approx((0.5, 12.5))


def test_residual_above_the_floor_is_drawn_beside_a_run_at_the_floor() -> None:
    """GSPO's orthogonality residual grows off-policy (drawn, its zeros at the floor); DFPO's stays float rounding
    (a legend entry saying so)."""
    fig = plot_metrics({"GSPO": history(orth_scale=1e-3), "DFPO": history()})
    orth = next(ax for ax in fig.axes if ax.get_title().startswith("orthogonality residual"))
    gspo = orth.get_lines()[0]
    assert gspo.get_label() == "GSPO" and gspo.get_linestyle() == "-"
    assert list(gspo.get_ydata()) == pytest.approx([max(1e-3 * (s % 4), RESIDUAL_FLOOR) for s in range(1, 13)])
    labels = orth.get_legend_handles_labels()[1]
    assert labels == ["GSPO", "DFPO: all 12 logged steps <= 1e-06 (max 9e-08): float rounding"]


def test_several_runs_and_no_heldout() -> None:
    fig = plot_metrics({"GSPO": history(), "DFPO": history()}, heldout={"GSPO": {"before": 0.4, "after": 0.6}})
    assert any(t.startswith("held-out") for t in axes_by_title(fig))
    fig = plot_metrics(history())
    assert not any(t.startswith("held-out") for t in axes_by_title(fig))


def test_accuracy_panel_names_the_resume_step_when_before_training_is_unknown() -> None:
    """A resumed run whose checkpoint held no accuracy before training: the first bar is the accuracy measured at
    the resume step, and its label says so instead of "before training"."""
    fig = plot_metrics(history(), heldout={"n": 4, "before": None, "at_resume": 0.25, "resumed_at": 6, "after": 0.5})
    accuracy = axes_by_title(fig)["held-out greedy accuracy (4 problems)"]
    assert sorted(round(p.get_height(), 2) for p in accuracy.patches) == [0.25, 0.5]
    assert [t.get_text() for t in accuracy.get_xticklabels()] == ["at resume (step 6)", "after training"]
    fig = plot_metrics(history(), heldout={"n": 4, "before": 0.25, "resumed_at": 6, "after": 0.5})
    labels = [t.get_text() for t in axes_by_title(fig)["held-out greedy accuracy (4 problems)"].get_xticklabels()]
    assert labels == ["before training", "after training"]


def test_accuracy_measured_along_the_run_is_a_curve_over_the_steps() -> None:
    """With eval_every the held-out accuracy panel draws each run's measurements over the steps (step 0: before
    training), a run per line, each with its own line style and marker."""
    gspo = {"n": 50, "before": 0.4, "after": 0.7, "curve": [[0, 0.4], [4, 0.5], [8, 0.6], [12, 0.7]]}
    dfpo = {"n": 50, "before": 0.4, "after": 0.8, "curve": [[0, 0.4], [4, 0.6], [8, 0.7], [12, 0.8]]}
    fig = plot_metrics({"GSPO": history(), "DFPO": history()}, heldout={"GSPO": gspo, "DFPO": dfpo})
    accuracy = axes_by_title(fig)["held-out greedy accuracy (50 problems)"]
    assert not accuracy.patches  # no bars
    lines = accuracy.get_lines()
    assert [line.get_label() for line in lines] == ["GSPO 0.40 -> 0.70", "DFPO 0.40 -> 0.80"]
    for line, result in zip(lines, (gspo, dfpo), strict=True):
        assert list(line.get_xdata()) == [0, 4, 8, 12]
        assert list(line.get_ydata()) == [v for _, v in result["curve"]]
    assert lines[0].get_linestyle() != lines[1].get_linestyle() and lines[0].get_marker() != lines[1].get_marker()
    # one run's curve, as the main job writes it
    fig = plot_metrics(history(), heldout=gspo)
    (line,) = axes_by_title(fig)["held-out greedy accuracy (50 problems)"].get_lines()
    assert list(line.get_ydata()) == [0.4, 0.5, 0.6, 0.7]


def test_two_runs_with_equal_values_stay_visible_in_every_panel() -> None:
    """Two runs that log the same values (one rollout's steps: the same completions and rewards) draw in every panel
    with a different line style or marker, the second hollow, so that neither hides the other."""
    fig = plot_metrics({"GSPO": history(orth_scale=1e-3), "DFPO": history(orth_scale=1e-3)})
    for title, ax in axes_by_title(fig).items():
        by_run: dict[str, list] = {"GSPO": [], "DFPO": []}
        for line in ax.get_lines():
            run = next((r for r in by_run if line.get_color() == {"GSPO": "C0", "DFPO": "C1"}[r]), None)
            if run is not None:
                by_run[run].append((line.get_linestyle(), line.get_marker(), line.get_markerfacecolor()))
        assert by_run["GSPO"] and by_run["DFPO"], title
        assert set(by_run["GSPO"]).isdisjoint(by_run["DFPO"]), title
        marked = [face for _, marker, face in by_run["DFPO"] if marker not in ("None", None, "")]
        assert marked and all(face == "none" for face in marked), title  # hollow over the first run's filled
