"""RESULTS.md's study v2 section, from results/study_v2.json, the pilots' selection files and the GPU drift-meter check,
and its figures (``figures/study_v2_<arm>.png``) from the main stage's run records in results/study_v2/.

Called by report.py; reads JSON only (every number below is computed from the files at generation time).
"""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from dfpo_bench.lib.common import load_json, read_record, save_figure

ARM_ORDER = ("anchor", "gspo", "mr_w", "mr_g", "scale")


def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def pilot_rounds(folder: pathlib.Path) -> list[tuple[str, dict[str, Any]]]:
    """(round name, selection.json) of each pilot round, in order."""
    return [(p.parent.name, load_json(p)) for p in sorted(folder.glob("round*/selection.json"))]


def pilot_table(selection: dict[str, Any], folder: pathlib.Path, round_name: str) -> list[str]:
    lines = ["| design (S, learning rate, steps) | `gspo` learned | rule | `mr_w` off-policy φ | gates |",
             "| --- | --- | --- | --- | --- |"]
    for name in selection["order"]:
        short = pathlib.Path(name).name
        gates = load_json(folder / round_name / short / "gates.json") or {}
        c = selection["candidates"][name]
        d, t = c["design"], gates.get("thresholds", {})
        rule = (f"gain ≥ {t['learned_gain']}" if t.get("learned_gain") is not None
                else f"after ≥ {t.get('learned_threshold')}")
        lines.append(f"| {d['steps_per_generation']}, {d['learning_rate']:g}, {d['steps']} | {c['gspo_learned'][0]}/"
                     f"{c['gspo_learned'][1]} | {rule} | {fmt(c['mr_w_phi_offpolicy'])} | "
                     f"{'passed' if c['passed'] else 'failed'} |")
    return lines


def learned(record: dict[str, Any], study: dict[str, Any]) -> bool:
    """The study's rule of "learned", as its aggregation applied it: complete, and held-out accuracy after − before ≥
    ``learned_gain`` when that is set, else after ≥ ``learned_threshold`` (1e-9 absorbs the accuracies' rounding)."""
    heldout = record.get("heldout") or {}
    after, before = heldout.get("after"), heldout.get("before")
    if not record.get("complete") or after is None:
        return False
    if study.get("learned_gain") is not None:
        return before is not None and after - before >= study["learned_gain"] - 1e-9
    return after >= study["learned_threshold"]


