"""RESULTS.md's learning sections (§2, §3): the learning runs' tables, the paper's predictions read from them and
the curves' figures (called by ``benchmarks/dfpo_bench/reports/report.py``)."""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from dfpo_bench.lib.stats import clean, diff_ci, fmt_ci, mean_ci
from dfpo_bench.lib.trainers import GSPO, METHODS, label

# ----------------------------------------------------------------------------------------------- learning
PAPER_COMPUTE_RATIO = 0.91  # DFPO paper Table 2: compute to threshold relative to GSPO
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
ENERGY = ("energy_frequent", "energy on frequent tokens (eq. 24)", -1)
# The token-sum rerun (results/dapo/): the predictions the brief of that run names, eq. 24 included.
DAPO_PREDICTIONS = [PREDICTIONS[0], PREDICTIONS[1], PREDICTIONS[2], PREDICTIONS[6], ENERGY]
WORDING = {
    "generations_to_threshold": f"Fewer generations to the threshold (paper, Table 2: {PAPER_COMPUTE_RATIO}× "
    "GSPO's compute)",
    "jitter2": "Lower Jitter₂ of the reward curve (eq. 20)",
    "final_accuracy": "Higher endpoint score, held-out greedy accuracy",
    "final_reward": "Higher endpoint score, sampled reward of the last 3 generations",
    "asym_after": "Lower Asym (eq. 23) than the reference",
    "asym_reduction": "The transform lowers Asym on the very steps it acts on (Asym before − after, which is 0 "
    "for the reference)",
    "shared_prefix_residual": "Less uncancelled gradient on shared tokens (shared-prefix residual, "
    "docs/source/concepts/metrics.md)",
    "energy_frequent": "Less gradient energy on frequent tokens (eq. 24; share of the per-token LM-head gradient "
    "norm on the most frequent bucket of token occurrences)",
}


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


def has_metric(methods: dict[str, Any], key: str) -> bool:
    return any(clean(e.get(key, [])) for e in methods.values())


def bucket_share(k: int) -> str:
    """'quarter' for k = 4: the slice of the token occurrences that bucket 0 holds."""
    return {2: "half", 3: "third", 4: "quarter", 5: "fifth", 10: "tenth"}.get(k, f"1/{k}")


def settings_text(summary: dict[str, Any]) -> str:
    """The learning runs' setup, in one paragraph, from ``learning.json``'s settings."""
    s, budget = summary["settings"], summary["generations"]
    baselines = [m for m in ("gspo", "grpo") if m in summary["methods"]]
    return (
        f"{summary['model']} on {', '.join(summary.get('devices', [summary['device']]))}, task: {summary['task']}. "
        f"lr {s['lr']}, G = {s['num_generations']}, {s['steps_per_generation']} optimizer steps per generation "
        f"(off-policy), {s['batch_size']} completions per micro-batch, completions ≤ {s['max_completion_length']} "
        f"tokens, temperature {s['temperature']}, β = {s['beta']}, {budget} generations per run (the same for every "
        f"method), master weights {s['dtype']}. Threshold: EMA ({summary['ema_alpha']}) of the sampled reward ≥ "
        f"{summary['threshold']}; generations to threshold are 1-based, and a run that never gets there counts as "
        f"{budget + 1} in means and differences (a lower bound). "
        + (f"{' and '.join(label(m) for m in baselines)} ran through "
           f"{BASELINE_TRAINERS.get(s.get('baseline_trainer'), 'TRL GRPOTrainer')}. " if baselines else "")
        + f"Held-out: greedy accuracy on {s['heldout']} fixed "
        f"problems" + (" (the task has 100 distinct problems; the rest repeat them)." if s["heldout"] > 100 else ".")
    )


# (column title, metric key, digits); "generations_to_threshold" gets the "(reached)" count
TABLE_COLUMNS = {
    "generations_to_threshold": ("generations to threshold (reached)", 1),
    "jitter2": ("Jitter₂", 3),
    "final_accuracy": ("final accuracy", 3),
    "final_reward": ("final reward", 3),
    "entropy_final": ("final entropy", 3),
    "shared_prefix_residual": ("shared-prefix residual", 3),
    "energy_frequent": ("energy on frequent tokens (eq. 24)", 3),
    "asym_after": ("Asym", 4),
}


def summary_table(methods: dict[str, Any], budget: int, keys: list[str]) -> list[str]:
    """Mean over seeds [95% t-interval] of each key, one row per method."""
    lines = [
        "| method | seeds | " + " | ".join(TABLE_COLUMNS[k][0] for k in keys) + " |",
        "| --- | --- | " + " | ".join("---" for _ in keys) + " |",
    ]
    for m, e in methods.items():
        n = len(e["seeds"])
        cells = []
        for k in keys:
            values, never = metric_values(e, k, budget)
            text = fmt_ci(mean_ci(values), TABLE_COLUMNS[k][1])
            cells.append(f"{text} ({n - never}/{n})" if k == "generations_to_threshold" else text)
        lines.append(f"| {label(m)} | {n} | " + " | ".join(cells) + " |")
    return lines


