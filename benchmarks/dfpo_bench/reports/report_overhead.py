"""RESULTS.md's §1: the overhead runs against TRL's GSPO, the transforms alone and the loss step (called by
``benchmarks/dfpo_bench/reports/report.py``; every number is read from the result files)."""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from dfpo_bench.lib.common import load_json
from dfpo_bench.lib.stats import fmt
from dfpo_bench.lib.trainers import label

OVERHEAD_GOAL, REGRESSION, DELTA_GOAL, POP_GOAL_MS = 1.01, 1.02, 1.03, 1.0
GOALS = {**dict.fromkeys(("min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance", "grpo_fix",
                          "none_score", "dfpo_none"), OVERHEAD_GOAL), "delta": DELTA_GOAL}
VERDICTS = (
    ("within, interval too", "Within the goal, point estimate and whole interval"),
    ("within, interval above", "Point estimate within the goal, but the interval includes the goal (reaches above it), "
     "so meeting the goal is not resolved"),
    ("above, interval includes", "**Point estimate above the goal**; the interval includes the goal, so this is not "
     "resolved either way"),
    ("above, interval above", "**Above the goal, the whole interval too**"),
    ("above, no interval", "**Point estimate above the goal** (no interval in the file)"))


def overhead_entries(results: pathlib.Path) -> list[dict[str, Any]]:
    data = load_json(results / "overhead.json")
    if data is None:
        return [p for p in map(load_json, sorted(results.glob("overhead_*.json"))) if p]
    return [data] if "median_step_s" in data else list(data.values())


def judged(e: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool, str]:
    """(ratio to GSPO, 95% interval, no_rollout, "a–b" no-rollout steps per method) the goals are judged on: the
    median of the optimizer steps with no rollout in them where the file has it, else the median step."""
    ratios = e.get("ratio_train_only_to_baseline") or {}
    steps = sorted({v for v in (e.get("train_only_steps_per_method") or {}).values() if v is not None})
    counts = "–".join(map(str, steps))
    if any(v is not None for v in ratios.values()):
        return ratios, e.get("ratio_train_only_interval_95") or {}, True, counts
    return e["ratio_to_baseline"], e.get("ratio_interval_95") or {}, False, counts


def with_interval(ratio: float | None, ci: list[float] | None, method: str) -> str:
    return fmt(ratio) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and method != "gspo" else "")


def goal_text(method: str, ratio: float | None) -> str:
    goal = GOALS.get(method)
    if goal is None or ratio is None:
        return "baseline" if method == "gspo" else "–"
    if ratio <= goal:
        return f"met (≤ {goal:.2f}×)"
    if goal == OVERHEAD_GOAL and ratio <= REGRESSION:
        return f"missed (≤ {REGRESSION:.2f}×, not a regression)"
    return f"**missed** (> {REGRESSION if goal == OVERHEAD_GOAL else goal:.2f}×)"


