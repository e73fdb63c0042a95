"""The layouts study's ``report`` phase and merge: per-round medians of the off-policy steps, ratios to GSPO with
bootstrap intervals, the figure and the table; run through ``layouts.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]


from dfpo_bench.launch.layouts_setup import METHODS, compare_check  # noqa: E402
from dfpo_bench.lib import common, stats  # noqa: E402


# ------------------------------------------------------------------------------------------ phase: report
def per_round(steps: list[dict[str, Any]], off_policy: bool) -> dict[int, float]:
    """Median step time per timed round (off-policy steps, or the first step of each rollout)."""
    by_round: dict[int, list[float]] = {}
    for s in steps:
        if s.get("round") is None or s["round"] < 0 or (s["step_in_rollout"] != 0) != off_policy:
            continue
        by_round.setdefault(s["round"], []).append(s["seconds"])
    return {r: statistics.median(v) for r, v in by_round.items()}


def phase_report(args: argparse.Namespace) -> dict[str, Any]:
    work = pathlib.Path(args.work_dir)
    timing_path = work / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    if args.no_check:
        check: dict[str, Any] = {"coefficients_match_reference": None, "skipped": "--no-check", "layouts": {}}
    else:
        check = compare_check(args)
    report: dict[str, Any] = {
        "device": timing.get("device"), "gpus": timing.get("processes"), "zero_stage": timing.get("zero_stage"),
        "per_device_train_batch_size": args.per_device, "num_generations": args.num_generations,
        "steps_per_generation": args.steps_per_generation,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "completion_length": args.completion_length,
        "completion_length_range": [args.min_completion_length, args.completion_length],
        "prompt_length": args.prompt_length, "model": f"random-{args.random_config}", "dtype": args.dtype,
        "timed": "off-policy optimizer steps only (every optimizer step but the first of each rollout), from "
                 "on_step_begin to on_step_end, every rank aligned (all-reduce, CUDA synchronise) at both ends; "
                 "per round the median of a method's timed steps",
        "steps_per_turn": timing.get("steps_per_turn"), "gc": timing.get("gc"),
        "rounds": timing.get("rounds_done", 0), "complete": timing.get("complete", False),
        "layouts": timing.get("layouts", {}), "engines": timing.get("engines"),
        "loss_finite": timing.get("loss_finite", {}),
        "peak_memory_gb": timing.get("peak_memory_gb"), "versions": timing.get("versions"),
        "coefficients_match_reference": check["coefficients_match_reference"], "coefficient_check": check,
    }
    steps = timing.get("steps", {})
    base = per_round(steps.get("gspo", []), True)
    for name in METHODS:
        rounds = per_round(steps.get(name, []), True)
        first = per_round(steps.get(name, []), False)
        entry: dict[str, Any] = {"median_step_s": None, "interval_95": None, "ratio_to_gspo": None,
                                 "ratio_interval_95": None, "rounds": len(rounds)}
        if name in timing.get("errors", {}):
            entry["error"] = timing["errors"][name]
        if rounds:
            values = [rounds[r] for r in sorted(rounds)]
            entry.update(median_step_s=statistics.median(values), interval_95=stats.bootstrap_median(values),
                         round_median_s=values)
            shared = sorted(set(rounds) & set(base))
            if shared:
                ratios = [rounds[r] / base[r] for r in shared]
                entry.update(ratio_to_gspo=statistics.median(ratios), ratio_interval_95=stats.bootstrap_median(ratios))
        if first:
            entry["first_step_median_s"] = statistics.median(first.values())
        timed = [s for s in steps.get(name, []) if s.get("round") is not None and s["round"] >= 0]
        entry["gc_s_in_timed_steps"] = round(sum(s.get("gc_s", 0.0) for s in timed), 3)
        entry["steps"] = [{k: s[k] for k in ("round", "step_in_rollout", "seconds", "gc_s") if k in s} for s in timed]
        report[name] = entry
    common.write_json(pathlib.Path(args.out_dir) / "layouts.json", report)
    print_table(report)
    return report


def merge_reports(args: argparse.Namespace) -> dict[str, Any]:
    """One ``layouts.json`` from the JSONs of separate runs (e.g. ``--no-check`` and ``--no-time``): the coefficient
    check from a run that made one; the timing from the one timing run, or, with several of one setting on one
    machine, their rounds pooled (ratios to GSPO taken within each round, then bootstrapped over all rounds)."""
    reports = [(path, json.loads(pathlib.Path(path).read_text())) for path in args.merge]
    timed_path, merged = max(reports, key=lambda item: item[1].get("rounds") or 0)
    merged = dict(merged)
    timed = [(path, r) for path, r in reports if r.get("rounds")]
    if len(timed) > 1:  # several timing runs of one shape on one machine: pool their rounds
        shape = ("device", "gpus", "model", "per_device_train_batch_size", "num_generations", "steps_per_generation",
                 "gradient_accumulation_steps", "completion_length_range", "steps_per_turn", "gc")
        if any(r.get(key) != timed[0][1].get(key) for _, r in timed for key in shape):
            raise SystemExit("--merge: the timing runs differ in device, shape or turn design; pool only runs of one "
                             "setting")
        timed_path = ", ".join(path for path, _ in timed)
        rounds = {name: [t for _, r in timed for t in r[name]["round_median_s"]] for name in METHODS}
        merged["rounds"] = len(rounds["gspo"])
        for name in METHODS:
            ratios = [t / b for t, b in zip(rounds[name], rounds["gspo"], strict=True)]
            firsts = [r[name]["first_step_median_s"] for _, r in timed if r[name].get("first_step_median_s")]
            merged[name] = {
                **{k: v for k, v in merged[name].items() if k not in ("steps", "first_step_median_s")},
                "rounds": len(rounds[name]), "round_median_s": rounds[name],
                "median_step_s": statistics.median(rounds[name]), "interval_95": stats.bootstrap_median(rounds[name]),
                "ratio_to_gspo": statistics.median(ratios), "ratio_interval_95": stats.bootstrap_median(ratios),
                "round_ratio_to_gspo": ratios,
                "gc_s_in_timed_steps": round(sum(r[name].get("gc_s_in_timed_steps", 0.0) for _, r in timed), 3),
                "first_step_median_s_per_run": firsts,
                "runs": [{key: r[name].get(key) for key in ("rounds", "median_step_s", "ratio_to_gspo",
                                                            "ratio_interval_95")} for _, r in timed],
            }
        merged["steps_in_run_files"] = "every timed step: the 'steps' of each run's file in merged_from.timing"
    checked = [(path, r) for path, r in reports if r.get("coefficient_check", {}).get("layouts")]
    if checked:
        check_path, check = checked[0]
        merged["coefficients_match_reference"] = check["coefficients_match_reference"]
        merged["coefficient_check"] = check["coefficient_check"]
    else:
        check_path = None
    merged["merged_from"] = {"timing": timed_path, "coefficient_check": check_path}
    for key in ("stages", "wall_s", "command"):
        merged[key] = {path: r.get(key) for path, r in reports}
    common.write_json(pathlib.Path(args.out_dir) / "layouts.json", merged)
    if args.plot:
        plot_ratios(merged, pathlib.Path(args.plot))
    print_table(merged)
    return merged


def plot_ratios(report: dict[str, Any], path: pathlib.Path) -> None:
    """Each round's step time over GSPO's in the same round, per layout, with the median and its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    names = [name for name in METHODS if name != "gspo"]
    for x, name in enumerate(names):
        entry = report[name]
        rounds = [t / b for t, b in zip(entry["round_median_s"], report["gspo"]["round_median_s"], strict=True)]
        ax.scatter([x] * len(rounds), rounds, color="0.5", s=14, zorder=2, label="rounds" if x == 0 else None)
        low, high = entry["ratio_interval_95"]
        ax.errorbar([x + 0.12], [entry["ratio_to_gspo"]], yerr=[[entry["ratio_to_gspo"] - low],
                    [high - entry["ratio_to_gspo"]]], fmt="o", color="C0", capsize=4, zorder=3,
                    label="median, 95% interval" if x == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="C3", lw=0.8, ls="--", label="1.05 x GSPO")
    ax.set_xticks(range(len(names)), [f"Min-Replace\n{name}" for name in names])
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylabel("step time / TRL GSPO (same round)")
    ax.set_title(f"{report['gpus']} x {report['device']}, ZeRO-{report['zero_stage']}, {report['model']}, "
                 f"{report['rounds']} rounds", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def print_table(report: dict[str, Any]) -> None:
    def fmt(value: Any, spec: str) -> str:
        width = int(spec.split(".")[0] or 0)
        return format(value, spec) if isinstance(value, (int, float)) else "-".rjust(width)

    lo, hi = report["completion_length_range"]
    check = report["coefficient_check"]
    device = report["device"] or check.get("device")
    gpus = report["gpus"] or check.get("processes")
    zero = report["zero_stage"] if report["zero_stage"] is not None else check.get("zero_stage")
    print(f"\n{device}: {gpus} processes, ZeRO-{zero}, {report['model']} "
          f"{report['dtype']}, per-device {report['per_device_train_batch_size']}, G {report['num_generations']}, "
          f"spg {report['steps_per_generation']}, accumulation {report['gradient_accumulation_steps']}, completions "
          f"{lo}-{hi} tokens; {report['rounds']} rounds, off-policy optimizer steps")
    print(f"{'method':15s} {'layout':15s} {'median s':>9s}  {'95% interval':17s} {'ratio':>6s}  95% interval")
    for name in METHODS:
        e = report[name]
        interval = e["interval_95"] or [None, None]
        ratio_interval = e["ratio_interval_95"] or [None, None]
        print(f"{name:15s} {report['layouts'].get(name, '-'):15s} {fmt(e['median_step_s'], '9.3f')}  "
              f"[{fmt(interval[0], '.3f')}, {fmt(interval[1], '.3f')}]".ljust(61)
              + f"{fmt(e['ratio_to_gspo'], '6.3f')}  [{fmt(ratio_interval[0], '.3f')}, {fmt(ratio_interval[1], '.3f')}]"
              + (f"  error: {e['error'][:80]}" if e.get("error") else ""))
    per_layout = "; ".join(
        f"{k}: {v.get('rows_checked', 0)}/{v.get('rows_expected', '?')} rows"
        + (f", error {v['error'][:60]}" if v.get("error") else "") for k, v in check.get("layouts", {}).items())
    if check.get("skipped"):
        print(f"coefficients_match_reference: not checked ({check['skipped']})")
        return
    print(f"coefficients_match_reference: {report['coefficients_match_reference']} (max |diff| "
          f"{fmt(check.get('max_abs_diff'), '.2e')}, tolerance {check.get('tolerance')}; {per_layout})")