def arm_figures(study: dict[str, Any], folder: pathlib.Path, fig_dir: pathlib.Path, out: pathlib.Path
                ) -> dict[str, str]:
    """figures/study_v2_<arm>.png from the main stage's run records (``round*/*/main/runs``): every run's set-entropy
    curve (dotted: did not learn) and the learned runs' mean at the steps they all measured. The drawing of the
    retired ``study_v2.py``'s ``plot_arms`` (commit c0193fa), unchanged; arm -> path as RESULTS.md links it."""
    main = next(iter(sorted(folder.glob("round*/*/main"))), None)
    if main is None:
        return {}
    records = [read_record(p) for p in sorted((main / "runs").glob("*.json*"))]
    records.sort(key=lambda r: (ARM_ORDER.index(r["method"]), r["seed"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for arm in [a for a in ARM_ORDER if any(r["method"] == a for r in records)]:
        mine = [(curve, learned(r, study)) for r in records if r["method"] == arm
                and (curve := [(d["step"], d["set_entropy"]) for d in (r.get("drift") or {}).get("curve") or []])]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for curve, ok in mine:
            steps, values = zip(*curve, strict=True)
            ax.plot(steps, values, color="0.6", lw=0.7, ls="-" if ok else ":")
        good = [dict(curve) for curve, ok in mine if ok]
        shared = sorted(set.intersection(*(set(g) for g in good))) if good else []
        if shared:
            ax.plot(shared, [statistics.fmean(g[s] for g in good) for s in shared], color="C0", lw=2.2,
                    label=f"mean of {len(good)} learned runs")
            ax.legend(loc="best", fontsize=8)
        ax.set(xlabel="optimizer step", ylabel="set entropy (nats)",
               title=f"{arm}: {study['arms'][arm]['label']} ({len(mine)} runs; dotted: did not learn)")
        ax.title.set_fontsize(9)
        fig.tight_layout()
        paths[arm] = save_figure(fig, fig_dir, f"study_v2_{arm}.png", out, dpi=110)
    return paths


def study_v2_section(results: pathlib.Path, fig_dir: pathlib.Path, out: pathlib.Path, number: int) -> list[str]:
    study = load_json(results / "study_v2.json")
    if not study:
        return []
    folder, meter = results / "study_v2", load_json(results / "drift_meter_check_gpu.json")
    found = load_json(results / "study_v2_findings.json") or {}
    design, gates, arms = study["design"], study["gates"] or {}, study["arms"]
    state = study["stage_record"].get("gates") or {}
    seeds = {a: len(v) for a, v in study["stage_record"]["seeds"].items()}
    lines = [f"## {number}. Study v2: the equivalent-set test redone (`study_v2.py`, `study_v2.sh`)", "",
             "Its scripts are retired (study v3 supersedes it): `study_v2.py` was last at commit c0193fa, "
             "`study_v2.sh` at 72fe7e1 (`git show c0193fa:benchmarks/study_v2.py`); its results below are read from "
             "the files it wrote (benchmarks/README.md, study v2).", "",
             f"{', '.join(study['card'])} (4 of them, one `dfpo-train` process per run, 48 at a time), "
             f"{_versions(study)}, the corrected end token. Task `{study['task']}`, recipe `{design['recipe']}` with "
             f"transformers' generation, {design['steps']} optimizer steps, GSPO's sequence-level ratio and clip "
             "(ε 3e-4/4e-4), the drift meter every "
             f"{design['drift_every']} steps, held-out greedy accuracy (100 problems) before and after. Arms: "
             + "; ".join(f"`{a}` {arms[a]['label']}" for a in ARM_ORDER if a in arms)
             + f". Primary metric: {study['primary_metric']}. Learned: {_rule(study)}. Held-out \"accuracy\" is the "
             "mean reward: 1 for either canonical form, 0.5 for the right sum in any other wording, so a run at 0.5 "
             "writes the sum without the format.", ""]
    rounds = pilot_rounds(folder)
    if rounds:
        lines += ["**Pilots** (4 seeds per arm, one table per round; a design passes when `gspo` learned in ≥ "
                  f"{gates.get('thresholds', {}).get('min_learned_share')} of its runs and `mr_w`'s mean off-policy "
                  f"φ ≤ {gates.get('thresholds', {}).get('max_phi')}; the main design is the first in the listed "
                  "order that passes):", ""]
        for name, selection in rounds:
            lines += [f"{name.replace('round', 'Round ')}:", "", *pilot_table(selection, folder, name), ""]
        change = _round_rule_change(folder, rounds)
        lines += [*([change, ""] if change else []), _selection_sentence(rounds, study, state, found), ""]
    sd = _sd_check(folder, found)
    if sd:
        lines += [sd, ""]
    lines += [f"**Main stage** (seeds from 100; {', '.join(f'`{a}` {n}' for a, n in seeds.items())}; the gates file "
              f"was written before the stage started and is unchanged: {str(study['gates_before_stage']).lower()}; "
              f"`scale`'s κ = {fmt(study['kappa'])}, {study['kappa_source']}):", "",
              "| arm | runs | learned | did not learn | area mean ± SD (nats) | off-policy φ | clipped among Â ≠ 0 "
              "(all steps) | zero-gradient steps | one-sided among groups with signal (all steps) | zero-variance "
              "groups |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in ARM_ORDER:
        if a not in arms:
            continue
        e, g = arms[a], arms[a]["diagnostics"]
        lines.append(f"| `{a}` | {e['runs']} | {e['learned']} | {e['not_learned']} (failed {e['failed_or_short']}) | "
                     f"{fmt(e['auc_mean'])} ± {fmt(e['auc_sd'])} | {fmt(g['phi_offpolicy'])} | "
                     f"{fmt(g['clip_fraction'], 2)} | {fmt(g['zero_grad_share'], 3)} | {fmt(g['one_sided_groups'], 2)} "
                     f"| {fmt(g['zero_variance_groups'], 2)} |")
    lines += ["", "| comparison (learned runs) | difference [95% Welch interval] | n "
              "| MDE (80% power, t at Welch's df) | reading |",
              "| --- | --- | --- | --- | --- |"]
    for name, c in study["comparisons"].items():
        w = c["welch"]
        if w is None:
            lines.append(f"| {name} | – | – | – | {c['verdict']} |")
            continue
        reading = "detected" if w["low"] > 0 or w["high"] < 0 else f"not detected above {w['mde']:.3f}"
        lines.append(f"| {name} | {w['difference']:+.3f} [{w['low']:+.3f}, {w['high']:+.3f}] | {w['n'][0]}, "
                     f"{w['n'][1]} | {w['mde']:.3f} | {reading} |")
    for paragraph in _reading(study, meter, gates, found):
        lines += ["", paragraph]
    figures = arm_figures(study, folder, fig_dir, out)
    lines += [""]
    lines += [f"![{a}]({figures[a]})" for a in ARM_ORDER if a in figures] + [""]
    return lines


def _round_rule_change(folder: pathlib.Path, rounds: list[tuple[str, dict[str, Any]]]) -> str | None:
    """Why the rule of "learned" changed between the first pilot round and the next, from round 1's records."""
    if len(rounds) < 2:
        return None
    first, later = rounds[0][0], rounds[1][0]
    thresholds = [load_json(p)["thresholds"] for p in sorted((folder / first).glob("*/gates.json"))]
    first_label, later_label = (name.replace("round", "Round ") for name in (first, later))
    records = [read_record(p) for p in sorted((folder / first).glob("*/pilot/runs/*.gz"))]
    after = {arm: [r["heldout"]["after"] for r in records if r["method"] == arm] for arm in ("gspo", "anchor")}
    if not thresholds or not after["gspo"] or not after["anchor"]:
        return None
    threshold = thresholds[0]["learned_threshold"]
    later_gain = {load_json(p)["thresholds"].get("learned_gain") for p in sorted((folder / later).glob("*/gates.json"))}
    reached = {arm: sum(a >= threshold for a in values) for arm, values in after.items()}
    gains = ", ".join(str(g) for g in later_gain)
    return (f"{first_label} counted a run as learned at held-out accuracy ≥ {threshold}: {reached['gspo']} of its "
            f"{len(after['gspo'])} `gspo` runs got there (best {max(after['gspo']):.3f}), and {reached['anchor']} of "
            f"its {len(after['anchor'])} on-policy `anchor` runs (median {statistics.median(after['anchor']):.3f}). "
            f"The absolute rule was then replaced by a gain rule after {first_label}'s results were in: "
            f"{later_label}'s designs and its rule (a held-out gain of at least {gains}) were fixed in `study_v2.sh` "
            f"before {later_label} ran. The reason given there (held-out accuracy near 0.5 for every arm that learned) "
            "misreads 0.5: it is the partial credit for the right sum in another wording, not the format learned.")


def _sd_check(folder: pathlib.Path, found: dict[str, Any]) -> str | None:
    """The SD check over the main stage's first 10 seeds, as it was read (SDs and n only, no means), and when."""
    path = next(iter(sorted(folder.glob("round*/*/main/sd_check.json"))), None)
    sd = load_json(path) if path else None
    if not sd:
        return None
    sds = ", ".join(f"`{a}` {e['sd']:.3f}" for a, e in sd["sd"].items() if e["sd"] is not None)
    n = sd["n_per_arm"].get("mr_w - gspo")
    text = (f"**SD check** (first {sd['first']} main seeds, learned runs, no means shown): SD of the area {sds}; "
            f"{n} runs per arm would detect {sd['effect']} nats in `mr_w` − `gspo` at 80% power.")
    timing = found.get("sd_check")
    if timing and timing.get("first_launch_queued"):
        text += (f" It ran ({timing['sd_check_written_at']}) after the main stage's first launch, whose log records "
                 f"{timing['first_launch_ended']} of its {timing['first_launch_queued']} runs ending (every seed of "
                 "the design's minimum, 40 per primary arm), so those outcomes were on disk when the primary arms "
                 "were extended to 80 seeds each (the other arms kept at 10). The check shows no means; nothing "
                 "records whether a mean was read before the extension.")
    return text


def _versions(study: dict[str, Any]) -> str:
    v = next((r["versions"] for r in study["runs"] if r.get("versions")), {}) or {}
    return ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "trl") if k in v)


def _rule(study: dict[str, Any]) -> str:
    if study.get("learned_gain") is not None:
        return (f"held-out accuracy after − before ≥ {study['learned_gain']} (the gates' rule; runs that did not "
                "learn are counted, not averaged)")
    return f"held-out accuracy after ≥ {study['learned_threshold']}"


def _selection_sentence(rounds: list[tuple[str, dict[str, Any]]], study: dict[str, Any], state: dict[str, Any],
                        found: dict[str, Any]) -> str:
    passed = [n for _, s in rounds for n, c in s["candidates"].items() if c["passed"]]
    main = study["design"]
    text = ("No design passed both gates. " if not passed
            else f"Passed both gates: {', '.join(pathlib.Path(p).name for p in passed)}. ")
    crashes, designs = found.get("round2_pilot_crashes"), found.get("round2_designs") or {}
    if crashes:
        share = "all" if crashes["memory"] == crashes["failed"] else f"{crashes['memory']} of them"
        text += (f"{crashes['failed']} of round 2's {crashes['runs']} pilot runs (all {crashes['runs']} at once on the "
                 f"4 GPUs) crashed, {share} on a CUDA memory-allocation failure "
                 f"({crashes['out_of_memory']} `OutOfMemoryError`, {crashes['cublas_alloc']} "
                 f"`CUBLAS_STATUS_ALLOC_FAILED`): {', '.join(crashes['which'])}; the gates counted a crashed `gspo` "
                 "run as not learned and left crashed `mr_w` runs out of the φ gate. ")
    chosen = next((c for _, s in rounds for c in s["candidates"].values() if c["design"] == main), None)
    mine = next((d for d in designs.values() if d["design"] == main), None)
    if state.get("forced") and chosen:
        learned, runs = chosen["gspo_learned"]
        how = (f"{learned} of {runs}: the {mine['gspo_complete']} that completed all learned, the other crashed"
               if mine and mine["gspo_failed"] else f"{learned} of {runs}")
        text += (f"The main stage ran on S {main['steps_per_generation']}, learning rate {main['learning_rate']:g} "
                 f"with `--force`, recorded in its stage file: the first design of round 2's order, whose transform "
                 f"acted (φ {fmt(chosen['mr_w_phi_offpolicy'])}) and whose `gspo` learned in {how}. The gate outcome "
                 "stands as recorded (false); how the main stage's `gspo` runs learned is in the table below.")
    short = [f"S {name[1:].split('_')[0]}'s φ gate was read on {d['phi_gate_runs']} of its {d['mr_w_runs']} `mr_w` runs"
             for name, d in designs.items() if d["phi_gate_runs"] < d["mr_w_runs"]]
    if short:
        text += " " + "; ".join(short) + " (the others crashed)."
    timing = found.get("sd_check") or {}
    if timing.get("stage_commit") and timing.get("launcher_in_stage_commit") is False:
        text += (f" Every stage file records commit {timing['stage_commit'][:7]} (`git rev-parse HEAD` of the "
                 "launching checkout), which does not contain `study_v2.sh`, the script that launched the pilots: the "
                 "checkout held uncommitted changes, so the records do not name the code that ran (run records now "
                 "carry the commit and a dirty flag read when each run starts).")
    return text


def _reading(study: dict[str, Any], meter: dict[str, Any] | None, gates: dict[str, Any], found: dict[str, Any]
             ) -> list[str]:
    arms, comparisons = study["arms"], study["comparisons"]
    mass, signal, roll = found.get("mass_and_credit") or {}, found.get("off_policy_signal") or {}, found.get("rollouts")
    out = []
    primary = comparisons.get("mr_w - gspo", {}).get("welch")
    if primary:
        text = (f"**Primary** (`mr_w` − `gspo`, {primary['n'][0]} and {primary['n'][1]} learned runs): "
                f"{primary['difference']:+.3f} nats [{primary['low']:+.3f}, {primary['high']:+.3f}] in the area "
                "under the equivalent-set entropy curve: "
                + ("a difference detected." if primary["low"] > 0 or primary["high"] < 0 else
                   f"not detected above {primary['mde']:.3f} nats (80% power; `gspo`'s mean area is "
                   f"{fmt(arms['gspo']['auc_mean'], 2)}, and ln 2 = 0.693 is the most two forms can have)."))
        if signal.get("gspo") and signal.get("mr_w"):
            g, w = signal["gspo"], signal["mr_w"]
            text += (f" The transform moved the weights (mean off-policy φ "
                     f"{fmt(arms['mr_w']['diagnostics']['phi_offpolicy'])}, an average over every row, clipped and "
                     "zero-advantage ones included) but could act on a minority of the groups with signal: on "
                     f"off-policy steps {_pct(g['clipped_share_signal_rows'])} (`gspo`) and "
                     f"{_pct(w['clipped_share_signal_rows'])} (`mr_w`) of the rows with Â ≠ 0 were clipped (in the "
                     "ratio form a clipped row has no gradient whatever its weight), and in "
                     f"{_pct(g['one_sided_share_signal_groups'])} and {_pct(w['one_sided_share_signal_groups'])} of "
                     "the groups with signal the surviving rows were one-sided, where no weighting can cancel (mean "
                     "over runs of the mean over off-policy steps).")
        out.append(text)
    if mass.get("gspo") and mass.get("mr_w"):
        g, w = mass["gspo"], mass["mr_w"]
        out.append(f"**What the set entropy measures here.** At step {found['last_step']} the two rewarded forms "
                   f"held a median {_pct(g['set_mass_median'], 1)} (`gspo`) and {_pct(w['set_mass_median'], 1)} "
                   "(`mr_w`) of the probability over learned runs (the drift meter's set probability, a geometric "
                   f"mean over its prompts); more than half in {g['set_mass_above_half']} of {g['runs']} and "
                   f"{w['set_mass_above_half']} of {w['runs']}. Set entropy is then the relative odds of two forms "
                   f"the policy rarely writes. \"Learned\" is mostly partial credit: {g['heldout_below_0_6']} of "
                   f"{g['runs']} learned `gspo` and {w['heldout_below_0_6']} of {w['runs']} learned `mr_w` runs end "
                   "with held-out mean reward below 0.6.")
    anchor = comparisons.get("gspo - anchor", {}).get("welch")
    if anchor:
        detected = anchor["low"] > 0 or anchor["high"] < 0
        text = (f"**`gspo` − `anchor`**: {anchor['difference']:+.3f} [{anchor['low']:+.3f}, {anchor['high']:+.3f}] "
                f"({anchor['n'][0]} and {anchor['n'][1]} learned runs; MDE {anchor['mde']:.3f}): "
                + ("the on-policy anchor ended with less equivalent-set entropy than stale GSPO, but not by "
                   "collapsing onto one rewarded form." if detected else f"not detected above {anchor['mde']:.3f}."))
        a, g = mass.get("anchor"), mass.get("gspo")
        if a and g:
            text += (f" {a['set_logp_below_step0']} of its {a['runs']} learned runs ended with the rewarded set's "
                     f"log-probability below its value before training (median {a['set_logp_final_median']:.1f} "
                     f"nats at step {found['last_step']} against {g['set_logp_final_median']:.1f} for `gspo`, "
                     f"{a['set_logp_step0_median']:.1f} before; median final token entropy "
                     f"{a['token_entropy_final_median']:.2f} against {g['token_entropy_final_median']:.2f}): they left "
                     "the rewarded set, and their low set entropy is that of two forms neither of which they write.")
        if roll and "anchor" in roll and "gspo" in roll:
            text += (f" The anchor also differs from `gspo` in more than the coupling term: {roll['anchor']['count']} "
                     f"rollouts of {roll['anchor']['size']} against {roll['gspo']['count']} of "
                     f"{roll['gspo']['size']}, and it clips nothing (its ratios are 1). This comparison is "
                     "therefore no measurement of a count effect and does not isolate the term.")
        out.append(text)
    count = found.get("count_effect_exploratory") or {}
    if count.get("gspo") and count.get("mr_w"):
        g, w, d, raw = count["gspo"], count["mr_w"], count.get("mr_w - gspo"), count.get("raw_share") or {}
        text = ("**Exploratory** (an analysis chosen after the data were seen: to test, not to claim; "
                "`count_effect.py`): the within-run slope of the change in log-odds (sum vs answer) between two drift "
                "measurements on the rollout's sampling surprise (its sampled share of the sum form among rewarded "
                "completions minus the share the odds predicted) was "
                f"{g['slope']:+.2f} [{g['low']:+.2f}, {g['high']:+.2f}] for `gspo` and "
                f"{w['slope']:+.2f} [{w['low']:+.2f}, {w['high']:+.2f}] for `mr_w` (95% intervals resampling runs)")
        if d:
            text += f", `mr_w` − `gspo` {d['slope']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]"
        excludes = [f"`{a}`" for a, e in (("gspo", g), ("mr_w", w)) if e["low"] > 0 or e["high"] < 0]
        text += (". A positive slope is a count effect (the form sampled more gains log-odds); the interval excludes "
                 f"0 for {' and '.join(excludes) if excludes else 'neither arm'}"
                 + (", and the estimate is not smaller under Min-Replace." if d and d["slope"] >= 0 else "."))
        if raw.get("within_runs") is not None:
            text += (f" The estimate depends on the analysis: on the raw share (not corrected for the odds) the "
                     f"`gspo` slope is {raw['within_runs']:+.2f} within runs and {raw['across_runs']:+.2f} across "
                     "them. Study v3 pre-registers the surprise estimator and adds arms that equalise the counts.")
        out.append(text)
    others = [f"`{n}`: {c['welch']['difference']:+.3f} [{c['welch']['low']:+.3f}, {c['welch']['high']:+.3f}], not "
              f"detected above {c['welch']['mde']:.3f}" for n, c in comparisons.items()
              if n not in ("mr_w - gspo", "gspo - anchor") and c["welch"]
              and not (c["welch"]["low"] > 0 or c["welch"]["high"] < 0)]
    if others:
        out.append("Secondary arms (10 seeds each; MDEs with t at Welch's df): " + "; ".join(others) + ".")
    out.append("Runs that did not learn: " + ", ".join(f"`{a}` {arms[a]['not_learned']}/{arms[a]['runs']}"
                                                       for a in ARM_ORDER if a in arms) + " (counts, no test).")
    b = (gates.get("transform_moves_weights") or {})
    gate_b = f"φ gate (pilot `mr_w` off-policy φ {fmt(b.get('phi_offpolicy_mean'))} ≤ " \
             f"{gates.get('thresholds', {}).get('max_phi')}): {str(b.get('passed')).lower()}"
    if meter:
        out.append(f"Gates recorded: meter gate (`drift_meter_check_gpu.json`, {meter['device']}: set log-probability "
                   f"{meter['meter_set_logp_mean']:.2f} against the log sampled frequency "
                   f"{meter['log_sampled_frequency']:.2f}, within {meter['gate_nats']} nat): "
                   f"{str(meter['gate_passed']).lower()}; {gate_b}; baseline-learns gate: "
                   f"{str((gates.get('baseline_learns') or {}).get('passed')).lower()}.")
    if found:
        out.append("What this study can say: in this setting (rewarded forms holding a few per cent of the "
                   "probability, the transform acting on a minority of the groups with signal) no change of the area "
                   "by Min-Replace as large as the MDE was detected; the setting gave the paper's mechanism little "
                   "room to act, so the study neither confirms nor rules the mechanism out. The numbers of the "
                   "Primary, set-entropy and `gspo` − `anchor` paragraphs are recomputed from the run records by "
                   "`study_v2_findings.py` (`results/study_v2_findings.json`). Study v3 (§13, `studies/study_v3.py`) "
                   "tested it in a setting where it can act.")
    return out


def _pct(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"
