"""Write ``benchmarks/RESULTS.md`` and its figures from the benchmark JSONs (issue #5).

    python benchmarks/report.py                                   # benchmarks/results/*.json -> RESULTS.md
    python benchmarks/report.py --results-dir /tmp/smoke --out /tmp/smoke/RESULTS.md

Reads ``overhead.json`` (one model's result, or several keyed by model; ``overhead_*.json`` when it is
absent), ``learning.json`` + ``learning_curves.json`` and ``transforms_timing.json``; any of them may be
missing. Every number and every sentence is computed from those files: intervals are 95% Student-t intervals
over seeds (means) and Welch intervals (differences); a prediction "held" when the interval of the difference
excludes 0 in the predicted direction, "went the other way" when it excludes 0 in the other, and is "not
resolved" otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import METHODS  # noqa: E402

OVERHEAD_GOAL = 1.01
REGRESSION = 1.02
DELTA_GOAL = 1.03
POP_GOAL_MS = 1.0
PAPER_COMPUTE_RATIO = 0.91  # DFPO paper Table 2: compute to threshold relative to GSPO
TRANSFORMS = ("min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance")


# ------------------------------------------------------------------------------------------------ stats
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


def label(method: str) -> str:
    return METHODS[method].label if method in METHODS else method


# ---------------------------------------------------------------------------------------------- loading
def load(path: pathlib.Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def overhead_entries(results: pathlib.Path) -> list[dict[str, Any]]:
    data = load(results / "overhead.json")
    if data is None:
        parts = [load(p) for p in sorted(results.glob("overhead_*.json"))]
        return [p for p in parts if p]
    return [data] if "median_step_s" in data else list(data.values())


# ----------------------------------------------------------------------------------------------- overhead
def overhead_section(entries: list[dict[str, Any]]) -> list[str]:
    out = ["## 1. Overhead", ""]
    if not entries:
        return out + ["No overhead results yet (`benchmarks/overhead.py`).", ""]
    for e in entries:
        s = e.get("settings", {})
        out += [
            f"### {e['model']} ({e.get('model_params', 0) / 1e6:.0f}M parameters, {e.get('dtype', '?')}) on "
            f"{e['device']}",
            "",
            f"{e['steps']} timed optimizer steps per method after {s.get('warmup')} warm-up steps per phase, "
            f"{s.get('rounds')} interleaved rounds; {s.get('batch_size')} completions per micro-batch, G = "
            f"{s.get('num_generations')}, {s.get('steps_per_generation')} optimizer steps per generation (off-policy), "
            f"completions of {s.get('max_completion_length')} tokens"
            + (" (fixed length)" if s.get("fixed_length") else "")
            + f", gradient checkpointing {'on' if s.get('gradient_checkpointing') else 'off'}.",
            "",
            "| method | median step (s) | × GSPO [95% CI] | median training (s) | mean training × GSPO | "
            "generation call (s) | peak memory (GB) | goal |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m, step in e["median_step_s"].items():
            ratio = e["ratio_to_baseline"].get(m)
            ci = (e.get("ratio_interval_95") or {}).get(m)
            ratio_text = fmt(ratio) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and m != "gspo" else "")
            out.append(
                f"| {label(m)} | {fmt(step, 4)} | {ratio_text} | {fmt(e['median_training_s'].get(m), 4)} | "
                f"{fmt((e.get('ratio_mean_training_to_baseline') or {}).get(m))} | "
                f"{fmt((e.get('median_generation_s') or {}).get(m))} | {fmt(e['peak_mem_gb'].get(m), 2)} | "
                f"{goal_text(m, ratio)} |"
            )
        out += ["", *overhead_sentences(e), ""]
    return out


def goal_for(method: str) -> float | None:
    if method in TRANSFORMS or method in ("grpo_fix", "min_replace_score", "none_score", "dfpo_none"):
        return OVERHEAD_GOAL
    if method == "delta":
        return DELTA_GOAL
    return None


def goal_text(method: str, ratio: float | None) -> str:
    goal = goal_for(method)
    if goal is None or ratio is None:
        return "baseline" if method == "gspo" else "–"
    if ratio <= goal:
        return f"met (≤ {goal:.2f}×)"
    if goal == OVERHEAD_GOAL and ratio <= REGRESSION:
        return f"missed (≤ {REGRESSION:.2f}×, not a regression)"
    return f"**missed** (> {REGRESSION if goal == OVERHEAD_GOAL else goal:.2f}×)"


def overhead_sentences(e: dict[str, Any]) -> list[str]:
    met, missed, regressions, delta_missed = [], [], [], []
    for m, ratio in e["ratio_to_baseline"].items():
        goal = goal_for(m)
        if goal is None or ratio is None:
            continue
        ci = (e.get("ratio_interval_95") or {}).get(m)
        text = f"{label(m)} {ratio:.3f}×" + (f" (95% CI {ci[0]:.3f}–{ci[1]:.3f})" if ci else "")
        if ratio <= goal:
            met.append(text)
        elif goal != OVERHEAD_GOAL:
            delta_missed.append(text)
        elif ratio > REGRESSION:
            regressions.append(text)
        else:
            missed.append(text)
    lines = [
        f"Baseline: TRL's own `GRPOTrainer` with the GSPO settings, in the same process. On {e['device']}:"
    ]
    if met:
        lines.append(f"within the goal (≤ 1.01× GSPO, DelTA ≤ 1.03×): {'; '.join(met)}.")
    if missed:
        lines.append(f"Above the 1.01× goal but not beyond the 1.02× regression line: {'; '.join(missed)}.")
    if regressions:
        lines.append(f"Regressions by the issue's definition (> 1.02×): {'; '.join(regressions)}.")
    if delta_missed:
        lines.append(f"Above DelTA's 1.03× goal: {'; '.join(delta_missed)}.")
    unresolved = [
        label(m) for m, ci in (e.get("ratio_interval_95") or {}).items()
        if ci and goal_for(m) and ci[0] <= goal_for(m) < ci[1]
    ]
    if unresolved:
        lines.append(
            "For " + ", ".join(unresolved) + " the step-time interval straddles the goal: more timed steps would "
            "be needed to say on which side it lies."
        )
    gen = [v for v in (e.get("median_generation_s") or {}).values() if v]
    step = e["median_step_s"].get("gspo")
    if gen and step:
        g, spg = statistics.median(gen), e["settings"].get("steps_per_generation", 1)
        lines.append(
            f"A generation call takes {g:.3f} s against a GSPO training step of {step:.4f} s, so sampling is about "
            f"{g / (g + spg * step):.0%} of the wall time of a rollout cycle ({spg} steps) here."
        )
    pop = e.get("positive_orth_proj_alone")
    if pop:
        verdict = "under" if pop["median_ms"] < POP_GOAL_MS else "over"
        lines.append(
            f"Positive Orth-Proj alone on {pop['groups']} groups × G = {pop['G']}: {pop['median_ms']:.3f} ms median "
            f"on {e['device']}, {verdict} the 1 ms goal."
        )
    return lines


def transforms_section(timing: dict[str, Any] | None) -> list[str]:
    out = ["### Transforms alone (`benchmarks/bench_transforms.py`)", ""]
    if not timing:
        return out + ["No `transforms_timing.json`.", ""]
    out += [
        f"{timing['groups']} groups × G = {timing['G']}, {timing['dtype']}, on {timing['device_name']} "
        f"(torch {timing['torch']}).",
        "",
        "| transform | median (ms) | IQR (ms) |",
        "| --- | --- | --- |",
    ]
    for name, r in timing["results"].items():
        out.append(f"| {name} | {r['median_ms']:.4f} | {r['iqr_ms']:.4f} |")
    pop = timing["results"].get("positive_orth_proj")
    if pop:
        verdict = "under" if pop["median_ms"] < POP_GOAL_MS else "over"
        out += [
            "",
            f"Positive Orth-Proj: {pop['median_ms']:.3f} ms on {timing['device_name']}, {verdict} the 1 ms goal.",
        ]
    return out + [""]


# ----------------------------------------------------------------------------------------------- learning
# (metric key in learning.json, label, predicted direction of method - reference: -1 lower, +1 higher)
PREDICTIONS = [
    ("generations_to_threshold", "generations to threshold", -1),
    ("jitter2", "Jitter₂ of the reward curve", -1),
    ("final_accuracy", "final held-out greedy accuracy", +1),
    ("final_reward", "final sampled reward (last 3 generations)", +1),
    ("asym_after", "Asym (eq. 23)", -1),
    ("asym_reduction", "Asym removed by the transform (before − after, same steps)", +1),
    ("shared_prefix_residual", "shared-prefix residual", -1),
]


def censored(values: list[Any], budget: int) -> tuple[list[float], int]:
    """Generations to threshold with 'never' counted as budget + 1 (a lower bound), and how many were never."""
    never = sum(v is None for v in values)
    return [float(budget + 1) if v is None else float(v) for v in values], never


def metric_values(entry: dict[str, Any], key: str, budget: int) -> tuple[list[float], int]:
    if key == "generations_to_threshold":
        return censored(entry[key], budget)
    return clean(entry.get(key, [])), 0


def verdict(d: tuple[float, float, float] | None, direction: int) -> str:
    if d is None:
        return "not testable (fewer than 2 seeds on a side)"
    _, lo, hi = d
    if direction * lo > 0 and direction * hi > 0:
        return "held"
    if direction * lo < 0 and direction * hi < 0:
        return "went the other way"
    return "not resolved (the interval includes 0)"


BASELINE_TRAINERS = {
    "dfpo": "DFPOTrainer with no DFPO option (TRL's loss; group-granular batches and mechanism metrics like every "
    "other method)",
    "trl": "TRL's GRPOTrainer",
}


def learning_section(summary: dict[str, Any] | None, curves: dict[str, Any] | None, figures: list[str]) -> list[str]:
    out = ["## 2. Learning dynamics", ""]
    if not summary:
        return out + ["No learning results yet (`benchmarks/learning.py`).", ""]
    s, budget, methods = summary["settings"], summary["generations"], summary["methods"]
    out += [
        f"{summary['model']} on {', '.join(summary.get('devices', [summary['device']]))}, task: {summary['task']}. "
        f"lr {s['lr']}, G = {s['num_generations']}, {s['steps_per_generation']} optimizer steps per generation "
        f"(off-policy), {s['batch_size']} completions per micro-batch, completions ≤ {s['max_completion_length']} "
        f"tokens, temperature {s['temperature']}, β = {s['beta']}, {budget} generations per run (the same for every "
        f"method), master weights {s['dtype']}. Threshold: EMA ({summary['ema_alpha']}) of the sampled reward ≥ "
        f"{summary['threshold']}; generations to threshold are 1-based, and a run that never gets there counts as "
        f"{budget + 1} in means and differences (a lower bound). GSPO and GRPO ran through "
        f"{BASELINE_TRAINERS.get(s.get('baseline_trainer'), 'TRL GRPOTrainer')}. Held-out: greedy accuracy on "
        f"{s['heldout']} fixed "
        f"problems" + (" (the task has 100 distinct problems; the rest repeat them)." if s["heldout"] > 100 else "."),
        "",
        "Mean over seeds [95% t-interval]:",
        "",
        "| method | seeds | generations to threshold (reached) | Jitter₂ | final accuracy | final reward | "
        "final entropy | shared-prefix residual | Asym |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m, e in methods.items():
        gens, never = metric_values(e, "generations_to_threshold", budget)
        n = len(e["seeds"])
        out.append(
            f"| {label(m)} | {n} | {fmt_ci(mean_ci(gens), 1)} ({n - never}/{n}) | {fmt_ci(mean_ci(e['jitter2']))} | "
            f"{fmt_ci(mean_ci(e['final_accuracy']))} | {fmt_ci(mean_ci(e.get('final_reward', [])))} | "
            f"{fmt_ci(mean_ci(e['entropy_final']))} | {fmt_ci(mean_ci(e['shared_prefix_residual']))} | "
            f"{fmt_ci(mean_ci(e.get('asym_after', [])), 4)} |"
        )
    initial = clean([x for e in methods.values() for x in e.get("initial_accuracy", [])])
    if initial:
        out += ["", f"Held-out accuracy before training: {statistics.fmean(initial):.3f} (mean over runs)."]
    out += ["", *[f"![{f}]({f})" for f in figures], "", "### The paper's predictions here", ""]
    out += prediction_sentences(methods, budget)
    return out + [""]


CONTROLS = ("none_score", "dfpo_none")  # compared with GSPO, but no paper prediction is about them
MARKS = {"held": "✓", "went the other way": "✗", "not resolved": "·", "not testable": "–"}


def compare(methods: dict[str, Any], m: str, ref: str, key: str, direction: int, budget: int) -> dict[str, Any] | None:
    """One (method, reference, metric) comparison: means, Welch difference interval, verdict."""
    a, never_a = metric_values(methods[m], key, budget)
    b, never_b = metric_values(methods[ref], key, budget)
    if not a or not b:
        return None
    d = diff_ci(a, b)
    v = verdict(d, direction)
    return {
        "a": statistics.fmean(a), "b": statistics.fmean(b), "d": d, "verdict": v, "short": v.split(" (")[0],
        "ratio": statistics.fmean(a) / statistics.fmean(b) if statistics.fmean(b) else None,
        "never": (never_a, never_b),
    }


def diff_text(c: dict[str, Any], key: str) -> str:
    d = c["d"]
    text = f"{c['a']:.3g} vs {c['b']:.3g}"
    if key == "generations_to_threshold" and c["ratio"] is not None:
        text += f" ({c['ratio']:.2f}×)"
    if d is not None:
        text += f", difference {d[0]:+.3g} [{d[1]:+.3g}, {d[2]:+.3g}]"
    if any(c["never"]):
        text += f", never reached in {c['never'][0]} and {c['never'][1]} runs"
    return text


def prediction_sentences(methods: dict[str, Any], budget: int) -> list[str]:
    """A table of differences (method - reference) and one sentence per prediction, all from the numbers."""
    pairs = [
        (m, METHODS[m].reference) for m in methods
        if m in METHODS and METHODS[m].reference in methods and m not in CONTROLS
    ]
    if not pairs:
        return ["No method ran together with its reference, so no prediction can be tested."]
    results = {(m, key): compare(methods, m, ref, key, direction, budget)
               for m, ref in pairs for key, _, direction in PREDICTIONS}
    lines = [
        "Difference method − reference, mean [95% Welch interval]; ✓ the prediction held, ✗ it went the other "
        "way, · not resolved (the interval includes 0), – not testable (fewer than 2 seeds):",
        "",
        "| method vs reference | " + " | ".join(name for _, name, _ in PREDICTIONS) + " |",
        "| --- | " + " | ".join("---" for _ in PREDICTIONS) + " |",
    ]
    for m, ref in pairs:
        cells = []
        for key, _, _ in PREDICTIONS:
            c = results[(m, key)]
            if c is None:
                cells.append("n/a")
            elif c["d"] is None:
                cells.append(f"{MARKS[c['short']]} {c['a']:.3g} vs {c['b']:.3g}")
            else:
                cells.append(f"{MARKS[c['short']]} {c['d'][0]:+.3g} [{c['d'][1]:+.3g}, {c['d'][2]:+.3g}]")
        lines.append(f"| {label(m)} vs {label(ref)} | " + " | ".join(cells) + " |")
    lines += [""]
    wording = {
        "generations_to_threshold": f"Fewer generations to the threshold (paper, Table 2: {PAPER_COMPUTE_RATIO}× "
        "GSPO's compute)",
        "jitter2": "Lower Jitter₂ of the reward curve (eq. 20)",
        "final_accuracy": "Higher endpoint score, held-out greedy accuracy",
        "final_reward": "Higher endpoint score, sampled reward of the last 3 generations",
        "asym_after": "Lower Asym (eq. 23) than the reference",
        "asym_reduction": "The transform lowers Asym on the very steps it acts on (Asym before − after, which is 0 "
        "for the reference)",
        "shared_prefix_residual": "Less uncancelled gradient on shared tokens (shared-prefix residual, DESIGN.md §6)",
    }
    for key, _, _ in PREDICTIONS:
        groups: dict[str, list[str]] = {}
        for m, ref in pairs:
            c = results[(m, key)]
            if c is None:
                continue
            if c["short"] in ("held", "went the other way"):
                text = f"{label(m)} vs {label(ref)}: {diff_text(c, key)}"
            else:  # the numbers are in the table
                ratio = f" {c['ratio']:.2f}×" if key == "generations_to_threshold" and c["ratio"] else ""
                text = f"{label(m)}{ratio}"
            groups.setdefault(c["short"], []).append(text)
        if not groups:
            continue
        total = sum(len(v) for v in groups.values())
        parts = []
        for short, phrase in (("held", "held"), ("went the other way", "went the other way"),
                              ("not resolved", "not resolved, the interval includes 0,"),
                              ("not testable", "not testable, fewer than 2 seeds,")):
            if short in groups:
                parts.append(f"{phrase} in {len(groups[short])} of {total} ({'; '.join(groups[short])})")
        lines.append(f"- **{wording[key]}**: " + "; ".join(parts) + ".")
    lines.append(
        "- **Less gradient energy on frequent tokens (eq. 24)**: not measured; dfpo_trl has no "
        "`energy/freq_bucket_k` metric yet, so this prediction is untested here."
    )
    for control in CONTROLS:
        ref = METHODS[control].reference
        if control in methods and ref in methods:
            g = compare(methods, control, ref, "generations_to_threshold", -1, budget)
            ent = compare(methods, control, ref, "entropy_final", -1, budget)
            text = f"- Control, {label(control)} vs {label(ref)} (no transform, so no paper prediction): generations "
            text += f"to threshold {diff_text(g, 'generations_to_threshold')}" if g else "to threshold n/a"
            if ent:
                text += f"; final entropy {diff_text(ent, 'entropy_final')}"
            lines.append(text + ". Score-form transforms are judged against this control, not against GSPO.")
    incomplete = [
        f"{label(m)} seed {seed} ({done} generations)"
        for m, e in methods.items()
        for seed, done, ok in zip(e["seeds"], e.get("generations_done", []), e.get("complete", []), strict=False)
        if not ok
    ]
    if incomplete:
        lines.append(f"- Incomplete runs (stopped before the budget; included above): {', '.join(incomplete)}.")
    return lines


# ------------------------------------------------------------------------------------------------ figures
# (panel title, methods of the family, methods drawn for comparison only)
FAMILIES = [
    ("ratio form vs GSPO", ["min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance"], ["gspo"]),
    ("score form", ["none_score", "min_replace_score"], ["gspo"]),
    ("token level", ["grpo_fix", "delta"], ["grpo"]),
]


def plot_curves(curves: dict[str, Any], key: str, ylabel: str, path: pathlib.Path, threshold: float | None = None,
                dashed: str | None = None) -> bool:
    """Mean over seeds with a min–max band, one panel per comparison family; False if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = curves["methods"]
    def has(m: str) -> bool:
        return m in methods and any(clean(c) for c in methods[m].get(key, []))

    # A family's panel is drawn when one of its own methods has data; with none, one panel of what there is.
    panels = [(t, [m for m in extra + ms if has(m)]) for t, ms, extra in FAMILIES if any(has(m) for m in ms)]
    if not panels and any(has(m) for m in methods):
        panels = [("baselines", [m for m in methods if has(m)])]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, (title, ms) in zip(axes[0], panels, strict=True):
        for m in ms:
            color = None
            for k, style in ((key, "-"), (dashed, "--")):
                if not k or not methods[m].get(k):
                    continue
                rows = methods[m][k]
                width = max(len(r) for r in rows)
                arr = np.full((len(rows), width), np.nan)
                for i, r in enumerate(rows):
                    arr[i, : len(r)] = [np.nan if v is None else v for v in r]
                if np.all(np.isnan(arr)):
                    continue
                x = np.arange(1, width + 1)
                with np.errstate(all="ignore"):
                    import warnings

                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        mean, low, high = np.nanmean(arr, 0), np.nanmin(arr, 0), np.nanmax(arr, 0)
                if style == "-":
                    line = ax.plot(x, mean, style, label=f"{label(m)} (n={len(rows)})", lw=1.5)[0]
                    color = line.get_color()
                    ax.fill_between(x, low, high, color=color, alpha=0.15, lw=0)
                else:
                    ax.plot(x, mean, style, color=color, lw=0.9, alpha=0.8)
        if threshold is not None:
            ax.axhline(threshold, color="grey", lw=0.8, ls=":")
        ax.set_title(title)
        ax.set_xlabel("generation")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------- main
