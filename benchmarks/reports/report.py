"""Write ``benchmarks/RESULTS.md`` and its figures from the benchmark JSONs.

    python benchmarks/reports/report.py                                   # benchmarks/results/*.json -> RESULTS.md
    python benchmarks/reports/report.py --results-dir /tmp/smoke --out /tmp/smoke/RESULTS.md

Reads ``overhead.json`` (one model's result, or several keyed by model; ``overhead_*.json`` when it is
absent), ``learning.json`` + ``learning_curves.json``, ``dapo/learning.json`` + ``dapo/learning_curves.json``
(the sequence-level methods rerun with ``loss_type="dapo"`` and the eq. 24 energy metric), ``transforms_timing.json``,
``zero3.json`` and ``NOTES.md``; any of them may be missing. Every number and every sentence is computed from
those files: intervals are 95% Student-t intervals over seeds (means) and Welch intervals (differences); a
prediction "held" when the interval of the difference excludes 0 in the predicted direction, "went the other
way" when it excludes 0 in the other, and is "not resolved" otherwise. Overhead goals are judged on the median
of the optimizer steps with no rollout in them, with its bootstrap interval, where the file has it
(``median_train_only_step_s``), else on the median step.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import load_json  # noqa: E402
from benchmarks.lib.stats import clean, diff_ci, fmt, fmt_ci, mean_ci  # noqa: E402
from benchmarks.lib.trainers import GSPO, METHODS  # noqa: E402
from benchmarks.reports import report_launch_shape, report_long_run, report_study_v2, report_users_size  # noqa: E402

OVERHEAD_GOAL = 1.01
REGRESSION = 1.02
DELTA_GOAL = 1.03
POP_GOAL_MS = 1.0
PAPER_COMPUTE_RATIO = 0.91  # DFPO paper Table 2: compute to threshold relative to GSPO
TRANSFORMS = ("min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance")


def label(method: str) -> str:
    return METHODS[method].label if method in METHODS else method


# ---------------------------------------------------------------------------------------------- loading
def overhead_entries(results: pathlib.Path) -> list[dict[str, Any]]:
    data = load_json(results / "overhead.json")
    if data is None:
        parts = [load_json(p) for p in sorted(results.glob("overhead_*.json"))]
        return [p for p in parts if p]
    return [data] if "median_step_s" in data else list(data.values())


# ----------------------------------------------------------------------------------------------- overhead
def judged(e: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(ratio to GSPO, 95% interval, no_rollout) the goals are judged on: the median of the optimizer steps with
    no rollout in them where the file has it (forward, backward and optimizer only), else the median step."""
    ratios = e.get("ratio_train_only_to_baseline") or {}
    if any(v is not None for v in ratios.values()):
        return ratios, e.get("ratio_train_only_interval_95") or {}, True
    return e["ratio_to_baseline"], e.get("ratio_interval_95") or {}, False


def ratio_ci_text(ratio: float | None, ci: list[float] | None, method: str) -> str:
    return fmt(ratio) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and method != "gspo" else "")


