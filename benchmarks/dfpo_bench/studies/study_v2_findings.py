"""Study v2 read again from its per-run records: the numbers RESULTS §11, README and docs/source/concepts/metrics.md
quote about what the study can and cannot say, computed here so that none is typed by hand.

    python -m dfpo_bench.studies.study_v2_findings            # -> benchmarks/results/study_v2_findings.json

Reads ``results/study_v2/`` (every pilot round's and the main stage's gzipped run records, gates, stage files and
the SD check) and ``results/study_v2.json`` (the comparisons). Pure functions of records; report_study_v2.py turns
the JSON into sentences.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]
from dfpo_bench.lib.common import read_record  # noqa: E402
from dfpo_bench.lib.stats import mde_t  # noqa: E402
from dfpo_bench.studies.count_effect import count_pairs, slope_interval, within_run_slope  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MAIN = "round2/s16_lr5e-5_n64/main"
MEMORY_ERRORS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")




def records(folder: pathlib.Path) -> list[dict[str, Any]]:
    return [read_record(p) for p in sorted((folder / "runs").glob("*.json*"))]


def learned_by_gain(record: dict[str, Any], gain: float) -> bool:
    """The rule the main stage used: complete and held-out accuracy after − before ≥ ``gain``."""
    heldout = record.get("heldout") or {}
    if not record.get("complete") or heldout.get("after") is None or heldout.get("before") is None:
        return False
    return heldout["after"] - heldout["before"] >= gain - 1e-9


def drift_at(record: dict[str, Any], step: int, key: str) -> float | None:
    """A drift-meter value at ``step`` (None when the record has no measurement there)."""
    return next((d[key] for d in (record.get("drift") or {}).get("curve") or [] if d["step"] == step), None)


def off_policy_values(record: dict[str, Any], key: str, rollout_steps: int) -> list[float]:
    """A per-step series on the steps that are not a rollout's first (step k is on-policy iff (k − 1) mod
    rollout_steps = 0, logging_steps 1)."""
    return [v for s, v in (record.get("series") or {}).get(key, []) if (int(s) - 1) % rollout_steps]


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def mass_and_credit(rows: list[dict[str, Any]], last_step: int) -> dict[str, Any]:
    """The rewarded set's probability at the last drift measurement (exp of set_logp_mean: the geometric mean over
    the meter's prompts) and how many learned runs end with held-out mean reward below 0.6."""
    masses = [math.exp(v) for r in rows if (v := drift_at(r, last_step, "set_logp_mean")) is not None]
    logp = [v for r in rows if (v := drift_at(r, last_step, "set_logp_mean")) is not None]
    logp0 = [v for r in rows if (v := drift_at(r, 0, "set_logp_mean")) is not None]
    entropy = [r["series"]["entropy"][-1][1] for r in rows if (r.get("series") or {}).get("entropy")]
    lost = sum(drift_at(r, last_step, "set_logp_mean") < drift_at(r, 0, "set_logp_mean") for r in rows
               if drift_at(r, last_step, "set_logp_mean") is not None and drift_at(r, 0, "set_logp_mean") is not None)
    return {"runs": len(rows), "set_mass_median": median_or_none(masses),
            "set_mass_above_half": sum(m > 0.5 for m in masses), "set_logp_final_median": median_or_none(logp),
            "set_logp_final_max": max(logp) if logp else None, "set_logp_step0_median": median_or_none(logp0),
            "set_logp_below_step0": lost, "token_entropy_final_median": median_or_none(entropy),
            "token_entropy_final_mean": statistics.fmean(entropy) if entropy else None,
            "heldout_below_0_6": sum(r["heldout"]["after"] < 0.6 for r in rows)}


def off_policy_signal(rows: list[dict[str, Any]], rollout_steps: int) -> dict[str, Any]:
    """Mean over complete runs of the mean over off-policy steps of the clipped share among rows with Â ≠ 0 and of the
    one-sided share among groups with signal (each step's value is pooled over that step's rows / groups)."""
    out: dict[str, Any] = {"runs": len(rows)}
    for name, key in (("clipped_share_signal_rows", "diagnostics/clip_fraction_signal"),
                      ("one_sided_share_signal_groups", "cancellation/one_sided_groups")):
        per_run = [statistics.fmean(v) for r in rows if (v := off_policy_values(r, key, rollout_steps))]
        out[name] = statistics.fmean(per_run) if per_run else None
    return out


