"""RESULTS.md's section on study v4 part 1 (``dfpo_bench.studies.study_v4``): the paired branch test and its positive
control. Every number is read from ``results/study_v4.json``, which is ``study_v4.py --analyse`` of the trajectory
files in ``results/study_v4/<run>/records.tgz`` (a test holds the two equal), and from the run's ``plan.json``; the
registered design is read from ``study_v4.PREREGISTRATION``. Called by ``benchmarks/dfpo_bench/reports/report.py``."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from dfpo_bench.lib import record_layers
from dfpo_bench.lib.common import load_json, save_figure
from dfpo_bench.lib.stats import cluster_bootstrap_ols, mde_t
from dfpo_bench.studies.study_v4 import PREREGISTRATION

# The run the analysis reads (records.tgz, then one records_N.tgz layer per later session: lib/record_layers.py), and
# per session the commit whose sources ran it: provenance.source_sha256 of a checkout of that commit equals the
# records' source_sha256 (each checked when the results came back); the records' own commit is the device copy's
# base, the session's starting commit.
RUN_FOLDER = "study_v4/gpu_2026-11-29"
RUN_COMMITS = {  # source_sha256 (first 12 hex digits) -> the commit it is the hash of
    "6a411b3804c6": "77524bd",  # 2026-11-29, first session: pilot, plan, 16 main and 4 control trajectories
    "440be7845963": "ee6b6e4",  # 2026-11-29, second session (two GPUs): 14 more main trajectories
    "e1220b2355a5": "a625e13",  # 2026-11-29, third session (two GPUs): the last 5 main and 43 control trajectories
    "5661e59ec77a": "5ac5424",  # 2026-11-29, fourth session (two GPUs): the last 27 control trajectories
}
EXCLUDED = {  # earlier GPU folders, not analysed (benchmarks/README.md, "Study v4", says why in full)
    "study_v4/gpu_2026-11-28": "a broken probe (every paired effect read 0; fixed since)",
    "study_v4/gpu_2026-11-28b": "a pilot stopped by hand when the device time ran out (crashes; a meter check only)",
}
SHOWN = 1.0  # the scatter's vertical range is ±SHOWN; points beyond it are drawn on its edge
HEAVY = 0.6  # "large I" in the same-step sentence


def fmt(value: float | None, digits: int = 3, sign: bool = False) -> str:
    return "–" if value is None else f"{value:{'+' if sign else ''}.{digits}f}"


def interval(entry: dict[str, Any] | None, digits: int = 4) -> str:
    if not entry:
        return "–"
    return f"{entry['value']:+.{digits}f} [{entry['low']:+.{digits}f}, {entry['high']:+.{digits}f}]"


def holds_zero(entry: dict[str, Any] | None) -> bool:
    return entry is None or entry["low"] <= 0 <= entry["high"]


def scatter(analysis: dict[str, Any], fig_dir: pathlib.Path, out: pathlib.Path) -> str | None:
    """figures/study_v4_branch_scatter.png: each analysed branch point's relative oriented effect against the
    imbalance I at that point (main: dots, the positive control: crosses), with the pooled least-squares line the
    co-primary reports."""
    settings = analysis["settings"]
    if not any(entry.get("point_columns") for entry in settings.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    beyond = 0
    for name, marker in (("main", "o"), ("control", "x")):
        columns = (settings.get(name) or {}).get("point_columns")
        if not columns:
            continue
        xs, ys = columns["imbalance"], columns["relative"]
        beyond += sum(abs(y) > SHOWN for y in ys)
        shown = [max(-SHOWN, min(SHOWN, y)) for y in ys]
        ax.scatter(xs, shown, marker=marker, s=12 if marker == "o" else 22, alpha=0.6, linewidths=0.8,
                   label=f"{name} ({len(xs)} points, {settings[name]['trajectories']} trajectories)")
    slope, intercept = analysis.get("slope"), analysis.get("intercept")
    if slope and intercept:
        top = max(max(e["point_columns"]["imbalance"]) for e in settings.values() if e.get("point_columns"))
        ax.plot([0, top], [intercept["value"], intercept["value"] + slope["value"] * top], color="k", lw=1,
                label=f"pooled fit: slope {slope['value']:+.3f}, intercept {intercept['value']:+.3f}")
    ax.axhline(0, color="grey", lw=0.6)
    ax.set(xlabel="imbalance I at the branch point (share of the advantage mass)",
           ylabel="relative oriented effect (GSPO − MR)", ylim=(-1.08 * SHOWN, 1.08 * SHOWN),
           title=f"Study v4 branch test ({beyond} points beyond ±{SHOWN:g} drawn on the edge)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, fig_dir, "study_v4_branch_scatter.png", out, dpi=110)


def residual_pairs(columns: dict[str, list[Any]]) -> list[tuple[float, float]]:
    """(GSPO's residual, Min-Replace's) at every point where the meter defined both."""
    return [(a, b) for a, b in zip(columns["residual_none"], columns["residual_min_replace"], strict=True)
            if a is not None and b is not None]


def residual_figure(analysis: dict[str, Any], fig_dir: pathlib.Path, out: pathlib.Path) -> str | None:
    """figures/study_v4_residuals.png: each branch point's shared-prefix residual after Min-Replace's step against
    the one after GSPO's (the residual before the transform), with the diagonal (no change)."""
    pairs = {name: residual_pairs(e["point_columns"]) for name, e in analysis["settings"].items()
             if e.get("point_columns")}
    if not any(pairs.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    for name, marker in (("main", "o"), ("control", "x")):
        if pairs.get(name):
            ax.scatter(*zip(*pairs[name], strict=True), marker=marker, s=12 if marker == "o" else 22, alpha=0.6,
                       linewidths=0.8, label=f"{name} ({len(pairs[name])} points)")
    top = max(max(a, b) for ps in pairs.values() for a, b in ps)
    ax.plot([0, top], [0, top], color="k", lw=0.8, label="no change")
    ax.set(xlabel="residual, GSPO's step (before the transform)", ylabel="residual, Min-Replace's step (after)",
           title="Shared-prefix residual per branch point")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return save_figure(fig, fig_dir, "study_v4_residuals.png", out, dpi=110)


def checkouts_sentence(runs: list[dict[str, Any]]) -> str:
    """Which code ran, one clause per source hash in the sessions' order (``RUN_COMMITS``'s; a hash it does not list
    comes last): how many trajectories, the commit that hash is of, and the commit the records name."""
    by_source: dict[str, dict[str, Any]] = {}
    for run in runs:
        checkout = run.get("checkout") or {}
        entry = by_source.setdefault(str(checkout.get("source_sha256", "?"))[:12], {"n": 0, "named": set()})
        entry["n"] += run.get("trajectories", 0)
        entry["named"].add((str(checkout.get("commit", "?"))[:7], bool(checkout.get("dirty"))))
    sessions = list(RUN_COMMITS)
    order = sorted(by_source, key=lambda h: sessions.index(h) if h in sessions else len(sessions))
    clauses = [f"{by_source[h]['n']} under source hash {h}… (the hash of "
               f"`{RUN_COMMITS.get(h, 'an unlisted commit')}`; the records name "
               + ", ".join(f"commit {c}" + (" with uncommitted changes" if d else "")
                           for c, d in sorted(by_source[h]["named"])) + ")" for h in order]
    return (f"The trajectories ran under {len(by_source)} checkout{'s' if len(by_source) != 1 else ''}: "
            + "; ".join(clauses) + " (the device copies the session's working tree onto the commit the session "
            "started from; `benchmarks/dfpo_bench/lib/provenance.py` computes the hash).")


def power_word(reached: float | None, target: float) -> str:
    """Where the MDE a stage reached stands against the registered target MDE (smaller is more power)."""
    if reached is None:
        return "not known against"
    return "at or below" if reached <= target else "above"


def points_per_trajectory(name: str) -> int:
    """Branch points of one trajectory of a registered setting: S of every S + 1 optimizer steps."""
    s = PREREGISTRATION["settings"][name]
    return s["staleness"] * (s["steps"] // (s["staleness"] + 1))


def identical_steps(columns: dict[str, list[Any]]) -> list[bool]:
    """Per point: did the two arms take the same step (equal pre-clip gradient norms, a paired probe effect of
    exactly 0)?"""
    return [g == 1.0 and r == 0.0 for g, r in zip(columns["grad_norm_ratio"], columns["relative"], strict=True)]


def pulled(with_them: float, without_them: float) -> str:
    """Which way a subset of points moved a slope: ``with_them`` fitted on every point, ``without_them`` on the
    rest."""
    if with_them * without_them < 0:
        return "across 0"
    if abs(with_them) == abs(without_them):
        return "neither way"
    return "towards 0" if abs(with_them) < abs(without_them) else "away from 0"


def exploratory_fits(settings: dict[str, Any]) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """Not registered: the co-primary's fit on subsets of the analysed points, read from the point columns. "all" is
    the registered pooled fit recomputed (it equals the analysis's slope and intercept), "without same-step points"
    leaves out the points where both arms took the same step (:func:`identical_steps`), and each setting alone shows
    which setting's points carry the pooled slope (the settings differ in I and in everything else). Each is (slope,
    intercept) with the analysis's own cluster bootstrap (study_v4.analyse: 4000 draws, seed 0), from the clusters'
    sums."""
    subsets: dict[str, dict[str, list[tuple[float, float]]]] = {
        "all": {}, "without same-step points": {}, **{name: {} for name in settings}}
    for name, e in settings.items():
        columns = e.get("point_columns")
        if not columns:
            continue
        for trajectory, term, effect, same in zip(columns["trajectory"], columns["imbalance"], columns["relative"],
                                                  identical_steps(columns), strict=True):
            for subset in ("all", name) + (() if same else ("without same-step points",)):
                subsets[subset].setdefault(f"{name}/{trajectory}", []).append((term, effect))
    return {subset: cluster_bootstrap_ols(points) for subset, points in subsets.items() if points}


def study_v4_section(results: pathlib.Path, fig_dir: pathlib.Path, out: pathlib.Path, number: int) -> list[str]:
    analysis = load_json(results / "study_v4.json")
    if not analysis:
        return []
    plan = load_json(results / RUN_FOLDER / "plan.json") or {"settings": {}}
    settings, coverage = analysis["settings"], analysis["coverage"]
    main, control = settings.get("main") or {}, settings.get("control") or {}
    runs = analysis["provenance"]
    registrations = {json.dumps(r.get("registration"), sort_keys=True) for r in runs}
    registration = (runs[0].get("registration") or {}) if len(registrations) == 1 else {}
    mde = PREREGISTRATION["mde"]
    figure = scatter(analysis, fig_dir, out)
    residuals = residual_figure(analysis, fig_dir, out)
    lines = [f"## {number}. Study v4, part 1: the paired branch test and its positive control "
             "(`studies/branch_test.py`, `studies/study_v4.py`)", "",
             f"Card: {', '.join(sorted({str(r.get('card')) for r in runs}))}; versions "
             f"{', '.join(f'{k} {v}' for k, v in sorted((runs[0].get('versions') or {}).items())) if runs else '–'}; "
             "float32 weights, TF32 off. " + checkouts_sentence(runs) + " "
             + (f"Every trajectory admitted the same registration, `{str(registration.get('sha256', '?'))[:8]}…` "
                f"({'tracked and clean' if registration.get('tracked') and registration.get('clean') else 'NOT clean'}"
                f", committed in {str(registration.get('commit', '?'))[:7]})." if registration else
                f"The trajectories admitted {len(registrations)} different registrations (see `provenance` in the "
                "analysis).")
             + " Records: " + record_layers.describe(results, RUN_FOLDER, "pilot and main trajectory files, logs, "
                                                     "the plan") + ", analysis: `results/study_v4.json`.", "",
             "**Design** (registered before the runs; benchmarks/README.md, \"Study v4, part 1\"): from a GSPO "
             "trajectory, at every step whose next micro-batch is j ≥ 1 steps stale, two trainers loaded with "
             "bit-identical weights and AdamW state each take one real optimizer step on that micro-batch, GSPO and "
             "Min-Replace; the paired change in the probe prompts' log-odds is oriented by the direction the policy "
             "moved since the rollout (predicted > 0: GSPO moves further that way) and read relative to GSPO's own "
             "movement. "
             + "; ".join(f"`{n}`: S = {s['staleness']}, lr {s['learning_rate']:g}, ε {s['epsilon']:g}/"
                         f"{s['epsilon_high']:g}, {s['steps']} steps" for n, s in PREREGISTRATION["settings"].items())
             + ".", "",
             "**What ran.** The pilot (seeds "
             f"{', '.join(map(str, PREREGISTRATION['pilot_seeds']))} of each setting) sized the main stage by the "
             "registered rule; pilot points are not analysed. The main stage ran under a deadline fixed before it "
             "began (the device time left), not by its data: trajectories never started are not crashes and carry no "
             "data.", "",
             "| setting | planned (points) | complete | crashed | never started | analysed points | points without "
             "signal | pilot: SD × √deff, ρ, points per trajectory |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in PREREGISTRATION["settings"]:
        c, e, p = coverage.get(name) or {}, settings.get(name) or {}, (plan["settings"].get(name) or {})
        lines.append(f"| {name} | {c.get('planned', '–')} ({p.get('points', '–')}) | {c.get('complete', '–')} | "
                     f"{c.get('crashed', '–')} | {c.get('not_started', '–')} | {e.get('points', '–')} | "
                     f"{e.get('no_signal_points', '–')} | {fmt(p.get('sd'))}, {fmt(p.get('rho'))}, "
                     f"{fmt(p.get('points_per_trajectory'), 1)} |")
    lines += ["", "Relative oriented effect (GSPO − Min-Replace, a share of GSPO's own per-step movement of the probe "
              "log-odds; ratio of means over points, 95% interval resampling whole trajectories) and the term's "
              "size at the branch points:", "",
              "| setting | effect [95%] | MDE reached (2.8 SE) | registered target MDE | GSPO's movement (nats) | "
              "mean I | I at j = S | removed share | clipped share |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    present = [(name, settings[name]) for name in PREREGISTRATION["settings"] if settings.get(name)]
    for name, e in present:
        m = e["means"]
        lines.append(f"| {name} | {interval(e['primary_relative'])} | {fmt(e['mde_relative'], 4)} | "
                     f"{mde['relative_effect']:g} | {fmt(e['gspo_move_mean'])} | {fmt(m['imbalance'])} | "
                     f"{fmt(e['imbalance_at_S'])} | {fmt(m['removed_share'])} | {fmt(m['clipped_share'])} |")
    slope, intercept = analysis.get("slope"), analysis.get("intercept")
    half = None if not slope else (slope["high"] - slope["low"]) / 2
    lines += ["", "Secondary (paired GSPO − Min-Replace unless said; intervals resampling trajectories, not adjusted "
              "for multiplicity):", "",
              "| setting | \\|log-odds\\| after the step | set log-mass after the step (nats) | shared-prefix "
              "residual: GSPO → MR | gradient norm MR / GSPO | A/A repeats (largest \\|Δ\\|) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, e in present:
        r = e["residual"]
        lines.append(f"| {name} | {interval(e['abs_log_odds'])} | {interval(e['set_logp'])} | "
                     f"{fmt(r.get('none'))} → {fmt(r.get('min_replace'))} | {fmt(e['grad_norm_ratio'])} | "
                     f"{e['aa_points']} ({fmt(e['aa_floor_max'], 4)}) |")
    gate = control.get("gate") or {}
    lines += ["", "**What the data support.**", ""]
    if main:
        p = main["primary_relative"]
        reached = main["mde_relative"]
        planned_main = plan["settings"].get("main") or {}
        lines.append(
            f"* Primary (main setting): {interval(p)} of GSPO's own movement. "
            + (f"**Not detected above {reached:.4f}** (the MDE reached, 2.8 bootstrap SE as registered; with "
               f"Student's t on {p['clusters'] - 1} degrees of freedom, one fewer than the trajectories, it would "
               f"be {mde_t(p['se'], p['clusters'] - 1):.4f})" if holds_zero(p) else
               f"**Detected** ({'in the predicted direction' if p['value'] > 0 else 'against the prediction'})")
            + f"; the registered target MDE was {mde['relative_effect']:g}, and the MDE reached is "
            + power_word(reached, mde["relative_effect"]) + " it"
            + f", with {coverage['main']['complete']} of the {coverage['main']['planned']} planned trajectories. "
            f"The plan, from the pilot's SD inflated × 2 and × √deff as registered, expected an MDE of "
            f"{fmt(planned_main.get('mde_at_n'), 4)} at its {planned_main.get('points', '–')} points; the bootstrap's "
            f"at the {main['points']} points that ran is {reached:.4f}, that is "
            f"{reached * main['gspo_move_mean']:.4f} nats of the probe log-odds per step. At these branch points the "
            f"term was small: mean I {main['means']['imbalance']:.3f}, removed share "
            f"{main['means']['removed_share']:.3f}.")
    if control:
        p = control["primary_relative"]
        pilot_control = plan["settings"].get("control", {}).get("points_per_trajectory", 0.0)
        main_stage_control = control["points"] / max(control["trajectories"], 1)
        lines.append(
            f"* Positive control: its registered gate (mean GSPO imbalance at j = S ≥ {gate.get('min')}) "
            + ("was **reached**" if gate.get("passed") else "was **not reached**")
            + f", {fmt(gate.get('value'))}. Its effect {interval(p)}: "
            + (f"not detected above {control['mde_relative']:.4f} ({mde_t(p['se'], p['clusters'] - 1):.4f} with "
               f"Student's t on {p['clusters'] - 1} degrees of freedom)" if holds_zero(p) else "detected")
            + f", from {coverage['control']['complete']} of its {coverage['control']['planned']} planned "
            f"trajectories; the MDE reached is {power_word(control['mde_relative'], mde['relative_effect'])} the "
            f"registered target {mde['relative_effect']:g}. The plan asked for the registered maximum of points "
            f"from {pilot_control:.1f} of each trajectory's {points_per_trajectory('control')} branch points with a "
            f"group with signal in the pilot; the main stage's trajectories had {main_stage_control:.1f} "
            f"({control['points']} of {control['points'] + control['no_signal_points']}).")
    if slope and intercept:
        lines.append(
            f"* Co-primary: the slope of the per-point relative effect on I, main and control pooled, "
            f"{interval(slope, 3)} per unit of I (half-width {half:.3f}; registered target "
            f"{mde['slope_half_width']:g}), intercept {interval(intercept, 3)}. "
            + ("The effect did not grow detectably with the term"
               if holds_zero(slope) else "The effect grew with the term, as predicted" if slope["value"] > 0 else
               "The effect fell as the term grew, against the prediction")
            + ("; the intercept's interval holds 0." if holds_zero(intercept) else
               "; the intercept is not 0, where the registration predicted it near 0: extrapolated to a term of 0, "
               f"the fit has {'GSPO' if intercept['value'] > 0 else 'Min-Replace'}'s step moving the forms further "
               f"along the drift, by {abs(intercept['value']):.1%} of GSPO's movement."))
    for name, e in present:
        for key, what, unit in (("abs_log_odds", "left the forms' |log-odds| larger", ""),
                                ("set_logp", "left the rewarded set more log-mass", " nats")):
            if holds_zero(e[key]):
                continue
            larger = "GSPO's" if e[key]["value"] > 0 else "Min-Replace's"  # the pair is GSPO − Min-Replace
            lines.append(f"* Secondary, {name}: {larger} step {what}, by {abs(e[key]['value']):.4f}{unit} "
                         f"(GSPO − MR {interval(e[key])}); one of the {2 * len(settings)} secondary intervals above, "
                         "unadjusted, not a registered prediction.")
    counts, heavy = {}, []  # heavy: (same step?, clipped share) of every point with I > HEAVY
    for name, e in settings.items():
        columns = e.get("point_columns")
        if columns:
            same = identical_steps(columns)
            counts[name] = (sum(same), sum(x and i > 0 for x, i in zip(same, columns["imbalance"], strict=True)))
            heavy += [(x, c) for x, i, c in zip(same, columns["imbalance"], columns["clipped_share"], strict=True)
                      if i > HEAVY]
    if any(n for n, _ in counts.values()):
        clipped = [c for x, c in heavy if x]
        lines.append(
            "* Where both arms took the same step (pre-clip gradient norms equal to the last bit, probe effect "
            "exactly 0): " + ", ".join(f"{name} {n} points ({k} of them with I > 0)" for name, (n, k) in
                                       counts.items())
            + (f". {len(clipped)} of the {len(heavy)} points with I > {HEAVY:g} were such points, with "
               f"{min(clipped):.0%}–{max(clipped):.0%} of their rows with signal clipped" if clipped else "")
            + ". At such a point every row that carried gradient already had its group's minimum weight, so "
            "Min-Replace lowered only rows without gradient (in the ratio form a clipped row has none). I counts "
            "every row's post-clip weight, gradient or not, so it can overstate what the transform can change; "
            "these points sit at large I with an effect of exactly 0.")
    fits, parts = exploratory_fits(settings), []
    without = fits.get("without same-step points", (None, None))
    if slope and any(n for n, _ in counts.values()) and without[0] and without[1]:
        parts.append(f"without the same-step points, slope {interval(without[0], 3)}, intercept "
                     f"{interval(without[1], 3)} (so those points pulled the pooled slope "
                     + pulled(slope["value"], without[0]["value"]) + ")")
    if len(settings) > 1:
        for name in settings:
            alone, at_zero = fits.get(name, (None, None))
            if alone and at_zero:
                parts.append(f"{name} alone, slope {interval(alone, 3)}, intercept {interval(at_zero, 3)}"
                             + ("" if holds_zero(alone) or holds_zero(at_zero) else
                                f" (its fit crosses 0 at I = {-at_zero['value'] / alone['value']:.2f})"))
    if parts:
        lines.append("* Not registered (exploratory, the co-primary's fit and resampling on subsets of the same "
                     "points, unadjusted): " + "; ".join(parts) + ".")
    changes = {name: residual_pairs(e["point_columns"]) for name, e in settings.items() if e.get("point_columns")}
    if any(changes.values()):
        lines.append(
            "* Per branch point, the shared-prefix residual after Min-Replace's step against GSPO's (defined where "
            "some position is shared by every member of a group with signal): "
            + "; ".join(f"{name}: lower at {sum(b < a for a, b in ps)}, equal at {sum(b == a for a, b in ps)}, "
                        f"higher at {sum(b > a for a, b in ps)} of {len(ps)}" for name, ps in changes.items() if ps)
            + ". Under this setting's `loss_type grpo` each row's loss is divided by its own length, so "
            "Min-Replace's balanced weights cancel a shared token exactly only in a group whose rows with gradient "
            "have equal lengths and none clipped (part 3 uses `dr_grpo` for this reason).")
    aa = [e for e in settings.values() if e.get("aa_points")]
    if aa and all(e["aa_floor_max"] == 0 for e in aa):
        lines.append(f"* The {sum(e['aa_points'] for e in aa)} A/A repeats of the GSPO step read exactly 0: on this "
                     "GPU in float32 with TF32 off the step is deterministic, so no paired difference above is the "
                     "device's nondeterminism. "
                     + ("Every branch started bit-identical (every weight and AdamW tensor)."
                        if all(e["identical_starts"] for e in settings.values()) else
                        "**Not every branch started bit-identical.**"))
    lines.append(f"* Crashes: {len(analysis['crashes'])}"
                 + (f" ({', '.join(analysis['crashes'])}; their points enter only "
                    "`sensitivity_with_crashed_points`)" if analysis["crashes"] else "") + ".")
    lines.append("* Not analysed: " + "; ".join(f"`results/{k}/`, {v}" for k, v in EXCLUDED.items()) + ".")
    long_run = load_json(results / "study_v4_long.json")
    lines.append("* Part 3 (the long run from a balanced warm start, `studies/study_v4_long.py`): "
                 + (f"section {number + 1}." if long_run else "registered, no run yet, so no long-run curves."))
    lines += ["", f"Figures: `{figure}`, each analysed point's relative effect against I, with the pooled fit"
              + (f"; `{residuals}`, each point's residual after Min-Replace's step against GSPO's." if residuals
                 else ".") if figure else "No figure (no analysed points).", ""]
    if figure:
        lines += [f"![branch effect against the term]({figure})", ""]
    if residuals:
        lines += [f"![shared-prefix residual per branch point]({residuals})", ""]
    return lines
