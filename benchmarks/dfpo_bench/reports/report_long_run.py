"""RESULTS.md sections for the vLLM runs: the end-to-end run (``vllm_e2e.json``) and the long-run study
(``long_run.json``), with the study's figures. Called by ``dfpo_bench.reports.report``; every number and sentence is
computed from those files."""

from __future__ import annotations

import math
import pathlib
import statistics
from typing import Any

from dfpo_bench.lib.common import read_record, save_figure
from dfpo_bench.lib.stats import fmt, mean_ci

# (metric in long_run.json, column title, digits)
COLUMNS = (
    ("heldout", "held-out accuracy", 3),
    ("drift_abs", "\\|log-odds\\| between forms (D2)", 2),
    ("set_entropy", "entropy on the forms (D3)", 3),
    ("entropy", "policy entropy", 3),
    ("clip_fraction", "clip fraction", 3),
)
RUN_COLUMNS = (
    ("steps_to_threshold", "steps to threshold", 1),
    ("jitter2", "Jitter₂", 3),
    ("energy_bucket0", "energy, top bucket", 3),
    ("clip_fraction", "clip fraction", 3),
)
PANELS = (  # (what, title, y label)
    ("heldout", "held-out greedy accuracy", "accuracy"),
    ("step_reward", "training reward (EMA 0.3)", "reward"),
    ("entropy", "policy entropy", "entropy"),
    ("drift_abs", "|log-odds| between the equivalent forms (D2)", "nats"),
    ("set_entropy", "entropy on the equivalent forms (D3)", "nats"),
    ("energy/freq_bucket_0", "energy share, most frequent bucket (eq. 24; 12-step mean)", "share"),
    ("clip_ratio/region_mean", "clip fraction (12-step mean)", "fraction"),
)
SMOOTHED = {"energy/freq_bucket_0": 12, "clip_ratio/region_mean": 12}  # per-step metrics drawn as moving means


def ci_text(values: list[Any], digits: int) -> str:
    stats = mean_ci(values)
    if stats is None:
        return "–"
    m, lo, hi, n = stats
    return f"{m:.{digits}f}" if n < 2 else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def diff_text(d: dict[str, Any] | None, digits: int) -> str:
    if d is None:
        return "–"
    return f"{d['mean']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"


