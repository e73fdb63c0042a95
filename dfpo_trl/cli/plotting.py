"""PNG of the training curves: held-out accuracy, reward, entropy and DFPO's mechanism metrics over optimizer steps.

Reads ``trainer.state.log_history`` (a list of logged dicts). Uses matplotlib's object API with the Agg canvas,
so it never touches pyplot's global backend (safe in notebooks, servers and CI).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..metrics.curves import ema

__all__ = [
    "DEFAULT_PANELS", "EMA_ALPHA", "READING_GUIDE", "RESIDUAL_FLOOR", "curve", "plot_metrics", "reading_guide",
    "run_style",
]  # fmt: skip

# One panel per entry: title and the logged keys drawn in it (a panel with no logged key is left out). In a
# panel whose keys are alternatives (REWARD_KEYS) only the first one a run logged is drawn.
REWARD_KEYS = ("step_reward", "reward")
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("training reward (points) and its EMA (line)", REWARD_KEYS),
    ("entropy", ("entropy",)),
    ("Asym (eq. 23)", ("asym/before", "asym/after")),
    ("phi = s~ / s_bar", ("transform/phi_min", "transform/phi_mean")),
    ("orthogonality residual |sum s~ A| (log)", ("transform/orth_residual",)),
    ("shared-prefix residual (0 = cancels, 1 = none)", ("cancellation/shared_prefix_residual",)),
    ("DelTA lambda", ("delta/lambda_pos_mean", "delta/lambda_neg_mean")),
    ("completion length", ("completions/mean_length",)),
)
EMA_ALPHA = 0.3  # the EMA of eq. 19, as in the run summary
# Below this the orthogonality residual is float32 rounding of sums of O(1) terms, not a signal: drawn at the floor.
RESIDUAL_FLOOR = 1e-6
LOG_FLOOR_KEYS = ("transform/orth_residual",)
UNIT_RANGE_KEYS = ("cancellation/shared_prefix_residual",)
# The caption: one line per kind of panel, each kept only when that panel is drawn.
GUIDE_PARTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("asym/before",),
     "Asym (eq. 23): spread of a group's weighted advantages s_i A_i (after < before: evened out); equal at a "
     "rollout's first step (all s = 1), 0 where all A = 0."),
    (("transform/phi_min",),
     "phi = s~ / s_bar: the transform's factor on each sequence weight (< 1: lowered); 1 at a rollout's first step, "
     "on-policy: nothing to balance."),
    (("transform/orth_residual",),
     f"Orthogonality residual below {RESIDUAL_FLOOR:g}: float rounding, the weights balance the advantages (said in "
     "its panel, not drawn)."),
    (("cancellation/shared_prefix_residual",),
     "Shared-prefix residual: the learning tax on shared tokens (0 = they cancel; dots: the steps where it was "
     "measured)."),
)  # fmt: skip
# What the caption says of a panel that is not there though the run logged the group metrics it comes with.
ABSENT_PARTS: tuple[tuple[str, str, str], ...] = (
    ("asym/before", "cancellation/shared_prefix_residual",
     "No shared-prefix residual panel: it is measured where all of a group's completions begin with the same tokens "
     "and it has a reward signal; no group here did."),
)  # fmt: skip
READING_GUIDE = "How to read:\n" + "\n".join(text for _, text in GUIDE_PARTS)  # every panel drawn
CAPTION_CHARS_PER_LINE = 160  # at the caption's 7 pt on a 10-inch-wide figure; longer lines wrap


def reading_guide(drawn: set[str]) -> str:
    """The caption for a figure whose panels show the logged keys ``drawn``: only sentences about what is there."""
    parts = [text for keys, text in GUIDE_PARTS if drawn.intersection(keys)]
    parts += [text for logged, absent, text in ABSENT_PARTS if logged in drawn and absent not in drawn]
    return "How to read:\n" + "\n".join(parts) if parts else ""


History = Sequence[Mapping[str, Any]]


def curve(history: History, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` in a log history; rows without it are skipped."""
    steps, values = [], []
    for index, row in enumerate(history):
        value = row.get(key)
        if isinstance(value, (int, float)):
            steps.append(float(row.get("step", index + 1)))
            values.append(float(value))
    return steps, values