def zero3_section(result: dict[str, Any] | None) -> list[str]:
    """Issue #6's ZeRO-3 run (benchmarks/zero3.py): exactness against the single-process reference, step time."""
    if not result:
        return []
    steps = result.get("median_step_s", {})
    verdict = "match" if result["coefficients_match_reference"] else "do NOT match"
    lines = [
        "## 3. ZeRO-3, groups across processes and micro-steps (`benchmarks/zero3.py`)",
        "",
        f"{result['gpus']} × {result['device']}, DeepSpeed ZeRO-{result['zero_stage']}, layout "
        f"{', '.join(result['layout'])}: the per-sequence s̄ and s̃ every process used {verdict} the single-process "
        f"reference on the same generation batch (max abs difference {result['max_abs_diff']:.2g}, tolerance "
        f"{result['tolerance']:g}); losses finite: {result['loss_finite']}.",
        "",
        "| layout | median step (s) |",
        "| --- | --- |",
        *[f"| {name} ({result['layouts_timed'].get(name, name)}) | {v:.3f} |" for name, v in steps.items()],
        "",
    ]
    if "pre_pass_over_co_located" in result:
        lines += [
            f"Same generation batch and optimizer-step size: the pre-pass layout (micro-batches of half a group, "
            f"two micro-steps and one no-grad pre-pass forward per optimizer step) takes "
            f"{result['pre_pass_over_co_located']:.2f}× the step time of whole groups per micro-batch; medians over "
            f"steps 3–{result['steps']}, rollout steps included.",
            "",
        ]
    return lines