def overhead_section(entries: list[dict[str, Any]]) -> list[str]:
    out = ["## 1. Overhead", ""]
    if not entries:
        return out + ["No overhead results yet (`benchmarks/cost/overhead.py`).", ""]
    for e in entries:
        s = e.get("settings", {})
        ratios, intervals, no_rollout = judged(e)
        train_steps = e.get("train_only_steps_per_method") or {}
        counts = sorted({v for v in train_steps.values() if v is not None})
        out += [
            f"### {e['model']} ({e.get('model_params', 0) / 1e6:.0f}M parameters, {e.get('dtype', '?')}) on "
            f"{e['device']}",
            "",
            f"{e['steps']} timed optimizer steps per method after {s.get('warmup')} warm-up steps per phase, "
            f"{s.get('rounds')} interleaved rounds; {s.get('batch_size')} completions per micro-batch, G = "
            f"{s.get('num_generations')}, {s.get('steps_per_generation')} optimizer steps per generation (off-policy), "
            f"completions of {s.get('max_completion_length')} tokens"
            + (" (fixed length)" if s.get("fixed_length") else "")
            + f", gradient checkpointing {'on' if s.get('gradient_checkpointing') else 'off'}"
            + (f", reward `{s['reward']}`" if s.get("reward") else "")
            + "."
            + (
                f" {'–'.join(map(str, counts))} of each method's timed steps contain no rollout (no sampling, no "
                "old-log-prob forward): the no-rollout columns are their median, its ratio to GSPO's and a 95% "
                "bootstrap interval, and the goal column judges that ratio."
                if no_rollout and counts else ""
            ),
            "",
        ]
        if no_rollout:
            out += [
                f"| method ({e['device']}) | median step (s) | × GSPO [95% CI] | median no-rollout step (s) | "
                "no-rollout × GSPO [95% CI] | median training (s) | mean training × GSPO | generation call (s) | "
                "peak memory (GB) | goal |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
        else:
            out += [
                f"| method ({e['device']}) | median step (s) | × GSPO [95% CI] | median training (s) | mean "
                "training × GSPO | generation call (s) | peak memory (GB) | goal |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
        for m, step in e["median_step_s"].items():
            ratio = e["ratio_to_baseline"].get(m)
            cells = [label(m), fmt(step, 4), ratio_ci_text(ratio, (e.get("ratio_interval_95") or {}).get(m), m)]
            if no_rollout:
                cells += [fmt((e.get("median_train_only_step_s") or {}).get(m), 4),
                          ratio_ci_text(ratios.get(m), intervals.get(m), m)]
            cells += [
                fmt(e["median_training_s"].get(m), 4), fmt((e.get("ratio_mean_training_to_baseline") or {}).get(m)),
                fmt((e.get("median_generation_s") or {}).get(m)), fmt(e["peak_mem_gb"].get(m), 2),
                goal_text(m, ratios.get(m)),
            ]
            out.append("| " + " | ".join(cells) + " |")
        first, *rest = overhead_sentences(e)
        out += ["", first, "", *[f"- {line}" for line in rest], ""]
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


def round_medians(e: dict[str, Any], method: str) -> list[float] | None:
    """Median step of each of the method's phases (one per round), from ``step_times_s``; None if not split-able."""
    times = (e.get("step_times_s") or {}).get(method)
    per = (e.get("settings") or {}).get("steps")
    if not times or not per or len(times) % per or len(times) // per < 2:
        return None
    return [statistics.median(times[i : i + per]) for i in range(0, len(times), per)]


def overhead_sentences(e: dict[str, Any]) -> list[str]:
    ratios, intervals, no_rollout = judged(e)
    device = e["device"]
    groups: dict[str, list[str]] = {}
    regressions = []
    for m, ratio in ratios.items():
        goal = goal_for(m)
        if goal is None or ratio is None:
            continue
        ci = intervals.get(m)
        text = f"{label(m)} {ratio:.3f}×" + (f" (95% CI {ci[0]:.3f}–{ci[1]:.3f})" if ci else "")
        if goal != OVERHEAD_GOAL:
            text += f" against its {goal:.2f}× goal"
        if ratio <= goal:
            key = "within, interval too" if ci is None or ci[1] <= goal else "within, interval above"
        else:
            key = "above, interval includes" if ci and ci[0] <= goal else (
                "above, interval above" if ci else "above, no interval")
        groups.setdefault(key, []).append(text)
        if goal == OVERHEAD_GOAL and ratio > REGRESSION:
            regressions.append(
                f"{label(m)} {ratio:.3f}×" + (
                    "" if not ci else " (its interval includes 1.02×, so not resolved)" if ci[0] <= REGRESSION
                    else " (its interval lies above 1.02×)"
                )
            )
    if no_rollout:
        n = sorted({v for v in (e.get("train_only_steps_per_method") or {}).values() if v is not None})
        basis = (f"the median of the optimizer steps that contain no rollout ({'–'.join(map(str, n))} per method: "
                 "forward, backward and optimizer only) and its 95% bootstrap interval")
    else:
        basis = "the median step time (all timed steps) and its 95% bootstrap interval"
    lines = [
        f"Baseline: TRL's own `GRPOTrainer` with the GSPO settings, in the same process. The goals (≤ "
        f"{OVERHEAD_GOAL:.2f}× GSPO, DelTA ≤ {DELTA_GOAL:.2f}×; > {REGRESSION:.2f}× is a regression) are judged on "
        f"{basis}, on {device}:"
    ]
    phrases = (
        ("within, interval too", "Within the goal, point estimate and whole interval"),
        ("within, interval above", "Point estimate within the goal, but the interval includes the goal (reaches "
         "above it), so meeting the goal is not resolved"),
        ("above, interval includes", "**Point estimate above the goal**; the interval includes the goal, so this is "
         "not resolved either way"),
        ("above, interval above", "**Above the goal, the whole interval too**"),
        ("above, no interval", "**Point estimate above the goal** (no interval in the file)"),
    )
    for key, phrase in phrases:
        if key in groups:
            lines.append(f"{phrase}: {'; '.join(groups[key])}.")
    if not any(k.startswith("above") for k in groups):
        lines.append("No method's point estimate is above its goal.")
    if regressions:
        lines.append(f"**Regressions by the goals' definition** (point estimate > {REGRESSION:.2f}× GSPO): "
                     f"{'; '.join(regressions)}.")
    faster = [f"{label(m)} {ratios[m]:.3f}× (95% CI {ci[0]:.3f}–{ci[1]:.3f})"
              for m, ci in intervals.items() if ci and m != "gspo" and ratios.get(m) is not None and ci[1] < 1]
    if faster:
        lines.append(
            f"Faster than GSPO with the whole interval below 1: {'; '.join(faster)}. None of them should do less "
            "work per step than GSPO (same model, same tensor shapes; the DFPO options add work), so read this as a "
            "difference between phases (each phase is its own trainer on its own model copy) that the bootstrap, "
            "which resamples steps, does not capture, not as a speed-up."
        )
    # Methods whose reference is not GSPO (token-level ones against GRPO): the same medians, ratio to that reference.
    key = "median_train_only_step_s" if no_rollout else "median_step_s"
    medians = e.get(key) or {}
    own = []
    for m, ref in (e.get("reference") or {}).items():
        if ref and ref != "gspo" and medians.get(m) and medians.get(ref):
            own.append(f"{label(m)} {medians[m] / medians[ref]:.3f}× {label(ref)}")
    if own:
        lines.append(
            f"Against their own reference (same gradient form), {'no-rollout' if no_rollout else 'step'} medians, "
            f"no interval: {'; '.join(own)}."
        )
    spread = [(m, r) for m in e["median_step_s"] if (r := round_medians(e, m))]
    if spread:
        m, r = max(spread, key=lambda x: (max(x[1]) - min(x[1])) / min(x[1]))
        rel = max(r) / min(r) - 1
        apart = max((abs(v - 1) for k, v in ratios.items() if v is not None and k != "gspo"), default=None)
        lines.append(
            f"Round to round the median step of one method moved by up to {rel:.0%} ({label(m)}: "
            f"{', '.join(f'{x:.4f}' for x in r)} s in its {len(r)} phases)"
            + (f", while the methods' {'no-rollout' if no_rollout else 'step'} medians differ from GSPO's by at "
               f"most {apart:.0%}" if apart is not None else "")
            + "; the intervals above resample steps, not phases, so they leave this variation out."
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
            f"on {device}, {verdict} the 1 ms goal."
        )
    return lines


def transforms_section(timing: dict[str, Any] | None) -> list[str]:
    out = ["### Transforms alone (`benchmarks/cost/bench_transforms.py`)", ""]
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


def loss_step_section(results: pathlib.Path) -> list[str]:
    """Loss + backward on one fixed batch against TRL's GRPOTrainer (benchmarks/cost/loss_step.py), every file."""
    files = sorted(results.glob("loss_step_*.json"))
    if not files:
        return []
    out = [
        "### Loss and backward on one fixed batch (`benchmarks/cost/loss_step.py`)",
        "",
        "Only `compute_loss` + `backward` of each method on the same model and the same off-policy batch, methods "
        "interleaved in shuffled rounds; ratio to TRL's `GRPOTrainer` (GSPO settings) taken within each round, "
        "median over rounds with its 95% bootstrap interval. This isolates what the methods add to a training step "
        "(no sampling, no optimizer), which whole-loop timings here cannot resolve.",
        "",
    ]
    for path in files:
        r = load_json(path)
        out += [
            f"**{r['model']}** ({r['dtype']}, {r['rows']} rows in groups of {r['group_size']}, completions up to "
            f"{r['completion_length']} tokens, gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}"
            f") on {r['device']}, {r['rounds']} rounds × {r['reps']} repetitions:",
            "",
            "| method | median loss + backward (ms) | ratio to TRL | 95% interval |",
            "| --- | --- | --- | --- |",
        ]
        for name, m in r["methods"].items():
            ratio, ci = m.get("ratio_to_trl"), m.get("ratio_interval_95")
            text = "TRL's `GRPOTrainer` (GSPO)" if name == r["baseline"] else f"{label(name)} (`{name}`)"
            out.append(f"| {text} | {1e3 * m['median_s']:.2f} | "
                       f"{fmt(ratio)} | {'[' + fmt(ci[0]) + ', ' + fmt(ci[1]) + ']' if ci else '–'} |")
        above = [n for n, m in r["methods"].items() if m.get("ratio_interval_95") and m["ratio_interval_95"][0] > 1]
        out += ["", (f"Intervals entirely above 1 (a resolved cost): {', '.join(above)}." if above
                     else "No interval lies entirely above 1.")
                + (" DFPOTrainer with DFPO off gave the same loss value as TRL's trainer."
                   if r.get("dfpo_none_loss_equals_trl") else ""), ""]
    return out


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
    "shared_prefix_residual": "Less uncancelled gradient on shared tokens (shared-prefix residual, docs/metrics.md)",
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
        return out + ["No learning results yet (`benchmarks/studies/learning.py`).", ""]
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
        "(`benchmarks/studies/learning.py --study cancellation`)",
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


# --------------------------------------------------------------------------------------------------- main
def zero3_section(result: dict[str, Any] | None, number: int = 3) -> list[str]:
    """The ZeRO-3 run (benchmarks/launch/zero3.py): exactness against the single-process reference, step time."""
    if not result:
        return []
    steps = result.get("median_step_s", {})
    verdict = "match" if result["coefficients_match_reference"] else "do NOT match"
    lines = [
        f"## {number}. ZeRO-3, groups across processes and micro-steps (`benchmarks/launch/zero3.py`)",
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


def notes_section(path: pathlib.Path, number: int | None = None) -> list[str]:
    """Hand-written notes on what was not run and how to read a metric (``results/NOTES.md``), appended as is,
    except that a numbered first heading (``## 4. ...``) takes ``number``, the sections before it being optional."""
    if not path.exists():
        return []
    lines = path.read_text().rstrip().splitlines()
    if number is not None and lines:
        lines[0] = re.sub(r"^## \d+\. ", f"## {number}. ", lines[0])
    return [*lines, ""]


def hand_section(path: pathlib.Path, number: int) -> list[str]:
    """A section written by hand from a benchmark's own files (its heading's number set to ``number``)."""
    if not path.exists():
        return []
    lines = path.read_text().rstrip().splitlines()
    lines[0] = re.sub(r"^## \d+\.", f"## {number}.", lines[0])
    return lines


def make_figures(curves: dict[str, Any] | None, specs: list[tuple[str, str, str, dict[str, Any]]],
                 fig_dir: pathlib.Path, out: pathlib.Path) -> list[str]:
    """Draw each (file name, curve key, y label, plot_curves options) that has data; paths relative to ``out``."""
    figures: list[str] = []
    if not curves:
        return figures
    for name, key, ylabel, extra in specs:
        if plot_curves(curves, key, ylabel, fig_dir / name, **extra):
            figures.append(str((fig_dir / name).relative_to(out.parent)) if fig_dir.is_relative_to(out.parent)
                           else str(fig_dir / name))
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--out", default="benchmarks/RESULTS.md")
    p.add_argument("--fig-dir", help="default: <dir of --out>/figures")
    args = p.parse_args(argv)
    results, out = pathlib.Path(args.results_dir), pathlib.Path(args.out)
    fig_dir = pathlib.Path(args.fig_dir) if args.fig_dir else out.parent / "figures"
    summary, curves = load_json(results / "learning.json"), load_json(results / "learning_curves.json")
    dapo = load_json(results / "dapo" / "learning.json")
    dapo_curves = load_json(results / "dapo" / "learning_curves.json")
    figures = make_figures(curves, [
        ("reward_curves.png", "reward", "sampled reward", {"threshold": (curves or {}).get("threshold")}),
        ("residual_curves.png", "residual", "shared-prefix residual", {}),
        ("asym_curves.png", "asym_after", "Asym (solid: after, dashed: before)", {"dashed": "asym_before"}),
        ("entropy_curves.png", "entropy", "entropy", {}),
    ], fig_dir, out)
    buckets = int(((dapo or {}).get("settings") or {}).get("energy_buckets") or 0)
    dapo_figures = make_figures(dapo_curves, [
        ("dapo_reward_curves.png", "reward", "sampled reward", {"threshold": (dapo_curves or {}).get("threshold")}),
        ("dapo_residual_curves.png", "residual", "shared-prefix residual", {}),
        ("dapo_energy_curves.png", "energy_frequent", "energy share of the most frequent bucket",
         {"threshold": 1 / buckets if buckets else None}),
    ], fig_dir, out)
    # Sections 1 and 2 are always there; the ones after them only when their files are.
    zero3, notes = load_json(results / "zero3.json"), results / "NOTES.md"
    study = load_json(results / "cancellation.json")
    study_figures = cancellation_figures(study, fig_dir, out)
    e2e, long_run = load_json(results / "vllm_e2e.json"), load_json(results / "long_run.json")
    number = 3 + bool(dapo) + bool(zero3) + bool(study)
    dapo_lines = dapo_section(dapo, summary, dapo_figures, 3, notes=number if notes.exists() else None)
    zero3_lines = zero3_section(zero3, 3 + bool(dapo_lines))
    energy_elsewhere = None
    if dapo_lines and has_metric(dapo["methods"], ENERGY[0]):
        loss = (dapo.get("settings") or {}).get("sequence_loss_type") or "grpo"
        energy_elsewhere = (f"§3, a rerun of {', '.join(label(m) for m in dapo['methods'])} with "
                            f"`loss_type=\"{loss}\"` and the metric on")

    long_run_figures = report_long_run.plot_long_run(long_run, fig_dir, out) if long_run else {}
    # After the notes: the hand-written layout section (its measurements are in results/layouts/), then vLLM's.
    layouts_lines = hand_section(results / "layouts" / "section.md", number + notes.exists())
    vllm_number = number + notes.exists() + bool(layouts_lines)
    e2e_lines = report_long_run.e2e_section(e2e, vllm_number)
    long_run_lines = report_long_run.long_run_section(long_run, long_run_figures, vllm_number + bool(e2e_lines),
                                                      report_long_run.read_records(results / "long_run"))
    shape_lines = report_launch_shape.launch_shape_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines))
    study_v2_lines = report_study_v2.study_v2_section(
        results, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines))
    users_size_lines = report_users_size.users_size_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines)
        + bool(study_v2_lines))
    lines = [
        "# Benchmark results",
        "",
        "Generated by `benchmarks/reports/report.py` from the JSON files in `benchmarks/results/`; how to rerun them "
        "is in `benchmarks/README.md`. The card's name is given with every measurement.",
        "",
        "**The end token of the GPU runs before 2026-11-27.** The GPU kit's conversion of SmolLM2-135M-Instruct "
        "(transformers 5.17) gave its tokenizer `<|im_start|>` (id 1) as the end token where the model's config says "
        "`<|im_end|>` (id 2), and TRL aligned the model's and the generation config's end token to it. Every "
        "SmolLM2 run in sections 1–9 ran so: completions ended (in TRL's completion mask and in `generate`) at "
        "`<|im_start|>` instead of `<|im_end|>`, and the drift meter scored `<|im_start|>` as the end of each "
        "answer form, which put its `drift/set_logp_mean` several nats too low. Timings are unaffected in kind; "
        "rewards, completion lengths and the drift meter's log-probabilities are from that setting. The embedded "
        "model of the CPU main job takes its end token from the model's config (`dfpo_trl/app/embedded.py`). "
        "Sections 10 and 11 ran with the corrected kit.",
        "",
        *overhead_section(overhead_entries(results)),
        *transforms_section(load_json(results / "transforms_timing.json")),
        *loss_step_section(results),
        *learning_section(summary, curves, figures, energy_elsewhere=energy_elsewhere),
        *dapo_lines,
        *zero3_lines,
        *cancellation_section(study, study_figures, 3 + bool(dapo_lines) + bool(zero3_lines)),
        *notes_section(notes, number),
        *layouts_lines,
        *e2e_lines,
        *long_run_lines,
        *shape_lines,
        *study_v2_lines,
        *users_size_lines,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    n = len(figures) + len(dapo_figures) + sum(len(f) for f in study_figures.values()) + len(long_run_figures)
    print(f"wrote {out}" + (f" and {n} figures in {fig_dir}" if n else ""))


if __name__ == "__main__":
    main()
