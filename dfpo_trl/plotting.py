"""PNG of the training curves: reward, entropy and DFPO's mechanism metrics over optimizer steps.

Reads ``trainer.state.log_history`` (a list of logged dicts). Uses matplotlib's object API with the Agg canvas,
so it never touches pyplot's global backend (safe in notebooks, servers and CI).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PANELS", "curve", "plot_metrics"]

# One panel per entry: title and the logged keys drawn in it (a panel with no logged key is left out).
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("training reward (mean)", ("reward",)),
    ("entropy", ("entropy",)),
    ("Asym (eq. 23)", ("asym/before", "asym/after")),
    ("phi = s~ / s_bar", ("transform/phi_min", "transform/phi_mean")),
    ("orthogonality residual |sum s~ A|", ("transform/orth_residual",)),
    ("shared-prefix residual (0 = cancels)", ("cancellation/shared_prefix_residual",)),
    ("DelTA lambda", ("delta/lambda_pos_mean", "delta/lambda_neg_mean")),
    ("completion length", ("completions/mean_length",)),
)

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


def plot_metrics(
    histories: History | Mapping[str, History],
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
    panels: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PANELS,
    columns: int = 2,
) -> Any:
    """Plot one run's log history, or several (``{"GSPO": history, "DFPO": history}``) overlaid per panel.

    Writes a PNG to ``path`` when given and returns the path; otherwise returns the matplotlib ``Figure``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs: dict[str, History] = dict(histories) if isinstance(histories, Mapping) else {"": histories}
    used = [(name, [k for k in keys if any(curve(h, k)[0] for h in runs.values())]) for name, keys in panels]
    used = [(name, keys) for name, keys in used if keys]
    if not used:
        used = [("no metrics logged", [])]
    rows = -(-len(used) // columns)
    fig = Figure(figsize=(5.0 * columns, 2.8 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    styles = ("-", "--", ":", "-.")
    for ax, (name, keys) in zip(axes, used, strict=False):
        for run_index, (run, history) in enumerate(runs.items()):
            for key_index, key in enumerate(keys):
                steps, values = curve(history, key)
                if not steps:
                    continue
                label = " ".join(p for p in (run, key.split("/")[-1] if len(keys) > 1 else "") if p)
                ax.plot(
                    steps,
                    values,
                    linestyle=styles[key_index % len(styles)],
                    color=f"C{run_index}",
                    marker="o" if len(steps) < 30 else None,
                    markersize=3,
                    label=label or None,
                )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[len(used) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=12)
    if path is None:
        return fig
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    return target