def learning_section(summary: dict[str, Any] | None, curves: dict[str, Any] | None, figures: list[str],
                     energy_elsewhere: str | None = None) -> list[str]:
    """``energy_elsewhere``: where eq. 24 was measured instead (e.g. "§3, a rerun of ..."), when these runs did
    not log it."""
    out = ["## 2. Learning dynamics", ""]
    if not summary:
        return out + ["No learning results yet (`benchmarks/dfpo_bench/studies/learning.py`).", ""]
    budget, methods = summary["generations"], summary["methods"]
    energy = has_metric(methods, ENERGY[0])
    keys = ["generations_to_threshold", "jitter2", "final_accuracy", "final_reward", "entropy_final",
            "shared_prefix_residual", *(["energy_frequent"] if energy else []), "asym_after"]
    out += [settings_text(summary), "", "Mean over seeds [95% t-interval]:", "", *summary_table(methods, budget, keys)]
    initial = clean([x for e in methods.values() for x in e.get("initial_accuracy", [])])
    if initial:
        out += ["", f"Held-out accuracy before training: {statistics.fmean(initial):.3f} (mean over runs)."]
    out += ["", *[f"![{f}]({f})" for f in figures], "", "### The paper's predictions here", ""]
    if energy:
        out += prediction_sentences(methods, budget, [*PREDICTIONS, ENERGY])
    else:
        where = f"; it is measured in {energy_elsewhere}" if energy_elsewhere else ""
        out += prediction_sentences(methods, budget, PREDICTIONS, energy_line=(
            "- **Less gradient energy on frequent tokens (eq. 24)**: not measured in these runs: the energy metric "
            f"(`energy/freq_bucket_k`, `DFPOConfig.log_energy_buckets`) was not logged{where}."
        ))
    return out + [""]


def dapo_section(summary: dict[str, Any] | None, main: dict[str, Any] | None, figures: list[str],
                 number: int, notes: int | None = None) -> list[str]:
    """The rerun in ``results/dapo/``: sequence-level methods with a token-sum loss and the eq. 24 metric."""
    if not summary:
        return []
    s, budget, methods = summary["settings"], summary["generations"], summary["methods"]
    loss = s.get("sequence_loss_type") or "grpo"
    k = int(s.get("energy_buckets") or 0)
    title = f"## {number}. Sequence-level methods with " + (
        f"a token-sum loss (`loss_type=\"{loss}\"`)" if loss != "grpo" else f"`loss_type=\"{loss}\"`")
    out = [title + (" and gradient energy (eq. 24)" if k else ""), ""]
    ref_names = sorted({r for r in (summary.get("reference") or {}).values() if r})
    out.append(
        settings_text(summary) + f" GSPO and the sequence-level transforms use `loss_type=\"{loss}\"`"
        + (" (token-sum aggregation: every token of every completion carries the same weight, where "
           "`loss_type=\"grpo\"` first averages over each completion's tokens)" if loss != "grpo" else "")
        + (f"; the reference of every transform here is {', '.join(label(r) for r in ref_names)}" if ref_names
           else "")
        + "."
    )
    if main:
        ms, keys = main["settings"], sorted(set(main["settings"]) | set(s))
        main_loss = ms.get("sequence_loss_type") or GSPO["loss_type"]
        diffs = [f"`{key}` {s.get(key, 'not set')} (§2: {ms.get(key, 'not set')}"
                 + (f", so `loss_type=\"{main_loss}\"`" if key == "sequence_loss_type" and key not in ms else "")
                 + ")" for key in keys if s.get(key) != ms.get(key)]
        dev, main_dev = summary.get("devices", [summary["device"]]), main.get("devices", [main["device"]])
        if dev != main_dev:
            diffs.append(f"card {', '.join(dev)} (§2: {', '.join(main_dev)})")
        for key in ("model", "task", "generations", "threshold", "ema_alpha"):
            if summary.get(key) != main.get(key):
                diffs.append(f"{key} {summary.get(key)} (§2: {main.get(key)})")
        if diffs:
            out += ["", "Against §2's runs the settings differ only in: " + "; ".join(diffs) + "."]
    if k:
        out += [
            "",
            f"Energy on frequent tokens (eq. 24): per logged step, the share of the exact per-token LM-head "
            f"gradient norm (|c_t|·‖h_t‖·‖e_y − p_t‖/τ) that falls on the most frequent {bucket_share(k)} of the "
            f"micro-batch's loss-token occurrences (`energy/freq_bucket_0` of {k} buckets), averaged over the "
            f"run's steps. Since an id is never split between buckets, bucket 0 holds at least {1 / k:.2f} of the "
            f"tokens (more when its last id is frequent), so a value below {1 / k:.2f} means the most frequent "
            "tokens get less than their share of the gradient norm. Lower is the paper's prediction for a transform.",
        ]
    keys = ["generations_to_threshold", "jitter2", "final_accuracy", "entropy_final", "shared_prefix_residual",
            *(["energy_frequent"] if has_metric(methods, ENERGY[0]) else []), "asym_after"]
    out += ["", "Mean over seeds [95% t-interval]:", "", *summary_table(methods, budget, keys)]
    facts = []
    if k and has_metric(methods, ENERGY[0]):
        means = {m: statistics.fmean(clean(e["energy_frequent"])) for m, e in methods.items()
                 if clean(e.get("energy_frequent", []))}
        runs = [x for e in methods.values() for x in clean(e.get("energy_frequent", []))]
        low, high = min(means, key=means.get), max(means, key=means.get)
        side = ("below" if max(runs) < 1 / k else "above" if min(runs) > 1 / k else "on both sides of")
        facts.append(
            f"Energy on frequent tokens: the most frequent {bucket_share(k)} of the token occurrences carries "
            f"{means[low]:.3f} ({label(low)}) to {means[high]:.3f} ({label(high)}) of the gradient norm on average, "
            f"every one of the {len(runs)} runs {side} {1 / k:.2f}, the least token share bucket 0 can have "
            f"(run means {min(runs):.3f}–"
            f"{max(runs):.3f})."
        )
    if main:
        both = [m for m in methods if m in main["methods"]]
        pairs = []
        for m in both:
            a, b = mean_ci(methods[m].get("shared_prefix_residual", [])), mean_ci(
                main["methods"][m].get("shared_prefix_residual", []))
            if a and b:
                pairs.append(f"{label(m)} {a[0]:.3f} vs {b[0]:.3f}")
        if pairs:
            facts.append(
                f"Shared-prefix residual with `loss_type=\"{loss}\"` here vs §2's `loss_type=\""
                f"{main['settings'].get('sequence_loss_type') or GSPO['loss_type']}\"` (different runs"
                + (", different cards" if summary.get("devices") != main.get("devices") else "")
                + f"): {'; '.join(pairs)}."
            )
    if notes is not None:
        facts.append(f"How to read the shared-prefix residual under each loss type: §{notes}.")
    for fact in facts:
        out += ["", fact]
    out += ["", *[f"![{f}]({f})" for f in figures]]
    if figures:
        out += ["", "Figures: mean over seeds per generation, shaded from the lowest to the highest seed"
                + (f"; in the energy figure the dotted line is {1 / k:.2f}, the least share of the tokens bucket 0 "
                   "holds" if k and any("energy" in f for f in figures) else "") + "."]
    out += ["", f"### The paper's predictions with `loss_type=\"{loss}\"`", ""]
    predictions = [x for x in DAPO_PREDICTIONS if x != ENERGY or has_metric(methods, ENERGY[0])]
    out += prediction_sentences(methods, budget, predictions, references=summary.get("reference"))
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


