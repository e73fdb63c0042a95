"""RESULTS.md's §5, the cancellation study: its tables, the bounds it resolved and its figures (called by
``benchmarks/dfpo_bench/reports/report.py``)."""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from dfpo_bench.lib.stats import clean

# ---------------------------------------------------------------------------------- the cancellation study
# (metric key in cancellation.json, column title, digits)
CANCELLATION_COLUMNS = [
    ("generations_to_threshold", "generations to threshold", 1),
    ("jitter2", "Jitter₂", 3),
    ("final_accuracy", "held-out accuracy", 3),
    ("entropy_final", "final entropy", 3),
    ("clip_fraction_off_policy", "clip fraction (off-policy)", 3),
    ("residual_off_policy", "residual (off-policy)", 3),
    ("residual_two_sided_off_policy", "residual, two-sided groups (off-policy)", 3),
    ("one_sided_groups_off_policy", "one-sided groups (off-policy)", 3),
]
GRADIENT_TARGET = ("min_replace_grad", "positive_orth_proj_grad", "min_replace_grad_zero")
EXACT = 0.01  # the cancellation study's bound for "exact" on the off-policy residuals


def stats_text(stats: dict[str, Any] | None, digits: int) -> str:
    if not stats:
        return "–"
    if stats["n"] < 2:
        return f"{stats['mean']:.{digits}f} (n=1)"
    return f"{stats['mean']:.{digits}f} [{stats['low']:.{digits}f}, {stats['high']:.{digits}f}]"


def difference_text(d: dict[str, Any] | None, digits: int) -> str:
    if not d:
        return "–"
    text = f"{d['difference']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"
    return f"**{text}**" if d["excludes_zero"] else text


def bound_sentence(task: dict[str, Any], key: str, methods: list[str], what: str) -> str | None:
    """Whether every seed of ``methods`` has ``key`` ≤ EXACT, with the worst seed's value; None if none ran."""
    parts, met = [], []
    for m in methods:
        e = task["methods"].get(m)
        values = clean((e or {}).get("values", {}).get(key, []))
        if not values:
            continue
        ok = max(values) <= EXACT
        met.append(ok)
        parts.append(f"{e['label']} {'met' if ok else 'not met'} (largest over {len(values)} seeds {max(values):.4f})")
    if not parts:
        return None
    verdict = "met by every one" if all(met) else "not met by every one" if not any(met) else "met by some"
    return f"- {what} ≤ {EXACT}: {verdict}: {'; '.join(parts)}."


def resolved_sentences(task: dict[str, Any], reference: str, said: list[str]) -> list[str]:
    """Per method against ``reference``: which metrics' differences resolved (interval excludes 0), which did not.
    ``said``: references already compared with, whose pair with ``reference`` is not repeated."""
    diffs = task.get(f"vs_{reference}") or {}
    ref_label = task["methods"][reference]["label"] if reference in task["methods"] else reference
    lines = []
    for m, by_key in diffs.items():
        if m in said:
            continue  # already said the other way round
        resolved = [f"{title} {d['difference']:+.3g} [{d['low']:+.3g}, {d['high']:+.3g}]"
                    + (" (every seed the same value: a zero-width interval)" if d.get("zero_width") else "")
                    for key, title, _ in CANCELLATION_COLUMNS if (d := by_key.get(key)) and d["excludes_zero"]]
        open_ = [title for key, title, _ in CANCELLATION_COLUMNS if (d := by_key.get(key)) and not d["excludes_zero"]]
        untestable = [title for key, title, _ in CANCELLATION_COLUMNS if by_key.get(key) is None]
        text = f"- {task['methods'][m]['label']} − {ref_label}: "
        if len(untestable) == len(CANCELLATION_COLUMNS):
            lines.append(text + "not testable (fewer than 2 seeds or no values).")
            continue
        text += (f"resolved (interval excludes 0): {'; '.join(resolved)}" if resolved else "nothing resolved")
        if open_:
            text += f"; not resolved (interval includes 0): {', '.join(open_)}"
        if untestable:
            text += f"; not testable (fewer than 2 seeds or no values): {', '.join(untestable)}"
        lines.append(text + ".")
    return lines


