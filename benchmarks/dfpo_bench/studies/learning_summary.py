"""The learning study's records read back: per-run summaries (threshold, jitter, held-out accuracy, the
mechanism metrics over off-policy steps), their aggregation over seeds, the cancellation study's intervals and the
printed table; used by ``learning.py --aggregate`` and at the end of a launch.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]

from dfpo_bench.lib import trainers  # noqa: E402

# Per-step log keys kept in a run's curves (besides every asym/, cancellation/, transform/, delta/, grpo_fix/).
STEP_KEYS = (
    "reward", "reward_std", "frac_reward_zero_std", "entropy", "loss", "grad_norm", "kl",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length",
    "completions/clipped_ratio",
)
STEP_PREFIXES = ("asym/", "cancellation/", "transform/", "delta/", "grpo_fix/", "energy/")
RESIDUAL = "cancellation/shared_prefix_residual"
RESIDUAL_TWO_SIDED = "cancellation/shared_prefix_residual_two_sided"  # docs/source/concepts/cancellation.md
ONE_SIDED = "cancellation/one_sided_groups"  # docs/source/concepts/cancellation.md
CLIP_REGION = "clip_ratio/region_mean"

def reward_curve(run: dict[str, Any]) -> list[float]:
    """Sampled reward of each rollout (TRL logs ``reward`` on the optimizer step that generated)."""
    return [v for v in run["log"].get("reward", []) if v is not None]


def per_generation(run: dict[str, Any], key: str, off_policy: bool = False) -> list[float | None]:
    """Mean of a per-step metric over each rollout's optimizer steps (None where it was never logged);
    ``off_policy``: over the steps after the rollout's first (see :func:`rollout_positions`) only."""
    spg = run["settings"]["steps_per_generation"]
    values = run["log"].get(key, [])
    positions = rollout_positions(run)
    out = []
    for g in range(len(reward_curve(run))):
        chunk = [
            v for i, v in enumerate(values[g * spg : (g + 1) * spg], g * spg)
            if v is not None and not (off_policy and positions[i] == 0)
        ]
        out.append(statistics.fmean(chunk) if chunk else None)
    return out


def rollout_positions(run: dict[str, Any]) -> list[int]:
    """Each logged step's index within its rollout: 0 for the step that sampled (on-policy, every s = 1),
    1 … steps_per_generation − 1 for the off-policy steps that reuse its completions. From the logged global
    step (1-based, one log per step)."""
    spg = run["settings"]["steps_per_generation"]
    return [(int(step) - 1) % spg for step in run["steps"]]


def step_mean(run: dict[str, Any], key: str, where: str = "all") -> float | None:
    """Mean of a per-step metric over ``where`` = "all", "off_policy" or "on_policy" steps; None if never logged."""
    positions = rollout_positions(run)
    values = [
        v for v, pos in zip(run["log"].get(key, []), positions, strict=False)
        if v is not None and (where == "all" or (pos == 0) == (where == "on_policy"))
    ]
    return statistics.fmean(values) if values else None


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "lr", "num_generations", "steps_per_generation", "batch_size", "max_completion_length", "temperature",
        "beta", "generations", "threshold", "ema", "heldout", "dtype", "gradient_checkpointing",
        "baseline_trainer", "eval_max_new_tokens", "sequence_loss_type", "energy_buckets", "task", "reward",
    )
    return {k: getattr(args, k, None) for k in keys}