def crashes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs without a complete record and how many of them ended on a CUDA memory-allocation error (log tail)."""
    failed = [r for r in rows if not r.get("complete")]
    memory = [r for r in failed if any(m in (r.get("log_tail") or "") for m in MEMORY_ERRORS)]
    return {"runs": len(rows), "failed": len(failed), "memory": len(memory),
            "out_of_memory": sum("OutOfMemoryError" in (r.get("log_tail") or "") for r in failed),
            "cublas_alloc": sum("CUBLAS_STATUS_ALLOC_FAILED" in (r.get("log_tail") or "") for r in failed),
            "which": sorted(f"{r['_design']} {r['method']} s{r['seed']}" for r in failed)}


def exploratory_count_effect(rows: list[dict[str, Any]], window: int) -> dict[str, Any]:
    """count_effect.py's slope on study v2's complete runs (windows between drift measurements `window` apart; one
    rollout each in the stale arms): exploratory, the analysis was chosen after the data were seen."""
    pairs: dict[str, dict[int, Any]] = {}
    for r in rows:
        if r.get("complete"):
            pairs.setdefault(r["method"], {})[int(r["seed"])] = count_pairs(r, window)
    out: dict[str, Any] = {a: slope_interval(p) for a, p in sorted(pairs.items()) if a != "anchor"}
    if "gspo" in pairs and "mr_w" in pairs:
        out["mr_w - gspo"] = slope_interval(pairs["mr_w"], pairs["gspo"])
    raw = {int(r["seed"]): count_pairs(r, window, surprise=False) for r in rows
           if r.get("complete") and r["method"] == "gspo"}
    out["raw_share"] = {"arm": "gspo", "within_runs": within_run_slope(list(raw.values())),
                        "across_runs": within_run_slope([[p for v in raw.values() for p in v]])}
    return out


def paired_sd(study: dict[str, Any], a: str = "mr_w", b: str = "gspo") -> dict[str, Any]:
    """SD over seeds of a − b in the primary metric (the same seed gives both arms the same problems): over all
    completed pairs and over pairs where both runs learned; study v3 sizes its seeds from such an SD."""
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for row in study["runs"]:
        by.setdefault(row["arm"], {})[row["seed"]] = row
    out = {}
    for name, keep in (("all_pairs", lambda r: r["complete"]), ("learned_pairs", lambda r: r["learned"])):
        d = [by[a][s]["auc_set_entropy"] - by[b][s]["auc_set_entropy"] for s in sorted(set(by[a]) & set(by[b]))
             if keep(by[a][s]) and keep(by[b][s]) and by[a][s]["auc_set_entropy"] is not None
             and by[b][s]["auc_set_entropy"] is not None]
        out[name] = {"n": len(d), "sd": statistics.stdev(d) if len(d) > 1 else None}
    return out


def rollouts(record: dict[str, Any], batch: int) -> dict[str, int]:
    """How a run generated: completions per rollout (per-device batch × steps_per_generation) and rollouts in the
    run (optimizer steps / optimizer steps per rollout)."""
    flags = (record.get("settings") or {}).get("flags") or []
    value = {f[2:]: int(flags[i + 1]) for i, f in enumerate(flags[:-1])
             if f in ("--steps_per_generation", "--gradient_accumulation_steps")}
    per_rollout = max(1, value["steps_per_generation"] // value["gradient_accumulation_steps"])
    return {"size": batch * value["steps_per_generation"], "count": record["steps"] // per_rollout}


def pilot_design(folder: pathlib.Path, gain: float) -> dict[str, Any]:
    """One round-2 pilot design: gspo's completed / learned / failed runs, the runs the φ gate averaged."""
    rows = records(folder / "pilot")
    gates = json.loads((folder / "gates.json").read_text())
    gspo = [r for r in rows if r["method"] == "gspo"]
    return {"design": gates["design"], "gspo_runs": len(gspo),
            "gspo_complete": sum(bool(r.get("complete")) for r in gspo),
            "gspo_learned": sum(learned_by_gain(r, gain) for r in gspo),
            "gspo_failed": sum(not r.get("complete") for r in gspo),
            "phi_gate_runs": gates["transform_moves_weights"]["runs"],
            "mr_w_runs": sum(r["method"] == "mr_w" for r in rows)}