def _keys_to_draw(history: History, keys: Sequence[str]) -> list[str]:
    present = [k for k in keys if curve(history, k)[0]]
    return present[:1] if tuple(keys) == REWARD_KEYS else present


# Each run's look when several are overlaid: its colour, line style and marker (hollow after the first), so that a
# run whose values equal another's still shows (a dashed line over a solid one, a hollow square round a dot).
RUN_STYLES = ("-", "--", ":", "-.")
RUN_MARKERS = ("o", "s", "^", "D")


def run_style(run_index: int) -> dict[str, Any]:
    """matplotlib keywords that tell run ``run_index`` apart from the others in a panel they share."""
    marker = RUN_MARKERS[run_index % len(RUN_MARKERS)]
    hollow = {"markerfacecolor": "none", "markeredgewidth": 1.2} if run_index else {}
    return {"color": f"C{run_index}", "marker": marker, "markersize": 6 if run_index else 4, **hollow}


def _heldout_curve(result: Mapping[str, Any]) -> list[tuple[float, float]]:
    """A run's held-out accuracy as (step, accuracy) points: the measurements along the run, or before and after."""
    points = [(float(step), float(value)) for step, value in result.get("curve") or []
              if isinstance(value, (int, float))]  # fmt: skip
    return sorted(points)


def _accuracy_panel(ax: Any, heldout: Mapping[str, Mapping[str, Any]]) -> None:
    """Held-out greedy accuracy: a curve over the optimizer steps when some run measured it along the way
    (``eval_every``), else grouped bars before and after training, one pair per run."""
    if any(len(_heldout_curve(result)) > 2 for result in heldout.values()):
        _accuracy_curves(ax, heldout)
    else:
        _accuracy_bars(ax, heldout)
    n = next((r.get("n") for r in heldout.values() if r.get("n")), None)
    ax.set_ylim(0, 1.08)
    metric = next((r.get("metric") for r in heldout.values() if r.get("metric")), "greedy accuracy")
    ax.set_title(f"held-out {metric}{f' ({n} problems)' if n else ''}", fontsize=10)


def _accuracy_curves(ax: Any, heldout: Mapping[str, Mapping[str, Any]]) -> None:
    """One line per run through its measurements (step 0: before training); its legend entry gives the first and
    the last value."""
    from matplotlib.ticker import MaxNLocator

    for run_index, (run, result) in enumerate(heldout.items()):
        points = _heldout_curve(result)
        if not points:
            continue
        steps, values = [s for s, _ in points], [v for _, v in points]
        label = f"{run + ' ' if run else ''}{values[0]:.2f} -> {values[-1]:.2f}"
        ax.plot(steps, values, linestyle=RUN_STYLES[run_index % len(RUN_STYLES)], label=label,
                **run_style(run_index))  # fmt: skip
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step (0: before training)", fontsize=8)


def _accuracy_bars(ax: Any, heldout: Mapping[str, Mapping[str, Any]]) -> None:
    """Grouped bars of held-out greedy accuracy before and after training, one pair per run. A resumed run whose
    checkpoint held no accuracy before training shows the one at the resume step instead, labelled so."""
    width = 0.8 / max(len(heldout), 1)
    first = "before training"
    for run_index, (run, result) in enumerate(heldout.items()):
        values = [result.get("before"), result.get("after")]
        if values[0] is None and result.get("at_resume") is not None:
            values[0], first = result["at_resume"], f"at resume (step {result.get('resumed_at')})"
        xs = [i + (run_index - (len(heldout) - 1) / 2) * width for i in range(2)]
        drawn = [(x, v) for x, v in zip(xs, values, strict=True) if isinstance(v, (int, float))]
        ax.bar([x for x, _ in drawn], [v for _, v in drawn], width=width, color=f"C{run_index}", label=run or None)
        for x, v in drawn:
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0, 1], [first, "after training"])