# ---------------------------------------------------------------------------------------------- summary
def run_summary(run: dict[str, Any], threshold: float, alpha: float) -> dict[str, Any]:
    """A run's summary numbers (the ones ``report.py`` reads, plus a few more) from its curves."""
    from dfpo_trl.testing.measures import jitter2, steps_to_threshold

    rewards = reward_curve(run)
    index = steps_to_threshold(rewards, threshold, alpha=alpha) if rewards else None
    spg = run["settings"]["steps_per_generation"]
    entropy = [v for v in run["log"].get("entropy", [])[-spg:] if v is not None]
    residual = [v for v in run["log"].get(RESIDUAL, []) if v is not None]

    def mean_of(key: str) -> float | None:
        values = [v for v in run["log"].get(key, []) if v is not None]
        return statistics.fmean(values) if values else None

    return {
        # 1-based: the number of rollouts used up to and including the one whose EMA reached the threshold.
        "generations_to_threshold": None if index is None else index + 1,
        "jitter2": jitter2(rewards) if len(rewards) >= 3 else None,
        "final_accuracy": run.get("final_accuracy"),
        "entropy_final": statistics.fmean(entropy) if entropy else None,
        "shared_prefix_residual": statistics.fmean(residual) if residual else None,
        "initial_accuracy": run.get("initial_accuracy"),
        "final_reward": statistics.fmean(rewards[-3:]) if rewards else None,
        "asym_before": mean_of("asym/before"),
        "asym_after": mean_of("asym/after"),
        # What the transform itself removes, same run and steps (0 for GSPO: s~ = s_bar).
        "asym_reduction": paired_mean(run["log"].get("asym/before", []), run["log"].get("asym/after", [])),
        # Eq. 24: share of the LM-head gradient norm on the most frequent tokens (bucket 0), mean over steps.
        "energy_frequent": mean_of("energy/freq_bucket_0"),
        # The cancellation study: the clip and the cancellation on the off-policy steps (where the clip acts), and
        # on-policy.
        "clip_fraction_off_policy": step_mean(run, CLIP_REGION, "off_policy"),
        "residual_off_policy": step_mean(run, RESIDUAL, "off_policy"),
        "residual_two_sided_off_policy": step_mean(run, RESIDUAL_TWO_SIDED, "off_policy"),
        "one_sided_groups_off_policy": step_mean(run, ONE_SIDED, "off_policy"),
        "residual_on_policy": step_mean(run, RESIDUAL, "on_policy"),
        "generations_done": len(rewards),
        "complete": bool(run.get("complete")),
        "wall_s": run.get("wall_s"),
    }


def paired_mean(before: list[float | None], after: list[float | None]) -> float | None:
    """Mean of before - after over the steps where both were logged."""
    pairs = [b - a for b, a in zip(before, after, strict=False) if b is not None and a is not None]
    return statistics.fmean(pairs) if pairs else None