def overhead_section(entries: list[dict[str, Any]]) -> list[str]:
    out = ["## 1. Overhead", ""]
    if not entries:
        return out + ["No overhead results yet (`benchmarks/dfpo_bench/cost/overhead.py`).", ""]
    for e in entries:
        s = e.get("settings", {})
        ratios, intervals, no_rollout, counts = judged(e)
        out += [
            f"### {e['model']} ({e.get('model_params', 0) / 1e6:.0f}M parameters, {e.get('dtype', '?')}) on "
            f"{e['device']}", "",
            f"{e['steps']} timed optimizer steps per method after {s.get('warmup')} warm-up steps per phase, "
            f"{s.get('rounds')} interleaved rounds; {s.get('batch_size')} completions per micro-batch, G = "
            f"{s.get('num_generations')}, {s.get('steps_per_generation')} optimizer steps per generation (off-policy), "
            f"completions of {s.get('max_completion_length')} tokens" + (" (fixed length)" if s.get("fixed_length")
                                                                         else "")
            + f", gradient checkpointing {'on' if s.get('gradient_checkpointing') else 'off'}"
            + (f", reward `{s['reward']}`" if s.get("reward") else "") + "."
            + (f" {counts} of each method's timed steps contain no rollout (no sampling, no "
               "old-log-prob forward): the no-rollout columns are their median, its ratio to GSPO's and a 95% "
               "bootstrap interval, and the goal column judges that ratio." if no_rollout and counts else ""), "",
            f"| method ({e['device']}) | median step (s) | × GSPO [95% CI] | "
            + ("median no-rollout step (s) | no-rollout × GSPO [95% CI] | " if no_rollout else "")
            + "median training (s) | mean training × GSPO | generation call (s) | peak memory (GB) | goal |",
            "|" + " --- |" * (10 if no_rollout else 8)]
        for m, step in e["median_step_s"].items():
            cells = [label(m), fmt(step, 4), with_interval(e["ratio_to_baseline"].get(m),
                                                           (e.get("ratio_interval_95") or {}).get(m), m)]
            if no_rollout:
                cells += [fmt((e.get("median_train_only_step_s") or {}).get(m), 4),
                          with_interval(ratios.get(m), intervals.get(m), m)]
            cells += [fmt(e["median_training_s"].get(m), 4),
                      fmt((e.get("ratio_mean_training_to_baseline") or {}).get(m)),
                      fmt((e.get("median_generation_s") or {}).get(m)), fmt(e["peak_mem_gb"].get(m), 2),
                      goal_text(m, ratios.get(m))]
            out.append("| " + " | ".join(cells) + " |")
        first, *rest = overhead_sentences(e)
        out += ["", first, "", *[f"- {line}" for line in rest], ""]
    return out


def round_medians(e: dict[str, Any], method: str) -> list[float] | None:
    """Median step of each of the method's phases (one per round), from ``step_times_s``; None if not split-able."""
    times, per = (e.get("step_times_s") or {}).get(method), (e.get("settings") or {}).get("steps")
    if not times or not per or len(times) % per or len(times) // per < 2:
        return None
    return [statistics.median(times[i : i + per]) for i in range(0, len(times), per)]


def overhead_sentences(e: dict[str, Any]) -> list[str]:
    ratios, intervals, no_rollout, counts = judged(e)
    groups: dict[str, list[str]] = {}
    for m, ratio in ratios.items():
        goal, ci = GOALS.get(m), intervals.get(m)
        if goal is None or ratio is None:
            continue
        text = f"{label(m)} {ratio:.3f}×" + (f" (95% CI {ci[0]:.3f}–{ci[1]:.3f})" if ci else "")
        text += f" against its {goal:.2f}× goal" if goal != OVERHEAD_GOAL else ""
        if ratio <= goal:
            key = "within, interval too" if ci is None or ci[1] <= goal else "within, interval above"
        else:
            key = "above, interval includes" if ci and ci[0] <= goal else "above, interval above" if ci else \
                "above, no interval"
        groups.setdefault(key, []).append(text)
    basis = (f"the median of the optimizer steps that contain no rollout ({counts} per method: forward, backward and "
             "optimizer only) and its 95% bootstrap interval" if no_rollout
             else "the median step time (all timed steps) and its 95% bootstrap interval")
    lines = [f"Baseline: TRL's own `GRPOTrainer` with the GSPO settings, in the same process. The goals (≤ "
             f"{OVERHEAD_GOAL:.2f}× GSPO, DelTA ≤ {DELTA_GOAL:.2f}×; > {REGRESSION:.2f}× is a regression) are judged "
             f"on {basis}, on {e['device']}:"]
    lines += [f"{phrase}: {'; '.join(groups[key])}." for key, phrase in VERDICTS if key in groups]
    if not any(k.startswith("above") for k in groups):
        lines.append("No method's point estimate is above its goal.")
    faster = [f"{label(m)} {ratios[m]:.3f}× (95% CI {ci[0]:.3f}–{ci[1]:.3f})"
              for m, ci in intervals.items() if ci and m != "gspo" and ratios.get(m) is not None and ci[1] < 1]
    if faster:
        lines.append(
            f"Faster than GSPO with the whole interval below 1: {'; '.join(faster)}. None of them should do less "
            "work per step than GSPO (same model, same tensor shapes; the DFPO options add work), so read this as a "
            "difference between phases (each phase is its own trainer on its own model copy) that the bootstrap, "
            "which resamples steps, does not capture, not as a speed-up.")
    spread = [(m, r) for m in e["median_step_s"] if (r := round_medians(e, m))]
    if spread:
        m, r = max(spread, key=lambda x: (max(x[1]) - min(x[1])) / min(x[1]))
        apart = max((abs(v - 1) for k, v in ratios.items() if v is not None and k != "gspo"), default=None)
        lines.append(
            f"Round to round the median step of one method moved by up to {max(r) / min(r) - 1:.0%} ({label(m)}: "
            f"{', '.join(f'{x:.4f}' for x in r)} s in its {len(r)} phases)"
            + (f", while the methods' {'no-rollout' if no_rollout else 'step'} medians differ from GSPO's by at "
               f"most {apart:.0%}" if apart is not None else "")
            + "; the intervals above resample steps, not phases, so they leave this variation out.")
    return lines