def plot_metrics(
    histories: History | Mapping[str, History],
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
    panels: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PANELS,
    columns: int = 2,
    heldout: Mapping[str, Any] | None = None,
) -> Any:
    """Plot one run's log history, or several (``{"GSPO": history, "DFPO": history}``) overlaid per panel.

    ``heldout`` adds a first panel with held-out accuracy: one run's ``{"before", "after", "n", "curve"}`` (the main
    job's ``HeldoutAccuracyCallback.results``) or ``{run name: that}``, drawn as a curve over the steps when a run
    measured it along the way (``curve`` of ``[step, accuracy]`` with more than two points), else as bars before
    and after. Several runs get each its colour, line style and marker (hollow after the first), so that equal
    values do not hide a run. The reward is drawn per logged
    point with its EMA (α = 0.3, eq. 19); the orthogonality residual on a log axis floored at
    :data:`RESIDUAL_FLOOR` (a run whose every value is below it is said in the panel, not drawn as a flat line);
    the shared-prefix residual on its [0, 1] range; a metric logged at only some of the run's steps as dots at
    those steps, never joined; every panel spans the run's steps; a caption says how to read them.
    Writes a PNG to ``path`` when given and returns the path; otherwise returns the matplotlib ``Figure``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs: dict[str, History] = dict(histories) if isinstance(histories, Mapping) else {"": histories}
    if heldout is not None and "before" in heldout:
        heldout = {next(iter(runs)): heldout}
    used = [(name, [k for k in keys if any(curve(h, k)[0] for h in runs.values())]) for name, keys in panels]
    used = [(name, keys) for name, keys in used if keys]
    if heldout:
        used.insert(0, ("", ["heldout"]))
    if not used:
        used = [("no metrics logged", [])]
    rows = -(-len(used) // columns)
    fig = Figure(figsize=(5.0 * columns, 2.8 * rows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, (name, keys) in zip(axes, used, strict=False):
        if keys == ["heldout"]:
            _accuracy_panel(ax, heldout)  # type: ignore[arg-type]
        else:
            _draw_curves(ax, name, keys, runs)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[len(used) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=12)
    guide = reading_guide({k for _, keys in used for k in keys})
    # room under the panels for the caption: its lines (wrapped ones counted) at 7 pt, 1.4 line spacing
    lines = sum(-(-len(line) // CAPTION_CHARS_PER_LINE) for line in guide.splitlines()) if guide else 0
    bottom = min((lines * 7 * 1.4 / 72 + 0.1) / fig.get_figheight(), 0.5)
    fig.get_layout_engine().set(rect=(0, bottom, 1, 1 - bottom))
    if guide:
        fig.text(0.5, 0.005, guide, ha="center", va="bottom", fontsize=7, wrap=True)
    if path is None:
        return fig
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    return target


def _run_steps(history: History) -> list[float]:
    """Every optimizer step at which the run logged anything."""
    return sorted({float(row.get("step", i + 1)) for i, row in enumerate(history) if isinstance(row, Mapping)})


def _is_sparse(steps: Sequence[float], run_steps: Sequence[float]) -> bool:
    """Whether a metric skipped logged steps between its first and last point: a line through its points would
    draw values that were never measured, so it gets markers only."""
    inside = [s for s in run_steps if steps[0] <= s <= steps[-1]]
    return len(steps) < len(inside)


def measured_at(steps: Sequence[float], run_steps: Sequence[float]) -> str:
    """"3 of 16 steps" for a metric logged at some optimizer steps only: out of the steps the run trained (>= 1),
    since a run's log also holds a step-0 row (the held-out accuracy before training), which is no optimizer step;
    a metric that has a step-0 value too says so."""
    trained = [s for s in run_steps if s >= 1]
    at = [s for s in steps if s >= 1]
    before = " and before training" if len(at) < len(steps) else ""
    return f"{len(at)} of {len(trained)} steps{before}"


def _draw_curves(ax: Any, name: str, keys: Sequence[str], runs: Mapping[str, History]) -> None:
    from matplotlib.ticker import MaxNLocator

    floored = any(k in LOG_FLOOR_KEYS for k in keys)
    below_floor: list[str] = []  # runs whose every value is float rounding: said, not drawn
    drawn = False
    # The panel spans the run's optimizer steps (a log's step-0 row, the accuracy before training, is none), and
    # step 0 too when this panel draws a value there.
    all_steps = {s for history in runs.values() for s in _run_steps(history) if s >= 1}
    for run_index, (run, history) in enumerate(runs.items()):
        run_steps = _run_steps(history)
        for key_index, key in enumerate(_keys_to_draw(history, keys)):
            steps, values = curve(history, key)
            if not steps:
                continue
            all_steps.update(steps)
            label = " ".join(p for p in (run, key.split("/")[-1] if len(keys) > 1 else "") if p)
            look = run_style(run_index)
            # a key's line style, shifted per run: two runs' equal values draw a dashed line over a solid one
            linestyle = RUN_STYLES[(key_index + run_index) % len(RUN_STYLES)]
            if tuple(keys) == REWARD_KEYS:
                ax.plot(steps, values, linestyle="none", alpha=0.45, **{**look, "markersize": look["markersize"] - 1})
                ax.plot(steps, ema(values, alpha=EMA_ALPHA), color=look["color"], linestyle=linestyle,
                        label=f"{run} EMA {EMA_ALPHA}".strip())  # fmt: skip
                continue
            if floored and max(values) <= RESIDUAL_FLOOR:
                # A flat line on the floor says nothing a sentence cannot: the condition holds at every step.
                below_floor.append(f"{label + ': ' if label else ''}all {len(values)} logged steps <= "
                                   f"{RESIDUAL_FLOOR:g} (max {max(values):.1g}): float rounding")
                continue
            if floored:
                values = [max(v, RESIDUAL_FLOOR) for v in values]
            drawn = True
            sparse = _is_sparse(steps, run_steps)
            if sparse:
                label = f"{label + ', ' if label else ''}{measured_at(steps, run_steps)}"
            if not sparse and len(steps) >= 30 and len(runs) == 1:
                look = {"color": look["color"], "marker": None}  # one run's long line: markers would only clutter
            ax.plot(steps, values, linestyle="none" if sparse else linestyle, label=label or None, **look)
    if floored:
        if not drawn:  # limits first: a log axis holding only the floor line has no range to scale
            ax.set_ylim(RESIDUAL_FLOOR / 2, RESIDUAL_FLOOR * 100)
        ax.set_yscale("log")
        ax.axhline(RESIDUAL_FLOOR, color="0.5", linewidth=0.8, linestyle=":")
        if drawn:
            ax.set_ylim(bottom=RESIDUAL_FLOOR / 2)
        if below_floor and drawn:  # beside other runs' curves: a legend entry, placed where no curve is
            for text in below_floor:
                ax.plot([], [], linestyle="none", label=text)
        elif below_floor:
            ax.text(0.5, 0.55, "\n".join(below_floor), transform=ax.transAxes, ha="center", va="center",
                    fontsize=8, color="0.2", wrap=True)  # fmt: skip
        ax.annotate(
            f"<= {RESIDUAL_FLOOR:g}: float rounding", (0.01, 0.02), xycoords="axes fraction", fontsize=7, color="0.4"
        )
    if any(k in UNIT_RANGE_KEYS for k in keys):
        ax.set_ylim(-0.02, 1.02)
    if all_steps:
        ax.set_xlim(min(all_steps) - 0.5, max(all_steps) + 0.5)  # every panel spans the run: gaps show as gaps
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also in a 4-step run
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("optimizer step", fontsize=8)