def aggregate(runs: list[dict[str, Any]], threshold: float, alpha: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(learning.json as ``report.py`` reads it, learning_curves.json per method for plotting)."""
    if not runs:
        raise SystemExit("no runs to aggregate")
    order = {m: i for i, m in enumerate(trainers.LEARNING_METHODS)}
    runs = sorted(runs, key=lambda r: (order.get(r["method"], 99), r["method"], r["seed"]))
    first = runs[0]
    methods: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    for run in runs:
        m = run["method"]
        summary = run_summary(run, threshold, alpha)
        entry = methods.setdefault(m, {"seeds": []})
        entry["seeds"].append(run["seed"])
        for key, value in summary.items():
            entry.setdefault(key, []).append(value)
        c = curves.setdefault(m, {"seeds": [], "label": trainers.METHODS[m].label})
        c["seeds"].append(run["seed"])
        c.setdefault("reward", []).append(reward_curve(run))
        for name, key in (
            ("entropy", "entropy"), ("asym_before", "asym/before"), ("asym_after", "asym/after"),
            ("residual", RESIDUAL), ("clip_region", "clip_ratio/region_mean"),
            ("energy_frequent", "energy/freq_bucket_0"),
        ):
            c.setdefault(name, []).append(per_generation(run, key))
    settings = {k: v for k, v in first["settings"].items() if k not in ("threshold", "ema", "task")}
    tasks = sorted({run_task(r) for r in runs})
    summary = {
        "device": first["device"], "model": first["model"],
        "task": "; ".join(TASK_DESCRIPTIONS.get(t, t) for t in tasks),
        "threshold": threshold, "generations": settings["generations"],
        "methods": methods,
        "ema_alpha": alpha,
        "generations_to_threshold_definition": "1-based index of the first rollout whose EMA of the sampled "
        "reward (e_0 = m_0, e_t = a m_t + (1 - a) e_{t-1}) is >= threshold; null if never",
        "reference": {m: trainers.METHODS[m].reference for m in methods},
        "settings": settings, "versions": first["versions"],
        "devices": sorted({r["device"] for r in runs}),
    }
    return summary, {"settings": settings, "threshold": threshold, "ema_alpha": alpha, "methods": curves}


TASK_DESCRIPTIONS = {
    "arithmetic": "arithmetic (dfpo_trl.cli.tasks, single-digit a + b)",
    "sum_sentence": "sum_sentence (dfpo_trl.cli.tasks: single-digit a + b answered in a required ~20-token sentence)",
}


def run_task(run: dict[str, Any]) -> str:
    """The task a run trained on (runs written before ``--task`` existed are arithmetic)."""
    return run.get("task") or "arithmetic"


def load_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Runs from ``*_runs.json`` files (lists) or single-run files; a later file replaces the same (task, method,
    seed)."""
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        for run in data if isinstance(data, list) else data.get("runs", [data]):
            found[(run_task(run), run["method"], run["seed"])] = run
    return list(found.values())


# ------------------------------------------------------------------------------ the cancellation study
# (key of run_summary, what it is); every one gets per-seed values, a mean with a 95% t-interval over seeds and
# Welch intervals of its difference to GSPO and to Min-Replace on the weights.
CANCELLATION_METRICS = {
    "generations_to_threshold": "1-based rollout whose reward EMA first reaches the threshold (null: never; "
    "means and differences count never as generations + 1, a lower bound)",
    "jitter2": "Jitter2 (eq. 20) of the per-rollout sampled reward",
    "final_accuracy": "held-out greedy accuracy after training",
    "final_reward": "sampled reward, mean of the last 3 rollouts",
    "entropy_final": "mean entropy over the last rollout's optimizer steps",
    "clip_fraction_off_policy": "clip_ratio/region_mean (fraction of completion tokens in the clip region) on "
    "off-policy steps",
    "residual_off_policy": "cancellation/shared_prefix_residual on off-policy steps (step index within the "
    "rollout != 0)",
    "residual_two_sided_off_policy": "cancellation/shared_prefix_residual_two_sided on off-policy steps",
    "one_sided_groups_off_policy": "cancellation/one_sided_groups on off-policy steps (fraction of the groups with "
    "non-zero advantages whose surviving members share one sign or are none)",
    "residual_on_policy": "cancellation/shared_prefix_residual on the rollout's first step",
}
STUDY_REFERENCES = ("gspo", "min_replace")  # differences are taken against these
INTERVAL = "95% Student-t interval over seeds (mean); 95% Welch-t interval (difference of two methods' means)"


def metric_stats(values: list[Any]) -> dict[str, Any] | None:
    """Mean, 95% t-interval and n of the non-null values; None when there are none."""
    from dfpo_bench.lib.stats import mean_ci

    stats = mean_ci(values)
    if stats is None:
        return None
    mean, low, high, n = stats
    return {"mean": mean, "low": low, "high": high, "n": n}


def difference_stats(a: list[Any], b: list[Any]) -> dict[str, Any] | None:
    """mean(a) − mean(b) with a 95% Welch interval and whether it excludes 0; None below 2 values a side."""
    from dfpo_bench.lib.stats import diff_ci

    d = diff_ci(a, b)
    if d is None:
        return None
    diff, low, high = d
    # zero_width: every seed of both methods gave the same value, so the interval has no width (a t-interval
    # then says nothing about seeds not run; the report flags it).
    return {"difference": diff, "low": low, "high": high, "excludes_zero": bool(low > 0 or high < 0),
            "zero_width": low == high}


def cancellation_summary(runs: list[dict[str, Any]], threshold: float, alpha: float) -> dict[str, Any]:
    """``cancellation.json``: per task and method, every seed's metric values, means with 95% t-intervals, the
    differences to GSPO and to Min-Replace (weights) with Welch intervals, and per-rollout curves of the
    off-policy residuals for the figures."""
    if not runs:
        raise SystemExit("no runs to aggregate")
    order = {m: i for i, m in enumerate(trainers.CANCELLATION_METHODS)}
    runs = sorted(runs, key=lambda r: (run_task(r), order.get(r["method"], 99), r["method"], r["seed"]))
    tasks: dict[str, Any] = {}
    for run in runs:
        task = tasks.setdefault(run_task(run), {
            "description": TASK_DESCRIPTIONS.get(run_task(run), run_task(run)),
            "settings": {k: v for k, v in run["settings"].items() if k not in ("threshold", "ema")},
            "methods": {},
        })
        summary = run_summary(run, threshold, alpha)
        entry = task["methods"].setdefault(run["method"], {
            "label": trainers.METHODS[run["method"]].label if run["method"] in trainers.METHODS else run["method"],
            "overrides": trainers.METHODS[run["method"]].overrides if run["method"] in trainers.METHODS else {},
            "seeds": [], "devices": [], "complete": [], "missing_fields": [], "values": {}, "curves": {},
        })
        entry["seeds"].append(run["seed"])
        entry["devices"].append(run["device"])
        entry["complete"].append(bool(run.get("complete")))
        entry["missing_fields"].append(run.get("missing_fields", []))
        for key in (*CANCELLATION_METRICS, "initial_accuracy", "generations_done"):
            entry["values"].setdefault(key, []).append(summary.get(key))
        for name, key, off in (("reward", "reward", False), ("residual_off_policy", RESIDUAL, True),
                               ("residual_two_sided_off_policy", RESIDUAL_TWO_SIDED, True),
                               ("one_sided_groups_off_policy", ONE_SIDED, True),
                               ("clip_fraction_off_policy", CLIP_REGION, True)):
            curve = reward_curve(run) if key == "reward" else per_generation(run, key, off_policy=off)
            entry["curves"].setdefault(name, []).append(curve)
    for task in tasks.values():
        budget = task["settings"]["generations"]
        methods = task["methods"]
        for entry in methods.values():
            entry["stats"] = {key: metric_stats(study_values(entry, key, budget)) for key in CANCELLATION_METRICS}
        for reference in STUDY_REFERENCES:
            if reference not in methods:
                continue
            task[f"vs_{reference}"] = {
                m: {key: difference_stats(study_values(e, key, budget), study_values(methods[reference], key, budget))
                    for key in CANCELLATION_METRICS}
                for m, e in methods.items() if m != reference
            }
    first = runs[0]
    return {
        "study": "the cancellation study: cancellation in the gradient, not only in the weights",
        "device": first["device"], "devices": sorted({r["device"] for r in runs}), "model": first["model"],
        "versions": first["versions"], "threshold": threshold, "ema_alpha": alpha, "interval": INTERVAL,
        "metrics": CANCELLATION_METRICS, "references": list(STUDY_REFERENCES), "tasks": tasks,
    }


def study_values(entry: dict[str, Any], key: str, budget: int) -> list[float | None]:
    """A metric's per-seed values as the statistics use them: never-reached thresholds count as budget + 1."""
    values = entry["values"][key]
    if key == "generations_to_threshold":
        return [budget + 1 if v is None else v for v in values]
    return values


def table(summary: dict[str, Any], study: bool = False) -> str:
    """Short per-method table: mean over seeds (None-aware); ``study``: the cancellation study's off-policy columns
    too."""

    def mean(values: list[Any]) -> str:
        v = [x for x in values if x is not None]
        return f"{statistics.fmean(v):.3f}" if v else "-"

    lines = [f"{'method':<24} {'seeds':>5} {'gen->thr':>9} {'reached':>7} {'jitter2':>8} {'acc':>6} {'entropy':>8} "
             f"{'residual':>8} {'asym':>8}"]
    for m, e in summary["methods"].items():
        reached = sum(x is not None for x in e["generations_to_threshold"])
        lines.append(
            f"{m:<24} {len(e['seeds']):>5} {mean(e['generations_to_threshold']):>9} {reached:>4}/{len(e['seeds']):<2} "
            f"{mean(e['jitter2']):>8} {mean(e['final_accuracy']):>6} {mean(e['entropy_final']):>8} "
            f"{mean(e['shared_prefix_residual']):>8} {mean(e['asym_after']):>8}"
        )
    if study:
        lines.append(f"{'off-policy steps:':<24} {'clip':>8} {'residual':>9} {'two-sided':>9} {'one-sided':>9}")
        for m, e in summary["methods"].items():
            lines.append(
                f"{m:<24} {mean(e['clip_fraction_off_policy']):>8} {mean(e['residual_off_policy']):>9} "
                f"{mean(e['residual_two_sided_off_policy']):>9} {mean(e['one_sided_groups_off_policy']):>9}"
            )
    return "\n".join(lines)