def sd_check_timing(main: pathlib.Path) -> dict[str, Any]:
    """When the SD check ran against the main stage's launches: the first launch's log (main.log, written before the
    check) counts the runs it queued and those that ended; the second's (main2.log) how many were done when it
    started."""
    sd = json.loads((main / "sd_check.json").read_text())
    stage = json.loads((main / "stage.json").read_text())
    first, second = (main.parents[1] / name for name in ("main.log", "main2.log"))
    first_lines = first.read_text().splitlines() if first.exists() else []
    second_head = second.read_text().splitlines()[0] if second.exists() else ""
    return {"sd_check_written_at": sd["written_at"], "sd_check_first_seeds": sd["first"],
            "launches": stage["launches"],
            "first_launch_queued": int(first_lines[0].split()[0]) if first_lines else None,
            "first_launch_ended": sum(": exit " in line for line in first_lines),
            "done_before_second_launch": int(second_head.split("(")[1].split()[0]) if "already done" in second_head
            else None,
            "stage_commit": stage.get("commit"),
            "launcher_in_stage_commit": in_commit(stage.get("commit"), "benchmarks/study_v2.sh")}


def in_commit(commit: str | None, path: str) -> bool | None:
    """Whether ``path`` exists in ``commit`` of this repository (None when git cannot tell)."""
    import subprocess

    if not commit:
        return None
    try:
        done = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    return done.returncode == 0


def findings(results: pathlib.Path = RESULTS) -> dict[str, Any]:
    folder = results / "study_v2"
    main = folder / MAIN
    study = json.loads((results / "study_v2.json").read_text())
    gain = study["learned_gain"]
    design = study["design"]
    rollout_steps = max(1, design["steps_per_generation"] // design["grad_accum"])
    import yaml

    batch = int(yaml.safe_load((ROOT / design["recipe"]).read_text())["per_device_train_batch_size"])
    rows = records(main)
    arms = sorted({r["method"] for r in rows})
    learned_rows = {a: [r for r in rows if r["method"] == a and learned_by_gain(r, gain)] for a in arms}
    complete_rows = {a: [r for r in rows if r["method"] == a and r.get("complete")] for a in arms}
    round2 = [{**r, "_design": d.name} for d in sorted((folder / "round2").glob("s*_n*")) for r in records(d / "pilot")]
    return {
        "source": "benchmarks/results/study_v2 (per-run records) and study_v2.json; "
                  "benchmarks/dfpo_bench/studies/study_v2_findings.py",
        "learned_gain": gain, "last_step": design["steps"], "rollout_steps": rollout_steps,
        "mass_and_credit": {a: mass_and_credit(learned_rows[a], design["steps"]) for a in arms},
        "off_policy_signal": {a: off_policy_signal(complete_rows[a], rollout_steps) for a in arms if a != "anchor"},
        "rollouts": {a: rollouts(complete_rows[a][0], batch) for a in arms if complete_rows[a]},
        "mde_welch_t": {name: {"t": mde_t(c["welch"]["se"], c["welch"]["df"]), "z": c["welch"].get("mde_z"),
                               "df": c["welch"]["df"]}
                        for name, c in study["comparisons"].items() if c["welch"]},
        "paired_sd_mr_w_gspo": paired_sd(study),
        "count_effect_exploratory": exploratory_count_effect(rows, rollout_steps),
        "round2_pilot_crashes": crashes(round2),
        "round2_designs": {d.name: pilot_design(d, gain) for d in sorted((folder / "round2").glob("s*_n*"))},
        "sd_check": sd_check_timing(main),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--out", default=str(RESULTS / "study_v2_findings.json"))
    args = p.parse_args(argv)
    result = findings(pathlib.Path(args.results_dir))
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