def prediction_sentences(methods: dict[str, Any], budget: int,
                         predictions: list[tuple[str, str, int]] | None = None,
                         references: dict[str, str | None] | None = None,
                         energy_line: str | None = None) -> list[str]:
    """A table of differences (method - reference) and one sentence per prediction, all from the numbers.

    ``references``: method -> reference as the results file records it (default: ``METHODS``' references);
    ``energy_line``: a line to put after the predictions (what to say about eq. 24 where it was not measured)."""
    predictions = PREDICTIONS if predictions is None else predictions

    def reference(m: str) -> str | None:
        if references and m in references:
            return references[m]
        return METHODS[m].reference if m in METHODS else None

    pairs = [(m, reference(m)) for m in methods if reference(m) in methods and m not in CONTROLS]
    if not pairs:
        return ["No method ran together with its reference, so no prediction can be tested."]
    results = {(m, key): compare(methods, m, ref, key, direction, budget)
               for m, ref in pairs for key, _, direction in predictions}
    lines = [
        "Difference method − reference, mean [95% Welch interval]; ✓ the prediction held, ✗ it went the other "
        "way, · not resolved (the interval includes 0), – not testable (fewer than 2 seeds):",
        "",
        "| method vs reference | " + " | ".join(name for _, name, _ in predictions) + " |",
        "| --- | " + " | ".join("---" for _ in predictions) + " |",
    ]
    for m, ref in pairs:
        cells = []
        for key, _, _ in predictions:
            c = results[(m, key)]
            if c is None:
                cells.append("n/a")
            elif c["d"] is None:
                cells.append(f"{MARKS[c['short']]} {c['a']:.3g} vs {c['b']:.3g}")
            else:
                cells.append(f"{MARKS[c['short']]} {c['d'][0]:+.3g} [{c['d'][1]:+.3g}, {c['d'][2]:+.3g}]")
        lines.append(f"| {label(m)} vs {label(ref)} | " + " | ".join(cells) + " |")
    lines += [""]
    for key, _, _ in predictions:
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
        lines.append(f"- **{WORDING[key]}**: " + "; ".join(parts) + ".")
    if energy_line:
        lines.append(energy_line)
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