# ------------------------------------------------------------------------------------------------ vLLM e2e
def e2e_section(e2e: dict[str, Any] | None, number: int) -> list[str]:
    if not e2e:
        return []
    runs = e2e["runs"]
    recipe = runs.get("recipe") or {}
    lines = [f"## {number}. vLLM end to end (`benchmarks/dfpo_bench/launch/vllm_e2e.py`, {e2e['card']})", ""]
    versions = ", ".join(f"{k} {v}" for k, v in e2e["versions"].items())
    lines += [f"{e2e['card']}; {versions}.", ""]
    if recipe.get("steps"):
        split = recipe["time_split_s"]
        sampling = recipe.get("sampling") or {}

        def spread(key: str, pick: Any) -> str:
            values = [v for _, v in sampling.get(key, [])]
            return fmt(pick(values), 4) if values else "–"

        heldout = recipe.get("heldout") or {}
        lines += [
            f"**The recipe** (`recipes/{e2e['recipe']}` as `dfpo-train` runs it, {recipe['method']} on "
            f"`{recipe['task']}`): {recipe['steps']} optimizer steps, {recipe['calls'].get('generation', 0)} vLLM "
            f"rollouts ({recipe['vllm_mode']} mode, `vllm_gpu_memory_utilization` "
            f"{recipe['vllm_gpu_memory_utilization']}), `vllm_importance_sampling_correction` "
            f"{'on' if recipe['vllm_importance_sampling_correction'] else 'off'} (mode "
            f"`{recipe['vllm_importance_sampling_mode']}`). Held-out greedy accuracy {fmt(heldout.get('before'), 2)} "
            f"→ {fmt(heldout.get('after'), 2)} ({heldout.get('n')} problems; every 50 steps: "
            + ", ".join(f"{s}: {a:.2f}" for s, a in heldout.get("curve", [])) + "). Training reward EMA "
            f"{fmt(recipe.get('reward_ema_first'), 2)} → {fmt(recipe.get('reward_ema_last'), 2)}, threshold 0.6 "
            f"reached at step {recipe.get('steps_to_threshold') or 'never'}.",
            "",
            "Sampler against trainer, per rollout (TRL's `sampling/*` metrics): the mean |log p_vLLM − log "
            "p_trainer| over a rollout's tokens had median "
            f"{spread('sampling/sampling_logp_difference/mean', statistics.median)} and maximum "
            f"{spread('sampling/sampling_logp_difference/mean', max)}; the largest single-token gap "
            f"was {spread('sampling/sampling_logp_difference/max', max)}. The importance-sampling ratio's rollout "
            f"mean stayed within [{spread('sampling/importance_sampling_ratio/mean', min)}, "
            f"{spread('sampling/importance_sampling_ratio/mean', max)}]; its extremes over all rollouts were "
            f"{spread('sampling/importance_sampling_ratio/min', min)} and "
            f"{spread('sampling/importance_sampling_ratio/max', max)} (sequences outside [0, 3] are masked).",
            "",
            "| wall time (s) | total | vLLM start-up | generation | weight sync | training | held-out evals | "
            "drift meter | model load + setup without vLLM | save |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {recipe['steps']} steps | {split['total']} | {split['vllm_startup']} | {split['generation']} | "
            f"{split['weight_sync']} | {split['training']} | {split['heldout_eval']} | {split['drift_meter']} | "
            f"{split['model_and_setup_without_vllm']} | {split['save_and_plot']} |",
            "",
            "\"training\" is the rest of `train()`: rewards, TRL's old-log-prob forward, loss, backward, optimizer and "
            "logging. vLLM start-up is the engine's construction inside the trainer with vLLM's compile cache already "
            "filled by earlier runs on the machine" + (f"; {e2e['cold_start_note']}" if e2e.get("cold_start_note")
                                                       else "") + ".",
            "",
        ]
    parity = e2e.get("parity")
    if parity:
        keys = [k for k, v in parity.items() if isinstance(v, dict)]
        steps = max(v["steps"] for k, v in parity.items() if isinstance(v, dict))
        if parity["identical"]:
            verdict = (f"identical: every logged value of {len(keys)} keys ({', '.join(f'`{k}`' for k in keys)}) "
                       f"equal to the last bit over {steps} optimizer steps")
        else:
            worst = {k: v for k, v in parity.items() if isinstance(v, dict) and v["max_abs_diff"] > 0}
            verdict = "different: " + "; ".join(
                f"`{k}` first at step {v['first_differing_step']}, max |diff| {v['max_abs_diff']:.3g}"
                for k, v in worst.items()
            )
        lines += [
            f"**DFPO off against TRL's `GRPOTrainer` under vLLM**: both built from the same keyword arguments (the "
            f"recipe's `GRPOConfig` fields), seed and data, each with its own vLLM engine: {verdict}. vLLM's sampler "
            "is seeded by TRL with the process index (0 in both runs) and the two engines receive the same requests "
            "in the same order, so the rollouts are the same; the training kernels are deterministic for equal "
            "shapes on this card.",
            "",
        ]
    return lines