def transforms_section(timing: dict[str, Any] | None) -> list[str]:
    out = ["### Transforms alone (`benchmarks/dfpo_bench/cost/bench_transforms.py`)", ""]
    if not timing:
        return out + ["No `transforms_timing.json`.", ""]
    out += [f"{timing['groups']} groups × G = {timing['G']}, {timing['dtype']}, on {timing['device_name']} "
            f"(torch {timing['torch']}).", "", "| transform | median (ms) | IQR (ms) |", "| --- | --- | --- |"]
    out += [f"| {name} | {r['median_ms']:.4f} | {r['iqr_ms']:.4f} |" for name, r in timing["results"].items()]
    if pop := timing["results"].get("positive_orth_proj"):
        verdict = "under" if pop["median_ms"] < POP_GOAL_MS else "over"
        out += ["", f"Positive Orth-Proj: {pop['median_ms']:.3f} ms on {timing['device_name']}, {verdict} the 1 ms "
                "goal."]
    return out + [""]


def loss_step_section(results: pathlib.Path) -> list[str]:
    """Loss + backward on one fixed batch against TRL's GRPOTrainer (dfpo_bench.cost.loss_step), every file."""
    files = sorted(results.glob("loss_step_*.json"))
    if not files:
        return []
    out = ["### Loss and backward on one fixed batch (`benchmarks/dfpo_bench/cost/loss_step.py`)", "",
           "Only `compute_loss` + `backward` of each method on the same model and the same off-policy batch, methods "
           "interleaved in shuffled rounds; ratio to TRL's `GRPOTrainer` (GSPO settings) taken within each round, "
           "median over rounds with its 95% bootstrap interval. This isolates what the methods add to a training "
           "step (no sampling, no optimizer), which whole-loop timings here cannot resolve.", ""]
    for r in map(load_json, files):
        out += [f"**{r['model']}** ({r['dtype']}, {r['rows']} rows in groups of {r['group_size']}, completions up to "
                f"{r['completion_length']} tokens, gradient checkpointing "
                f"{'on' if r['gradient_checkpointing'] else 'off'}) on {r['device']}, {r['rounds']} rounds × "
                f"{r['reps']} repetitions:", "",
                "| method | median loss + backward (ms) | ratio to TRL | 95% interval |", "| --- | --- | --- | --- |"]
        for name, m in r["methods"].items():
            ci = m.get("ratio_interval_95")
            text = "TRL's `GRPOTrainer` (GSPO)" if name == r["baseline"] else f"{label(name)} (`{name}`)"
            out.append(f"| {text} | {1e3 * m['median_s']:.2f} | {fmt(m.get('ratio_to_trl'))} | "
                       f"{'[' + fmt(ci[0]) + ', ' + fmt(ci[1]) + ']' if ci else '–'} |")
        above = [n for n, m in r["methods"].items() if m.get("ratio_interval_95") and m["ratio_interval_95"][0] > 1]
        out += ["", (f"Intervals entirely above 1 (a resolved cost): {', '.join(above)}." if above
                     else "No interval lies entirely above 1.")
                + (" DFPOTrainer with DFPO off gave the same loss value as TRL's trainer."
                   if r.get("dfpo_none_loss_equals_trl") else ""), ""]
    return out