def notes_section(path: pathlib.Path) -> list[str]:
    """Hand-written notes on what was not run and how to read a metric (``results/NOTES.md``), appended as is."""
    return [path.read_text().rstrip(), ""] if path.exists() else []


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--out", default="benchmarks/RESULTS.md")
    p.add_argument("--fig-dir", help="default: <dir of --out>/figures")
    args = p.parse_args(argv)
    results, out = pathlib.Path(args.results_dir), pathlib.Path(args.out)
    fig_dir = pathlib.Path(args.fig_dir) if args.fig_dir else out.parent / "figures"
    summary, curves = load(results / "learning.json"), load(results / "learning_curves.json")
    figures: list[str] = []
    if curves:
        for name, key, ylabel, extra in (
            ("reward_curves.png", "reward", "sampled reward", {"threshold": curves.get("threshold")}),
            ("residual_curves.png", "residual", "shared-prefix residual", {}),
            ("asym_curves.png", "asym_after", "Asym (solid: after, dashed: before)", {"dashed": "asym_before"}),
            ("entropy_curves.png", "entropy", "entropy", {}),
        ):
            if plot_curves(curves, key, ylabel, fig_dir / name, **extra):
                figures.append(str((fig_dir / name).relative_to(out.parent)) if fig_dir.is_relative_to(out.parent)
                               else str(fig_dir / name))
    lines = [
        "# Benchmark results (issue #5)",
        "",
        "Generated by `benchmarks/report.py` from the JSON files in `benchmarks/results/`; how to rerun them is in "
        "`benchmarks/README.md`. The card's name is given with every measurement.",
        "",
        *overhead_section(overhead_entries(results)),
        *transforms_section(load(results / "transforms_timing.json")),
        *learning_section(summary, curves, figures),
        *zero3_section(load(results / "zero3.json")),
        *notes_section(results / "NOTES.md"),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {out}" + (f" and {len(figures)} figures in {fig_dir}" if figures else ""))


if __name__ == "__main__":
    main()