# ------------------------------------------------------------------------------------------------ long runs
def long_run_section(study: dict[str, Any] | None, figures: dict[str, str], number: int,
                     records: list[dict[str, Any]] | None = None) -> list[str]:
    if not study or not study.get("tasks"):
        return []
    runs = study["runs"]
    complete = [r for r in runs if r["complete"]]
    seeds = sorted({r["seed"] for r in complete})
    methods = sorted({r["method"] for r in complete})
    cards = ", ".join(study["card"])
    lines = [
        f"## {number}. Long runs with vLLM generation (`benchmarks/dfpo_bench/studies/long_run.py`, {cards})",
        "",
        f"{len(complete)} complete runs of {study['steps']} optimizer steps (seeds {', '.join(map(str, seeds))}; "
        f"methods {', '.join(f'`{m}`' for m in methods)}; tasks {', '.join(f'`{t}`' for t in study['tasks'])}), each "
        f"`dfpo-train {study['settings'].get('recipe')}` with the method's flags, several runs at a time on one "
        f"{cards} (vLLM engines started one after another). " + ", ".join(f"{k} {v}" for k, v in
                                                                          study["versions"].items()) + ".",
        "",
        "Checkpoint values: held-out accuracy and the drift meter (D2, D3; docs/source/concepts/metrics.md) as "
        "measured at that step; "
        f"policy entropy and clip fraction as means over the {study['window']} steps up to it. Whole-run values: "
        "steps until the training reward's EMA reaches κ = 0.6 (a run that never does counts as steps + 1, a lower "
        "bound), Jitter₂ of the per-step reward, the clip fraction averaged over every step, and the share of the "
        "LM-head gradient energy on the most frequent quarter of token occurrences (eq. 24) averaged over the steps "
        "where it was measured (those with a nonzero gradient: see the zero-gradient steps below). The energy "
        "here is the per-position form (a sum of each position's gradient norm), blind to cancellation between "
        "positions (docs/source/concepts/metrics.md). Means over seeds with "
        "95% t-intervals; differences from the baseline are seed-paired (the same seed gives both methods the same "
        "problems in the same order) with 95% paired t-intervals.",
        "",
    ]
    for task, per_method in study["tasks"].items():
        last = str(study["checkpoints"][-1]) if study["checkpoints"] else "run"
        lines += [f"### `{task}`", ""]
        titles = ["method", "n", *[f"held-out @{c}" for c in study["checkpoints"]],
                  *[f"{t} @{last}" for k, t, _ in COLUMNS if k != "heldout"], *[t for _, t, _ in RUN_COLUMNS]]
        lines += ["| " + " | ".join(titles) + " |", "|" + " --- |" * len(titles)]
        for entry in per_method.values():
            m = entry["metrics"]
            cells = [ci_text([x.get(str(c), {}).get("heldout") for x in m], 2) for c in study["checkpoints"]]
            cells += [ci_text([x.get(last, {}).get(k) for x in m], d) for k, _, d in COLUMNS if k != "heldout"]
            cells += [ci_text([x["run"].get(k) for x in m], d) for k, _, d in RUN_COLUMNS]
            never = sum(not x["run"]["reached_threshold"] for x in m)
            if never:
                cells[len(study["checkpoints"]) + len(COLUMNS) - 1] += f" ({never} never)"
            lines.append(f"| {entry['label']} | {len(m)} | " + " | ".join(cells) + " |")
        lines.append("")
        rows = [(method, entry) for method, entry in per_method.items() if entry.get("verdicts")]
        if rows:
            names = list(rows[0][1]["verdicts"])
            lines += ["| method − baseline | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
            for _, entry in rows:
                base = per_method[entry["baseline"]]["label"]
                cells = []
                for name in names:
                    v = entry["verdicts"][name]
                    digits = 1 if v["metric"] == "steps_to_threshold" else 3
                    cells.append(f"{diff_text(v['difference'], digits)}: {v['verdict']}")
                lines.append(f"| {entry['label']} − {base} | " + " | ".join(cells) + " |")
            lines.append("")
        if task in figures:
            lines += [f"![{task}]({figures[task]})", ""]
    lines += collapse_sentences(study)
    lines += verdict_sentences(study)
    lines += diagnostics_section(study, records or [])
    return lines


def collapse_sentences(study: dict[str, Any]) -> list[str]:
    """Where every run's equivalent set ended, whatever the method: the drift meter's first and last readings."""
    lines = []
    for task, per_method in study["tasks"].items():
        first, last, runs = [], [], 0
        for entry in per_method.values():
            for curve in entry["drift_curves"]:
                if curve:
                    runs += 1
                    first.append(curve[0]["set_entropy"])
                    last.append(curve[-1]["set_entropy"])
        if not runs:
            continue
        lines.append(
            f"* `{task}`, all {runs} runs: entropy on the equivalent forms (D3, at most ln 2 = 0.693) "
            f"{statistics.fmean(first):.3f} on average before training (range {min(first):.3f}–{max(first):.3f}), "
            f"{statistics.fmean(last):.3f} at step {study['steps']} (range {min(last):.3f}–{max(last):.3f})."
        )
    if lines:
        lines = ["**The equivalent set, every method together** (the drift meter before training and at the end):",
                 "", *lines, ""]
    return lines


def verdict_sentences(study: dict[str, Any]) -> list[str]:
    """One line per prediction: how its comparisons (method × task) resolved."""
    tally: dict[str, dict[str, list[str]]] = {}
    what: dict[str, str] = {}
    for task, per_method in study["tasks"].items():
        for entry in per_method.values():
            for name, v in (entry.get("verdicts") or {}).items():
                tally.setdefault(name, {}).setdefault(v["verdict"], []).append(f"{entry['label']} on `{task}`")
                what[name] = v["what"]
    if not tally:
        return []
    lines = ["**Verdicts** (each method against its baseline on each task; a comparison is \"resolved for\" when "
             "the 95% interval of the difference excludes 0 in the predicted direction, \"against\" when it excludes 0 "
             "in the other; a prediction is resolved when at least half of its comparisons are, all the same way, "
             "since with several comparisons per prediction one at 95% is within chance):", ""]
    for name, outcomes in tally.items():
        total = sum(len(v) for v in outcomes.values())
        fors, against = outcomes.get("resolved for", []), outcomes.get("resolved against", [])
        # One comparison in several resolving at 95% is what chance gives; the prediction resolves only when at
        # least half of its comparisons do, all in one direction.
        if fors and not against and 2 * len(fors) >= total:
            overall = "resolved for"
        elif against and not fors and 2 * len(against) >= total:
            overall = "resolved against"
        else:
            overall = "not resolved"
        detail = "; ".join(f"{k} in {len(v)} ({', '.join(v)})" if k != "not resolved" else f"{k} in {len(v)}"
                           for k, v in sorted(outcomes.items()))
        lines.append(f"* **{name}** ({what[name]}): **{overall}** over {total} comparisons — {detail}.")
    lines.append("")
    return lines


def plot_long_run(study: dict[str, Any], fig_dir: pathlib.Path, out: pathlib.Path) -> dict[str, str]:
    """One figure per task: each panel a metric over optimizer steps, mean over seeds with a min–max band."""
    if not study or not study.get("tasks"):
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = {}
    for task, per_method in study["tasks"].items():
        fig, axes = plt.subplots(2, 4, figsize=(20, 8))
        for ax, (what, title, ylabel) in zip(axes.flat, PANELS, strict=False):
            for entry in per_method.values():
                per_seed = seed_curves(entry, what)
                if not per_seed:
                    continue
                steps = sorted({s for curve in per_seed for s in curve})
                arr = np.array([[curve.get(s, np.nan) for s in steps] for curve in per_seed], dtype=float)
                with np.errstate(all="ignore"):
                    mean = np.nanmean(arr, 0)
                line = ax.plot(steps, mean, "-", lw=1.4, label=f"{entry['label']} (n={len(per_seed)})")[0]
                ax.fill_between(steps, np.nanmin(arr, 0), np.nanmax(arr, 0), color=line.get_color(), alpha=0.12,
                                lw=0)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        axes.flat[-1].axis("off")
        fig.suptitle(f"{task}: mean over seeds, band = min–max over seeds")
        fig.tight_layout()
        paths[task] = save_figure(fig, fig_dir, f"long_run_{task}.png", out, dpi=100)
    return paths


def seed_curves(entry: dict[str, Any], what: str) -> list[dict[int, float]]:
    """Per seed, {step: value} of one panel's metric (the reward smoothed with the EMA of eq. 19)."""
    if what == "heldout":
        return [{int(s): v for s, v in c} for c in entry["heldout_curves"] if c]
    if what in ("drift_abs", "set_entropy"):
        key = "log_odds_abs_mean" if what == "drift_abs" else "set_entropy"
        return [{p["step"]: p[key] for p in c} for c in entry["drift_curves"] if c]
    out = []
    for curve in entry["curves"].get(what, []):
        if not curve:
            continue
        values = [v for _, v in curve]
        if what == "step_reward":
            smooth, e = [], values[0]
            for v in values:
                e = 0.3 * v + 0.7 * e
                smooth.append(e)
            values = smooth
        elif what in SMOOTHED:
            width = SMOOTHED[what]
            values = [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]
        out.append({int(s): v for (s, _), v in zip(curve, values, strict=True) if math.isfinite(v)})
    return out


# ------------------------------------------------------------------------------------ what the study could see
FAILED_BELOW = 0.5  # held-out accuracy after training under which a run did not learn the answer format
PHI_ACTING = 0.95  # an off-policy step where the transform moved the weights: mean φ below this


def read_records(directory: pathlib.Path) -> list[dict[str, Any]]:
    """The per-run records of the study (``<task>__<method>__s<seed>.json.gz``)."""
    return [read_record(p) for p in sorted(directory.glob("*.json.gz"))]


def run_diagnostics(record: dict[str, Any]) -> dict[str, float | None]:
    """What one run's transform and clip actually did. A rollout's first step is where TRL logs ``reward``; the other
    steps are off-policy. The clip fraction among rows with Â ≠ 0 is estimated from the logged fraction over all rows
    divided by the share of rows in groups with reward variance (rows of zero-variance groups have Â = 0 and are
    never counted clipped)."""
    s = record.get("series", {})
    first = {int(step) for step, _ in s.get("reward", [])}
    zero_std = {int(step): v for step, v in s.get("frac_reward_zero_std", [])}
    rollout_zero, current = {}, None
    for step in sorted({int(st) for st, _ in s.get("grad_norm", [])}):
        current = zero_std.get(step, current)
        rollout_zero[step] = current
    phi = [v for st, v in s.get("transform/phi_mean", []) if int(st) not in first]
    clip = [(int(st), v) for st, v in s.get("clip_ratio/region_mean", []) if int(st) not in first]
    signal_clip = [v / (1 - rollout_zero[st]) for st, v in clip
                   if rollout_zero.get(st) is not None and rollout_zero[st] < 1]
    grads = [v for _, v in s.get("grad_norm", [])]
    two_sided = [v for _, v in s.get("cancellation/shared_prefix_residual_two_sided", [])]
    mean = statistics.fmean
    return {
        "phi_off_policy": mean(phi) if phi else None,
        "phi_acting_share": mean(v < PHI_ACTING for v in phi) if phi else None,
        "clip_off_policy": mean(v for _, v in clip) if clip else None,
        "clip_signal_rows": mean(signal_clip) if signal_clip else None,
        "zero_grad_share": mean(v == 0 for v in grads) if grads else None,
        "zero_variance_groups": mean(zero_std.values()) if zero_std else None,
        "two_sided_residual": mean(two_sided) if two_sided else None,
        "failed": ((record.get("heldout") or {}).get("after") or 0.0) < FAILED_BELOW,
    }


def paired_mde(difference: dict[str, Any], power: float = 0.8, alpha: float = 0.05) -> float | None:
    """The smallest true paired difference the comparison had ``power`` to detect at two-sided ``alpha``:
    (t_{1−α/2} + t_{power}) · SE, with SE recovered from the difference's 95% t-interval (n − 1 degrees of freedom)."""
    from scipy import stats

    n = difference.get("n") or 0
    if n < 2 or difference.get("low") is None:
        return None
    t95 = stats.t.ppf(0.975, n - 1)
    se = (difference["high"] - difference["low"]) / (2 * t95)
    return float((stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * se)


def diagnostics_section(study: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """Per task and method: the transform's φ, the clip among rows with signal, zero-gradient steps, failures, the
    two-sided residual; then each comparison's minimum detectable effect."""
    if not records or not study.get("tasks"):
        return []
    lines = ["**What the transforms did, and what the study could detect.** Means over each method's runs (φ and "
             "clip over off-policy steps; \"acting\": share of those steps with mean φ < "
             f"{PHI_ACTING}; clip among rows with Â ≠ 0 estimated from the all-row fraction and the zero-variance "
             "groups; a run failed when its "
             f"held-out accuracy after training was below {FAILED_BELOW}):", ""]
    titles = ["task", "method", "φ off-policy", "acting", "clip, all rows", "clip, rows with Â ≠ 0",
              "zero-gradient steps", "zero-variance groups", "two-sided residual", "failed"]
    lines += ["| " + " | ".join(titles) + " |", "|" + " --- |" * len(titles)]

    def cell(values: list[Any], digits: int = 3) -> str:
        values = [v for v in values if v is not None]
        return f"{statistics.fmean(values):.{digits}f}" if values else "–"

    for task, per_method in study["tasks"].items():
        for method, entry in per_method.items():
            diags = [run_diagnostics(r) for r in records if r["task"] == task and r["method"] == method]
            if not diags:
                continue
            lines.append("| " + " | ".join([
                f"`{task}`", entry["label"], *(cell([d[k] for d in diags]) for k in (
                    "phi_off_policy", "phi_acting_share", "clip_off_policy", "clip_signal_rows", "zero_grad_share",
                    "zero_variance_groups", "two_sided_residual")),
                f"{sum(d['failed'] for d in diags)}/{len(diags)}"]) + " |")
    lines += ["", "Minimum detectable effect of each comparison (80% power, two-sided 5%, from its own paired "
              "spread): a comparison \"not resolved\" says only that no difference above this was detected.", ""]
    names: list[str] = []
    for per_method in study["tasks"].values():
        for entry in per_method.values():
            names += [n for n in (entry.get("verdicts") or {}) if n not in names]
    lines += ["| task | method − baseline | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 2)]
    for task, per_method in study["tasks"].items():
        for entry in per_method.values():
            verdicts = entry.get("verdicts") or {}
            if not verdicts:
                continue
            cells = []
            for name in names:
                v = verdicts.get(name)
                mde = paired_mde(v["difference"]) if v else None
                cells.append("–" if mde is None else f"{mde:.{1 if v['metric'] == 'steps_to_threshold' else 3}f}")
            base = per_method[entry["baseline"]]["label"]
            lines.append(f"| `{task}` | {entry['label']} − {base} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines
