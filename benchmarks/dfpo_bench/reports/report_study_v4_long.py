"""RESULTS.md's section on study v4 part 3 (``dfpo_bench.studies.study_v4_long``): the long run with room to drift.
Every number is read from the analyses in :data:`RUNS` (the current registration's first, then the superseded
revision's), each ``study_v4_long.py --analyse`` of the run folder packed in ``results/<run>/records.tgz`` and its
later layers (``dfpo_bench.lib.record_layers``; a slow test holds them equal); the registered design is the one each
analysis names. Called by ``benchmarks/dfpo_bench/reports/report.py``."""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Any

from dfpo_bench.lib import record_layers
from dfpo_bench.lib.common import load_json, save_figure
from dfpo_bench.lib.stats import fmt
from dfpo_bench.studies.study_v4_long import ARMS, PREREGISTRATION, STEPS

RUNS = (  # analysis file, run folder, figure: the current registration's run first
    ("study_v4_long.json", "study_v4_long/gpu_2026-11-29_r2", "study_v4_long_curves.png"),
    ("study_v4_long_r1.json", "study_v4_long/gpu_2026-11-29", "study_v4_long_r1_curves.png"),
)
LABELS = {"anchor": "anchor (on-policy)", "gspo": "GSPO (stale)", "mr_w": "Min-Replace (stale)"}


def paired_cell(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "–"
    return (f"{entry['difference']:+.3f} [{entry['low']:+.3f}, {entry['high']:+.3f}], n {entry['n']}, "
            f"MDE {entry['mde']:.3f}")


def curves_figure(analysis: dict[str, Any], fig_dir: pathlib.Path, out: pathlib.Path, name: str) -> str | None:
    """figures/<name>: per arm, the mean over complete runs of the normalised set entropy (the primary's integrand)
    and of the set mass, at every drift measurement, for the main stage and (a row below) the pilot, with the
    registered gate's threshold and the gate's own reading at step 0."""
    rows = [(stage, c) for stage, c in (("main stage", analysis.get("curves") or {}),
                                        ("pilot", analysis.get("pilot_curves") or {})) if any(c.values())]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 2, figsize=(9, 3.4 * len(rows)), squeeze=False)
    gate = (analysis.get("start_check") or {}).get("gate") or {}
    threshold = (analysis.get("start_check") or {}).get("threshold")
    for (stage, curves), (left, right) in zip(rows, axes, strict=True):
        for arm in ARMS:
            points = curves.get(arm) or []
            if not points:
                continue
            steps = [p["step"] for p in points]
            n = max(p["n"] for p in points)
            left.plot(steps, [p["set_entropy_normalised"] for p in points], label=f"{LABELS[arm]}, {n} runs")
            right.plot(steps, [p["set_mass"] for p in points], label=LABELS[arm])
        left.axhline(threshold, color="grey", lw=0.6, ls="--", label=f"registered start gate ≥ {threshold:g}")
        if gate.get("set_entropy_normalised") is not None:
            left.scatter([0], [gate["set_entropy_normalised"]], marker="*", color="k", zorder=3,
                         label="the gate's own reading")
        left.set(xlabel="optimizer step", ylabel="normalised set entropy", ylim=(-0.02, 1.02),
                 title=f"{stage}: the two forms' entropy (mean over seeds)")
        right.set(xlabel="optimizer step", ylabel="set mass exp(set log-prob)", ylim=(0, 1),
                  title=f"{stage}: mass on the two correct forms")
        left.legend(fontsize=7)
        right.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, fig_dir, name, out, dpi=110)


def spread(values: list[float]) -> str:
    return f"{min(values):.0f}–{max(values):.0f} s (median {statistics.median(values):.0f})" if values else "–"


def study_v4_long_section(results: pathlib.Path, fig_dir: pathlib.Path, out: pathlib.Path, number: int
                          ) -> list[str]:
    """The section: the current registration's run, then each superseded revision's as a subsection."""
    lines: list[str] = []
    for i, (analysis_file, run_folder, figure_name) in enumerate(RUNS):
        analysis = load_json(results / analysis_file)
        if not analysis:
            continue
        if not lines:
            lines += [f"## {number}. Study v4, part 3: a long run with room to drift (`studies/study_v4_long.py`)",
                      ""]
        if i:
            reg = analysis.get("preregistered") or {}
            lines += [f"### {number}.{i}. Revision {reg.get('revision', 1)} (superseded)", ""]
        lines += [*run_lines(analysis, analysis_file, records_text(results, run_folder), figure_name, fig_dir, out),
                  ""]
    return lines[:-1]


def records_text(results: pathlib.Path, run_folder: str) -> str:
    """Where the run folder's records are: its archives in unpacking order (with what the later ones hold), or that
    the repository lacks them."""
    return record_layers.describe(results, run_folder, "the run folder without model weights: the warm start's "
                                  "records, the pilot's and the main stage's run records and logs, the plan")


def run_lines(analysis: dict[str, Any], analysis_file: str, records: str, figure_name: str,
              fig_dir: pathlib.Path, out: pathlib.Path) -> list[str]:
    plan, coverage, start = analysis.get("plan") or {}, analysis["coverage"], analysis["start_check"]
    rule, pilot_pair = plan.get("rule") or {}, plan.get("pilot_primary_pair") or {}
    provenance = analysis["provenance"]
    gate, reg = start["gate"], analysis.get("preregistered") or PREREGISTRATION
    tried = ((analysis.get("stage") or {}).get("warmstart") or {}).get("tried") or []
    figure = curves_figure(analysis, fig_dir, out, figure_name)
    checkouts = [json.loads(p) for p in provenance]
    states = [c.get("checkout") or {} for c in checkouts]
    dirty = any(c.get("dirty") is not False for c in states)
    lines = [f"Card: {', '.join(sorted({str(c.get('card')) for c in checkouts}))}; every pilot and main-stage run "
             f"under {'one checkout' if len(states) == 1 else f'{len(states)} checkouts (one per session)'}: "
             + "; ".join(f"commit {str(c.get('commit', '?'))[:7]}"
                         + ("" if c.get("dirty") is False else " with uncommitted changes")
                         + f", source hash {str(c.get('source_sha256', '?'))[:12]}…" for c in states)
             + (" (the GPU machine's copy of the repository keeps the session's first commit and carries the later "
                "ones as changes; the source hash says which code ran, and benchmarks/README.md, \"Study v4, part "
                "3\", names the commit each hash equals)" if dirty else "")
             + "; registration "
             f"`{analysis['registration_sha256'][:8]}…` (revision {reg.get('revision', 1)}"
             + ("" if analysis.get("registration_is_current") else ", since revised: benchmarks/README.md, "
                "\"Study v4, part 3\", \"Revision 2\"")
             + f"). Records: {records}, analysis: `results/{analysis_file}`. Design: benchmarks/README.md, "
             "\"Study v4, part 3\" "
             f"(two-digit addition in two equal-length forms, `dr_grpo`, G = 8, 32 completions per step, "
             f"{STEPS} optimizer steps; arms: anchor "
             "on-policy, GSPO and Min-Replace 4 steps per rollout).", ""]
    lines += ["**What ran.**", ""]
    attempts = [(t["epochs"], t.get("gate") or {}) for t in tried]
    lines.append("* Warm start: " + "; ".join(
        f"{epochs} epoch{'s' if epochs != 1 else ''}: normalised set entropy "
        f"{fmt(g.get('set_entropy_normalised'))}, format mass {fmt(g.get('format_mass'))}, "
        f"{'passed' if g.get('passed') else 'failed'}" for epochs, g in attempts)
        + f" (gate: entropy ≥ {reg['warmstart']['gate']['set_entropy_normalised_min']:g}, format mass "
        f"≥ {reg['warmstart']['gate']['format_mass_min']:g}).")
    pilot = analysis["pilot_arms"]
    lines.append(
        "* Pilot: " + ", ".join(f"{a} {pilot[a]['complete']}" for a in ARMS) + " complete runs, crashes: "
        f"{sum(len(pilot[a]['crashed']) for a in ARMS)}. Its gate: mean training reward over the first "
        f"{reg['pilot_gate']['reward_first_window']} steps {fmt(plan.get('reward_first_mean'))} (registered range "
        f"[{reg['pilot_gate']['reward_min']:g}, {reg['pilot_gate']['reward_max']:g}]), "
        f"{'go' if plan.get('go') else 'stop: ' + str(plan.get('reason'))}. The pilot's paired primary "
        f"(Min-Replace − GSPO) {paired_cell(pilot_pair)}; the rule's planning SD {fmt(rule.get('planning_sd'))} "
        f"(3.3 × {fmt(rule.get('pilot_sd'))}) asked for {rule.get('n', '–')} main seeds per arm"
        + (f", the cap, where the MDE would be {fmt(rule.get('mde_at_n'))} against the registered "
           f"{reg['mde']:g}" if rule.get("capped") else "") + ".")
    lines.append(
        f"* Main stage: {coverage['complete']} of {coverage['planned']} planned runs complete, "
        f"{coverage['crashed']} crashed, "
        + (f"{coverage['not_started']} never started (a session's device time ended first; a run not started is "
           "not a crash and carries no value)" if coverage["not_started"] else "every planned run started")
        + f"; {coverage['complete_pairs_primary']} complete Min-Replace/GSPO pairs.")
    wall = analysis["wall_s"]
    at_a_time = analysis.get("at_a_time") or {}
    lines.append("* Wall time per run on the card: " + "; ".join(
        f"{stage} ({', '.join(str(k) for k in at_a_time.get(stage) or []) or '?'} at a time): "
        + ", ".join(f"{LABELS[a]} {spread(wall[stage][a])}" for a in ARMS)
        for stage in ("pilot", "main") if any(wall[stage].values())) + ".")
    replay, layings = analysis.get("warmstart_replay"), analysis.get("warmstart_layings") or {}
    sessions = [x for x in layings.get("layings") or [] if x["folder"] != "replay/warmstart"]
    later = layings.get("all_identical") is not None and len(sessions) > 1
    if replay:
        lines.append("* The warm start laid a second time on the same card, beside the pilot: "
                     + ", ".join(f"{k} {'the same weights' if e['identical'] else 'OTHER weights'} (SHA-256 "
                                 f"{str(e['replay'])[:12]}…)" for k, e in replay["entries"].items())
                     + (". A later session that lays it again continues the stages if its laying hashes the same "
                        "(the stage checks before it launches anything)." if replay["all_identical"] and not later
                        else "."))
    if later:
        lines.append(
            f"* The warm start laid in {len(sessions)} sessions (started "
            + ", ".join(str(x["started_at"])[:16].replace("T", " ") for x in sorted(
                sessions, key=lambda x: str(x["started_at"]))) + " UTC), each from its own fresh machine, "
            + ("every epoch count's weights hashing the same in every laying, the replay included: the later "
               "sessions' runs started from the first session's weights." if layings["all_identical"] else
               "NOT hashing the same in every laying."))
    held = all(st["threshold_reread_passed"] for st in start["stages"].values())
    lines += ["", f"**Did the arms start where the gate measured?** {'Yes' if held else 'No'}.", ""]
    for stage, s in start["stages"].items():
        lines.append(
            f"* {stage}: all {s['runs']} runs read the same step-0 numbers ({s['distinct_step0_entropy']} distinct "
            f"value): normalised set entropy {fmt(s['step0_entropy_min'])}, set log-mass "
            f"{fmt(s['step0_set_logp_min'])} nats; the gate, on the same prompts in the warm-start process, read "
            f"{fmt(gate['set_entropy_normalised'])} and {fmt(gate['set_logp_mean'])} nats. The registered threshold "
            f"re-read on the runs' own step 0: {'passed' if s['threshold_reread_passed'] else 'FAILED'}.")
    if not held:
        lines += ["", "So the runs did not start from the balanced state the gate certified. Why is in "
                  "benchmarks/README.md, \"Study v4, part 3\", \"The hand-off\". The comparisons below are what "
                  "the records hold; they are not the registered test of a balanced start.", ""]
    else:
        lines.append("")
    lines += ["**Comparisons** (main stage, paired by seed; 95% paired t interval, MDE at 80% power, two-sided "
              "α 0.05; not adjusted for multiplicity):", "",
              "| measure | Min-Replace − GSPO (primary on the first row) | anchor − GSPO | Min-Replace − anchor |",
              "| --- | --- | --- | --- |"]
    names = {"primary": "area under the normalised set entropy (primary)", "final_entropy": "final normalised "
             "entropy", "mass_weighted_area": "mass-weighted entropy area", "set_mass_final": "final set mass",
             "heldout_after": "held-out greedy accuracy after"}
    for key, label in names.items():
        row = analysis["comparisons"][key]
        lines.append(f"| {label} | {paired_cell(row['mr_w - gspo'])} | {paired_cell(row['anchor - gspo'])} | "
                     f"{paired_cell(row['mr_w - anchor'])} |")
    res = analysis["residual_mean"]
    prim = analysis["primary"]
    split = analysis.get("residual_by_clipping") or {}

    def part(arm: str, kind: str) -> str:
        e = (split.get(arm) or {}).get(kind) or {}
        largest = "–" if e.get("max") is None else f"{e['max']:.2g}"
        return f"{fmt(e.get('mean'), 3)} over {e.get('steps', 0)} steps (largest {largest})"

    lines += ["", "Shared-prefix residual, mean over logged steps: "
              + ", ".join(f"{LABELS[a]} {fmt(res.get(a))}" for a in ARMS)
              + ". Split by whether any row of the step was clipped (a clipped row carries no gradient, so no "
              "transform of the weights can restore the group's cancellation there): where none was, GSPO "
              f"{part('gspo', 'unclipped')} and Min-Replace {part('mr_w', 'unclipped')}, its exact cancellation up "
              f"to float error; where some row was, GSPO {part('gspo', 'clipped')} and Min-Replace "
              f"{part('mr_w', 'clipped')}. Under `dr_grpo` the on-policy anchor reads "
              f"{fmt(((split.get('anchor') or {}).get('unclipped') or {}).get('max'), 3)} at every step.", ""]
    if figure:
        lines += [f"![long-run curves]({figure})", ""]
    lines += ["**What the data support.**", ""]
    if prim:
        lines.append(
            f"* Primary: Min-Replace − GSPO {prim['difference']:+.3f} [{prim['low']:+.3f}, {prim['high']:+.3f}] over "
            f"{prim['n']} seeds: " + (f"not detected above {prim['mde']:.3f}, the MDE these {prim['n']} pairs reach"
                                      if prim["low"] <= 0 <= prim["high"] else "detected")
            + f" (registered target {reg['mde']:g}; "
            + (f"{coverage['not_started']} planned runs were never started)."
               if coverage["not_started"] else "every planned run started: the registered test).")
            + ("" if held else " And the start it was measured from is not the registered one (above)."))
    curves = analysis["curves"]
    collapse = {a: next((p["step"] for p in curves[a] if p["set_entropy_normalised"] < 0.1), None) for a in ARMS}
    if all(collapse[a] is not None for a in ARMS):
        lines.append("* The forms collapsed in every arm: the main stage's mean normalised entropy fell below 0.1 by "
                     "step " + ", ".join(f"{collapse[a]} ({LABELS[a]})" for a in ARMS)
                     + f", from the runs' step-0 reading of {fmt(curves['gspo'][0]['set_entropy_normalised'])}, so "
                     "the area is decided in the first few tens of steps.")
    else:
        lines.append("* The main stage's mean normalised entropy first fell below 0.1 at step "
                     + ", ".join(f"{collapse[a] if collapse[a] is not None else 'never'} ({LABELS[a]})"
                                 for a in ARMS) + ".")
    early = analysis.get("exploratory_early_entropy") or {}
    if any(early.values()):
        lines.append("* Exploratory, not registered: Min-Replace − GSPO in the normalised entropy at the early drift "
                     "steps, paired by seed over every complete pilot and main-stage pair (not adjusted for the "
                     f"{len(early)} looks): " + "; ".join(f"step {k} {paired_cell(v)}" for k, v in early.items())
                     + ".")
    crashed = coverage["crashed"] + sum(len(pilot[a]["crashed"]) for a in ARMS)
    lines.append("* Nothing crashed." if not crashed else f"* Crashes: {crashed} runs (pilot "
                 + ", ".join(f"{a} {pilot[a]['crashed']}" for a in ARMS) + "; main "
                 + ", ".join(f"{a} {analysis['arms'][a]['crashed']}" for a in ARMS) + "), counted, never values.")
    return lines