def plot_cancellation_bars(name: str, task: dict[str, Any], path: pathlib.Path) -> bool:
    """One panel per metric: each method's mean with its 95% t-interval, every seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(task["methods"])
    columns = [c for c in CANCELLATION_COLUMNS if any((task["methods"][m]["stats"] or {}).get(c[0]) for m in methods)]
    if not columns:
        return False
    ncols = 4
    nrows = -(-len(columns) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows), squeeze=False)
    for ax in axes.flat[len(columns):]:
        ax.axis("off")
    for ax, (key, title, _) in zip(axes.flat, columns, strict=False):
        for i, m in enumerate(methods):
            st = task["methods"][m]["stats"].get(key)
            if not st:
                continue
            ax.bar(i, st["mean"], color=f"C{i}", alpha=0.6)
            ax.errorbar(i, st["mean"], yerr=[[st["mean"] - st["low"]], [st["high"] - st["mean"]]], color="black",
                        capsize=3, lw=1)
            seeds = clean(task["methods"][m]["values"].get(key, []))
            ax.plot([i] * len(seeds), seeds, "k.", ms=3, alpha=0.6)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(methods)), [task["methods"][m]["label"] for m in methods], rotation=60, ha="right",
                      fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{name}: mean over seeds, 95% t-interval, dots = seeds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_cancellation_residuals(name: str, task: dict[str, Any], path: pathlib.Path) -> bool:
    """Per rollout, the residual on its off-policy steps (solid: all groups, dashed: two-sided groups), mean over
    seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for i, e in enumerate(task["methods"].values()):
        for key, style in (("residual_off_policy", "-"), ("residual_two_sided_off_policy", "--")):
            rows = e["curves"].get(key) or []
            if not rows or not any(clean(r) for r in rows):
                continue
            width = max(len(r) for r in rows)
            arr = np.full((len(rows), width), np.nan)
            for j, r in enumerate(rows):
                arr[j, : len(r)] = [np.nan if v is None else v for v in r]
            with np.errstate(all="ignore"):
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    mean = np.nanmean(arr, 0)
            ax.plot(np.arange(1, width + 1), mean, style, color=f"C{i}", lw=1.3 if style == "-" else 0.9,
                    label=e["label"] if style == "-" else None)
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.axhline(EXACT, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("generation")
    ax.set_ylabel("shared-prefix residual, off-policy steps")
    ax.set_title(f"{name} (solid: all groups; dashed: two-sided groups; dotted: {EXACT})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def cancellation_figures(
    study: dict[str, Any] | None, fig_dir: pathlib.Path, out: pathlib.Path
) -> dict[str, list[str]]:
    """Per task, the figures drawn (paths relative to ``out``'s directory where possible)."""
    figures: dict[str, list[str]] = {}
    for name, task in ((study or {}).get("tasks") or {}).items():
        for kind, plot in (("bars", plot_cancellation_bars), ("residual", plot_cancellation_residuals)):
            path = fig_dir / f"cancellation_{name}_{kind}.png"
            if plot(name, task, path):
                figures.setdefault(name, []).append(
                    str(path.relative_to(out.parent)) if path.is_relative_to(out.parent) else str(path))
    return figures


def cancellation_section(study: dict[str, Any] | None, figures: dict[str, list[str]], number: int) -> list[str]:
    """The cancellation study from ``cancellation.json``: tables, differences, what resolved, figures."""
    if not study:
        return []
    out = [
        f"## {number}. Cancellation in the gradient, not only in the weights "
        "(`benchmarks/dfpo_bench/studies/learning.py --study cancellation`)",
        "",
        f"{study['model']} on {', '.join(study['devices'])}. Per task, every method's runs (one per seed, same "
        f"settings); intervals: {study['interval']}. Off-policy steps are the optimizer steps after the first of "
        "each rollout (the first is on-policy: every s = 1, nothing clipped). A difference in **bold** has an "
        "interval that excludes 0 (resolved); the others are not resolved. Generations to threshold count a run "
        "that never reached it as generations + 1 (a lower bound).",
        "",
    ]
    for name, task in study["tasks"].items():
        s = task["settings"]
        methods = task["methods"]
        seeds = sorted({len(e["seeds"]) for e in methods.values()})
        initial = clean([x for e in methods.values() for x in e["values"].get("initial_accuracy", [])])
        out += [
            f"### {task['description']}",
            "",
            f"{'–'.join(map(str, seeds))} seeds per method; lr {s['lr']}, G = {s['num_generations']}, "
            f"{s['steps_per_generation']} optimizer steps per rollout, {s['batch_size']} completions per micro-batch, "
            f"completions ≤ {s['max_completion_length']} tokens, {s['generations']} rollouts per run; threshold: EMA "
            f"({study['ema_alpha']}) of the sampled reward ≥ {study['threshold']}; held-out: greedy accuracy on "
            f"{s['heldout']} fixed problems"
            + (f" ({statistics.fmean(initial):.3f} before training)." if initial else "."),
            "",
            "| method | seeds | " + " | ".join(t for _, t, _ in CANCELLATION_COLUMNS) + " |",
            "| --- | --- | " + " | ".join("---" for _ in CANCELLATION_COLUMNS) + " |",
        ]
        for e in methods.values():
            reached = sum(v is not None for v in e["values"]["generations_to_threshold"])
            cells = [stats_text(e["stats"].get(k), d) for k, _, d in CANCELLATION_COLUMNS]
            cells[0] += f" ({reached}/{len(e['seeds'])} reached)"
            out.append(f"| {e['label']} | {len(e['seeds'])} | " + " | ".join(cells) + " |")
        incomplete = [f"{e['label']} seed {seed}" for e in methods.values()
                      for seed, ok in zip(e["seeds"], e["complete"], strict=False) if not ok]
        missing = sorted({f"{e['label']} ({', '.join(f)})" for e in methods.values() for f in e["missing_fields"] if f})
        if incomplete:
            out += ["", f"Stopped before the budget (included above): {', '.join(incomplete)}."]
        if missing:
            out += ["", f"**Ran without config fields this dfpo_trl lacked**, so not the method named: "
                    f"{'; '.join(missing)}."]
        for reference in study.get("references", []):
            diffs = task.get(f"vs_{reference}")
            if not diffs:
                continue
            ref_label = methods[reference]["label"]
            out += [
                "",
                f"Difference to {ref_label}, mean [95% Welch interval]:",
                "",
                "| method − " + ref_label + " | " + " | ".join(t for _, t, _ in CANCELLATION_COLUMNS) + " |",
                "| --- | " + " | ".join("---" for _ in CANCELLATION_COLUMNS) + " |",
            ]
            for m, by_key in diffs.items():
                out.append(f"| {methods[m]['label']} | "
                           + " | ".join(difference_text(by_key.get(k), d) for k, _, d in CANCELLATION_COLUMNS) + " |")
        out += ["", "What resolved:", ""]
        references = study.get("references", [])
        for i, reference in enumerate(references):
            if task.get(f"vs_{reference}"):
                out += resolved_sentences(task, reference, references[:i])
        gradient = [m for m in GRADIENT_TARGET if m in methods]
        checks = [
            bound_sentence(task, "residual_two_sided_off_policy", gradient,
                           "The study's bound, two-sided residual on off-policy steps with `cancellation_target="
                           "\"gradient\"`, every seed"),
            bound_sentence(task, "residual_off_policy", [m for m in gradient if m.endswith("_zero")],
                           "The study's bound, overall residual on off-policy steps with one-sided `\"zero\"`, every "
                           "seed"),
        ]
        out += [c for c in checks if c]
        out += ["", *[f"![{f}]({f})" for f in figures.get(name, [])], ""]
    return out
