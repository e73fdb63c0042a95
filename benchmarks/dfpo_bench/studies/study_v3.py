"""Study v3: equivalent-solution drift where DFPO's transform can act, with the count effect as its own test.

    python -m dfpo_bench.studies.study_v3 --preregister   # the gates and designs -> results/study_v3/preregistered.json
    # on one GPU: pilot of every design in the pre-registered order (4 seeds per arm), then the gates per design
    python -m dfpo_bench.studies.study_v3 --stage pilot --model /root/models/smollm2-135m-instruct --out-dir /tmp/v3 \
        --parallel 8 --deadline-s 540                  # repeat until nothing is left; writes OUT/pilot_gates.json
    python -m dfpo_bench.studies.study_v3 --stage main --model /root/models/smollm2-135m-instruct --out-dir /tmp/v3 \
        --parallel 8 --deadline-s 540                  # refused unless a design passed every gate
    bash benchmarks/dfpo_bench/studies/study_v3_gpu.sh /tmp/v3 MODEL "0 1 2 3"  # unattended: pilot, gates, main
    python -m dfpo_bench.studies.study_v3 --aggregate /tmp/v3   # -> results/study_v3.json, figures/study_v3_<arm>.png
    python -m dfpo_bench.studies.study_v3 --smoke --out-dir /tmp/study-v3-smoke   # CPU: tiny model, 2 steps

Design (benchmarks/README.md, "Study v3"; fixed in :data:`PREREGISTERED` before any pilot ran). Task ``strict``
(study_v3_tasks.py: both canonical forms 1, other wordings 0; held-out accuracy = format accuracy). Every arm has GSPO's
sequence ratio, ``scale_rewards none`` (TRL's advantage r − mean r, which the count control needs exactly) and the
design's clip ε and S (optimizer steps per rollout); they differ in (:func:`arm_flags`): ``anchor`` on-policy
(gradient accumulation = steps_per_generation = S: one step per rollout of the same size, same ε); ``gspo`` stale;
``mr_w`` stale Min-Replace; ``gspo_eq`` / ``mr_w_eq`` the same with the two forms' counts among each group's rewarded
completions equalised (task ``equalised``): a 2 × 2 of the paper's term (transform) and the count term (equalising).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import statistics
import time
from typing import Any

from dfpo_bench.lib import common  # noqa: E402 - the launcher (one dfpo-train process per run, records with their checkout)
from dfpo_bench.lib.provenance import checkout_state  # noqa: E402
from dfpo_bench.lib.stats import mde_t, t_ppf  # noqa: E402
from dfpo_bench.reports import report_study_v3  # noqa: E402 - the per-arm figures, drawn as RESULTS.md shows them
from dfpo_bench.studies.count_effect import count_pairs, slope_interval  # noqa: E402

ROOT = common.ROOT
RESULTS = ROOT / "benchmarks" / "results" / "study_v3"
TASKS = {"strict": "dfpo_bench.study_v3_tasks:strict", "equalised": "dfpo_bench.study_v3_tasks:equalised"}
ARMS = {"anchor": ("strict", "none", True), "gspo": ("strict", "none", False), "mr_w": ("strict", "min_replace", False),
        "gspo_eq": ("equalised", "none", False), "mr_w_eq": ("equalised", "min_replace", False)}
PREREGISTERED: dict[str, Any] = {
    "designs": [  # the pilot's order; the main stage runs the first that passes every gate
        {"name": "s4_eps3e-3", "rollout_steps": 4, "epsilon": 3e-3, "epsilon_high": 4e-3},
        {"name": "s4_eps1e-2", "rollout_steps": 4, "epsilon": 1e-2, "epsilon_high": 1.2e-2},
        {"name": "s2_eps1e-2", "rollout_steps": 2, "epsilon": 1e-2, "epsilon_high": 1.2e-2},
    ],
    "steps": 64, "learning_rate": 5e-5, "pilot_seeds": [0, 1, 2, 3], "main_seed_start": 100,
    "gates": {
        "baseline_set_mass_min": 0.5,  # median over gspo pilot runs of the rewarded set's probability at the end
        "anchor_set_mass_min": 0.5,  # the on-policy anchor stays on the rewarded set
        "one_sided_share_max": 0.3,  # off-policy steps: one-sided among groups with signal (gspo, mr_w)
        "clipped_share_max": 0.3,  # off-policy steps: clipped among rows with Â ≠ 0 (gspo, mr_w)
        "learned_format_accuracy": 0.8,  # "learned": held-out format accuracy at the end ≥ this
        "baseline_learned_share_min": 0.75,  # of completed gspo pilot runs
        "min_completed_per_arm": 3,  # a gate read on fewer completed pilot runs fails
    },
    "primary": "paired by seed (same prompts in every arm): mr_w − gspo in the run's mean of the mass-weighted set "
               "entropy (set_entropy × exp(set_logp_mean) at each drift measurement, trapezoid / step span); "
               "co-primary analyses: all completed pairs, and pairs where both runs learned",
    "secondary": ["the same for |log-odds| (log_odds_abs_mean)", "gspo_eq − gspo, mr_w_eq − mr_w, anchor − gspo"],
    "count_effect": "confirmatory (count_effect.py): the within-run pooled slope of the change in log-odds (sum vs "
                    "answer) between two drift measurements on the sampling surprise (the sampled share of the sum "
                    "form among rewarded completions minus σ(log-odds at the start)), 95% interval resampling "
                    "seeds (2000 draws, seed 0); predicted > 0 in gspo and mr_w, and gspo − gspo_eq > 0 and "
                    "mr_w − mr_w_eq > 0 (paired by seed): equalising the counts removes it",
    "mde": 0.05, "power": 0.8, "alpha": 0.05,
    "seeds": "main seeds per arm: the smallest n whose paired MDE (t) from the pilot's paired SD of the primary metric "
             "is ≤ mde, at least 10",
    "crashes": "a run without a complete record is a crash, counted as such, never as not learned",
    "parallel": 8,  # at most this many runs at once on one GPU (v2 ran 12 per GPU and lost 6 of 48 to CUDA memory)
}


# Round 2, registered after round 1's pilot failed every design's gates (results/study_v3/round1/pilot_gates.json:
# one-sided share 0.49-0.66 and clipped share 0.35-0.55 among signal rows, above 0.3 in every design) and before any
# round-2 run: the same gates, arms, steps and analysis; designs with a wider clip and/or a smaller learning rate, so
# that fewer rows leave the clip range between a rollout and its second step. Same order rule: the main stage runs
# the first design that passes every gate.
ROUND_2: dict[str, Any] = {
    **PREREGISTERED, "round": 2,
    "designs": [
        {"name": "r2_s2_eps3e-2", "rollout_steps": 2, "epsilon": 3e-2, "epsilon_high": 4e-2},
        {"name": "r2_s2_eps1e-2_lr2e-5", "rollout_steps": 2, "epsilon": 1e-2, "epsilon_high": 1.2e-2,
         "learning_rate": 2e-5},
        {"name": "r2_s2_eps3e-2_lr2e-5", "rollout_steps": 2, "epsilon": 3e-2, "epsilon_high": 4e-2,
         "learning_rate": 2e-5},
        {"name": "r2_s2_eps1e-1", "rollout_steps": 2, "epsilon": 1e-1, "epsilon_high": 1.2e-1},
    ],
}
# Round 3, registered after round 2's pilot (results/study_v3/round2/pilot_gates.json) and before any round-3 run:
# no design passed; a wider clip lowered the one-sided share (0.24 at ε 0.1) but at lr 5e-5 the baseline left the
# rewarded set (mass 0.20), while lr 2e-5 kept it there (0.76-0.95) with one-sided shares 0.39-0.53. So: the wide clip
# at the small learning rate. Same gates, arms, steps and analysis; the first design that passes runs the main stage.
ROUND_3: dict[str, Any] = {
    **PREREGISTERED, "round": 3,
    "designs": [
        {"name": "r3_s2_eps1e-1_lr2e-5", "rollout_steps": 2, "epsilon": 1e-1, "epsilon_high": 1.2e-1,
         "learning_rate": 2e-5},
        {"name": "r3_s2_eps2e-1_lr2e-5", "rollout_steps": 2, "epsilon": 2e-1, "epsilon_high": 2.4e-1,
         "learning_rate": 2e-5},
    ],
}
REGISTRATIONS = {1: PREREGISTERED, 2: ROUND_2, 3: ROUND_3}
REGISTRATION_FILES = {1: RESULTS / "preregistered.json", 2: RESULTS / "preregistered_round2.json",
                      3: RESULTS / "preregistered_round3.json"}


def preregistration_sha(round_: int = 1) -> str:
    return hashlib.sha256(json.dumps(REGISTRATIONS[round_], sort_keys=True).encode()).hexdigest()


def check_preregistered(path: pathlib.Path = RESULTS / "preregistered.json", round_: int = 1) -> None:
    """SystemExit unless the committed pre-registration equals the script's (the gates were fixed before the pilot
    and are the ones the script applies)."""
    if not path.exists() or json.loads(path.read_text()).get("sha256") != preregistration_sha(round_):
        raise SystemExit(f"{path} is missing or differs from study_v3's round {round_} registration: the gates are "
                         "fixed before any pilot; run --preregister and commit the file before launching")


# ------------------------------------------------------------------------------------------------ flags
def arm_flags(arm: str, design: dict[str, Any]) -> list[str]:
    """The dfpo-train flags of one arm on top of the recipe."""
    _, transform, on_policy = ARMS[arm]
    s = int(design["rollout_steps"])
    return ["--importance_sampling_level", "sequence", "--loss_type", "grpo", "--epsilon", str(design["epsilon"]),
            "--epsilon_high", str(design["epsilon_high"]), "--scale_rewards", "none", "--group_granular_batches",
            "true", "--steps_per_generation", str(s), "--gradient_accumulation_steps", str(s if on_policy else 1),
            "--learning_rate", str(design.get("learning_rate", PREREGISTERED["learning_rate"])),
            "--drift_every", str(s), "--eval_every", "0",
            "--logging_steps", "1", "--use_vllm", "false", "--group_transform", transform]


# ------------------------------------------------------------------------------------------------ one run
def curve(record: dict[str, Any], key: str) -> list[tuple[int, float]]:
    return [(int(d["step"]), float(d[key])) for d in (record.get("drift") or {}).get("curve") or []]


def area(points: list[tuple[int, float]]) -> float | None:
    """Trapezoid area over the steps divided by their span; None below two steps."""
    points = sorted(dict(points).items())
    if len(points) < 2:
        return None
    total = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(points, points[1:], strict=False))
    return total / (points[-1][0] - points[0][0])


def off_policy_mean(record: dict[str, Any], key: str, rollout_steps: int) -> float | None:
    """Mean over off-policy optimizer steps ((k − 1) mod rollout_steps ≠ 0) of a logged per-step value."""
    values = [v for s, v in (record.get("series") or {}).get(key, []) if (int(s) - 1) % rollout_steps]
    return statistics.fmean(values) if values else None


def run_row(record: dict[str, Any], design: dict[str, Any]) -> dict[str, Any]:
    """A run's record reduced to what the study reads; a crash keeps its log tail and nothing else."""
    window, complete = int(design["rollout_steps"]), bool(record.get("complete"))
    s = 1 if ARMS[record["arm"]][2] else window  # optimizer steps per rollout: the anchor's every step is on-policy
    row = {"arm": record["arm"], "seed": int(record["seed"]), "design": design["name"], "complete": complete,
           "card": record.get("card"), "versions": record.get("versions"), "checkout": record.get("checkout"),
           "exit_code": record.get("exit_code"), "wall_s": record.get("wall_s")}
    if not complete:
        return {**row, "crash": (record.get("log_tail") or "")[-400:]}
    logp, entropy = dict(curve(record, "set_logp_mean")), dict(curve(record, "set_entropy"))
    heldout = record.get("heldout") or {}
    last = max(logp) if logp else None
    return {**row, "format_accuracy_before": heldout.get("before"), "format_accuracy_after": heldout.get("after"),
            "learned": heldout.get("after") is not None
            and heldout["after"] >= PREREGISTERED["gates"]["learned_format_accuracy"],
            "primary": area([(k, entropy[k] * math.exp(logp[k])) for k in entropy if k in logp]),
            "abs_log_odds_area": area(curve(record, "log_odds_abs_mean")),
            "diagnostics": {"set_mass_final": math.exp(logp[last]) if last is not None else None,
                            "one_sided_share": off_policy_mean(record, "cancellation/one_sided_groups", s),
                            "clipped_share": off_policy_mean(record, "diagnostics/clip_fraction_signal", s),
                            "phi_offpolicy": off_policy_mean(record, "transform/phi_mean", s),
                            "count_pairs": count_pairs(record, window)}}


# ------------------------------------------------------------------------------------------------ statistics
def paired(a: dict[int, float], b: dict[int, float], effect: float = PREREGISTERED["mde"]) -> dict[str, Any] | None:
    """mean over seeds of a − b with a 95% paired t interval, the paired SD and the MDE (t, 80% power); None below 2
    pairs."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    if len(d) < 2:
        return None
    sd = statistics.stdev(d)
    se, df = sd / math.sqrt(len(d)), len(d) - 1
    half = t_ppf(0.975, df) * se
    mean = statistics.fmean(d)
    return {"difference": mean, "low": mean - half, "high": mean + half, "n": len(d), "sd": sd,
            "mde": mde_t(se, df), "seeds_for_mde": seeds_needed(sd, effect)}


def seeds_needed(sd: float, effect: float, minimum: int = 10) -> int:
    """The smallest number of pairs whose paired MDE (t at n − 1 df, 80% power) is ≤ ``effect``."""
    if not effect > 0:
        raise ValueError(f"effect must be > 0, got {effect}")
    n = max(2, minimum)
    while mde_t(sd / math.sqrt(n), n - 1) > effect:
        n += 1
    return n


def gates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every pre-registered gate on one design's pilot rows (crashes counted as crashes, read on completed runs)."""
    g = PREREGISTERED["gates"]
    done = {arm: [r for r in rows if r["arm"] == arm and r["complete"]] for arm in ARMS}

    def median(arm: str, get: Any) -> float | None:
        values = [v for r in done[arm] if (v := get(r)) is not None]
        return statistics.median(values) if values else None

    def entry(value: float | None, ok: bool, arms: tuple[str, ...]) -> dict[str, Any]:
        enough = all(len(done[a]) >= g["min_completed_per_arm"] for a in arms)
        return {"value": value, "passed": bool(enough and value is not None and ok), "completed": {
            a: len(done[a]) for a in arms}}

    mass = median("gspo", lambda r: r["diagnostics"]["set_mass_final"])
    anchor = median("anchor", lambda r: r["diagnostics"]["set_mass_final"])
    stale = [r for a in ("gspo", "mr_w") for r in done[a]]
    one_sided = [v for r in stale if (v := r["diagnostics"]["one_sided_share"]) is not None]
    clipped = [v for r in stale if (v := r["diagnostics"]["clipped_share"]) is not None]
    share = sum(r["learned"] for r in done["gspo"]) / len(done["gspo"]) if done["gspo"] else None
    one = statistics.fmean(one_sided) if one_sided else None
    clip = statistics.fmean(clipped) if clipped else None
    out = {"baseline_set_mass": entry(mass, mass is not None and mass >= g["baseline_set_mass_min"], ("gspo",)),
           "anchor_on_set": entry(anchor, anchor is not None and anchor >= g["anchor_set_mass_min"], ("anchor",)),
           "one_sided_share": entry(one, one is not None and one <= g["one_sided_share_max"], ("gspo", "mr_w")),
           "clipped_share": entry(clip, clip is not None and clip <= g["clipped_share_max"], ("gspo", "mr_w")),
           "baseline_learns": entry(share, share is not None and share >= g["baseline_learned_share_min"], ("gspo",)),
           "crashes": {a: sum(1 for r in rows if r["arm"] == a and not r["complete"]) for a in ARMS}}
    out["passed"] = all(v["passed"] for k, v in out.items() if k != "crashes")
    return out


# ------------------------------------------------------------------------------------------------ stages
def stage_rows(folder: pathlib.Path, design: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for path in sorted([*(folder / "runs").glob("*.json"), *(folder / "runs").glob("*.json.gz")]):
        record = common.read_record(str(path))
        rows.append(run_row({**record, "arm": path.name.split("__")[1]}, design))
    return rows


def launch(args: argparse.Namespace, stages: list[tuple[dict[str, Any], pathlib.Path, list[int], dict[str, Any]]],
           arms: list[str]) -> list[str]:
    """Run every (arm, seed) of each stage ``(design, folder, seeds, extra)`` not yet recorded in its folder, all
    stages in one queue, seed by seed (so that a stage cut short leaves whole pairs), the on-policy anchor (the
    longest) first in each, within what is left of ``args.deadline_s`` since the command began (``args.began``);
    returns the runs left."""
    queue = []
    for design, folder, seeds, extra in stages:
        folder.mkdir(parents=True, exist_ok=True)
        stage_file = folder / "stage.json"
        before = json.loads(stage_file.read_text()) if stage_file.exists() else {}
        stage = {"design": design, "arms": arms, "seeds": seeds,
                 "preregistration_sha256": preregistration_sha(args.round),
                 **extra, "started_at": before.get("started_at", common.utc_now()),
                 "launches": [*before.get("launches", []), {"at": common.utc_now(), "checkout": checkout_state(ROOT)}]}
        stage_file.write_text(json.dumps(stage, indent=1) + "\n")
        for s in seeds:
            for a in arms:
                run = NamedRun(TASKS[ARMS[a][0]], a, s, arm_flags(a, design))
                run.out_dir = str(folder)
                queue.append(run)
    queue.sort(key=lambda run: (run.seed, not ARMS[run.method][2]))  # whole seeds first; in each the anchor (longest)
    keep = args.deadline_s
    if args.deadline_s is not None:
        args.deadline_s = args.deadline_s - (time.time() - args.began)
    if args.deadline_s is None or args.deadline_s > 0:
        common.launch(args, queue, skip_failed=True)  # a crash is recorded as a crash, never rerun
    args.deadline_s = keep
    left = []
    for design, folder, seeds, _ in stages:
        done = {(r["arm"], r["seed"]) for r in stage_rows(folder, design)}
        left += [f"{design['name']} {a} s{s}" for s in seeds for a in arms if (a, s) not in done]
    return left


class NamedRun(common.Run):
    """A common.Run whose name (its record's file name) is ``v3__<arm>__s<seed>``: the task is an import path."""

    @property
    def name(self) -> str:
        return f"v3__{self.method}__s{self.seed}"


def pilot(args: argparse.Namespace) -> dict[str, Any] | None:
    """Pilot every pre-registered design; once all are recorded, their gates to OUT/pilot_gates.json."""
    check_preregistered(pathlib.Path(args.preregistered), args.round)
    out = pathlib.Path(args.out_dir)
    left = launch(args, [(d, out / "pilot" / d["name"], args.pilot_seeds, {}) for d in designs(args)], args.arms)
    if left:
        print(f"pilot: {len(left)} runs not run yet (run the same command again); gates not written", flush=True)
        return None
    result = {"preregistration_sha256": preregistration_sha(args.round), "round": args.round,
              "written_at": common.utc_now(), "designs": {}}
    for design in designs(args):
        rows = stage_rows(out / "pilot" / design["name"], design)
        prim = {a: {r["seed"]: r["primary"] for r in rows if r["arm"] == a and r.get("primary") is not None}
                for a in ("gspo", "mr_w")}
        result["designs"][design["name"]] = {"design": design, "gates": gates(rows),
                                             "paired_primary": paired(prim["mr_w"], prim["gspo"])}
    chosen = next((n for n, d in result["designs"].items() if d["gates"]["passed"]), None)
    result["chosen"] = chosen
    (out / "pilot_gates.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"pilot gates ({out / 'pilot_gates.json'}): chosen design {chosen}", flush=True)
    return result


def main_stage(args: argparse.Namespace) -> list[str]:
    """The chosen design with the seeds the pilot's paired SD asks for; refused without a passed design."""
    check_preregistered(pathlib.Path(args.preregistered), args.round)
    out = pathlib.Path(args.out_dir)
    path = out / "pilot_gates.json"
    if not path.exists():
        raise SystemExit(f"no {path}: run --stage pilot until it writes the gates")
    result = json.loads(path.read_text())
    if result["preregistration_sha256"] != preregistration_sha(args.round) or not result["chosen"]:
        raise SystemExit("no pilot design passed every pre-registered gate (pilot_gates.json says which failed): "
                         "the study stops there")
    entry = result["designs"][result["chosen"]]
    n = args.seeds or (entry["paired_primary"] or {}).get("seeds_for_mde") or 10
    seeds = list(range(PREREGISTERED["main_seed_start"], PREREGISTERED["main_seed_start"] + n))
    rule = "--seeds" if args.seeds else "the pilot's paired SD (pre-registered)"
    left = launch(args, [(entry["design"], out / "main", seeds, {
        "seeds_rule": rule, "pilot_gates_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "pilot_gates_written_at": result["written_at"]})], args.arms)
    print(f"main: {len(seeds)} seeds per arm, {len(left)} runs left", flush=True)
    return left


def designs(args: argparse.Namespace) -> list[dict[str, Any]]:
    registered = REGISTRATIONS[args.round]["designs"]
    names = args.designs or [d["name"] for d in registered]
    return [d for d in registered if d["name"] in names]


# ------------------------------------------------------------------------------------------------ aggregate
def aggregate(out_dir: pathlib.Path, out: pathlib.Path, figures: pathlib.Path | None) -> dict[str, Any]:
    """Per-run rows (seed, card, versions, checkout, gates, diagnostics), per-arm counts, the paired comparisons with
    intervals and MDEs (all pairs and learned pairs), the count-effect slopes, one figure per arm."""
    result = json.loads((out_dir / "pilot_gates.json").read_text())
    entry = result["designs"][result["chosen"]] if result.get("chosen") else None
    if entry is None:
        raise SystemExit("no design passed the pilot's gates: nothing to aggregate (pilot_gates.json says which "
                         "failed)")
    design = entry["design"]
    rows = [{**r, "gates": entry["gates"]} for r in stage_rows(out_dir / "main", design)]
    by = {a: {r["seed"]: r for r in rows if r["arm"] == a and r["complete"]} for a in ARMS}

    def metric(arm: str, key: str, learned_only: bool) -> dict[int, float]:
        return {s: r[key] for s, r in by[arm].items() if r.get(key) is not None and (r["learned"] or not learned_only)}

    def both_learned(a: str, b: str, key: str) -> dict[str, Any] | None:
        keep = {s for s in by[a] if s in by[b] and by[a][s]["learned"] and by[b][s]["learned"]}
        return paired({s: v for s, v in metric(a, key, False).items() if s in keep},
                      {s: v for s, v in metric(b, key, False).items() if s in keep})

    comparisons = {}
    for a, b in (("mr_w", "gspo"), ("gspo_eq", "gspo"), ("mr_w_eq", "mr_w"), ("anchor", "gspo")):
        comparisons[f"{a} - {b}"] = {key: {"all_pairs": paired(metric(a, key, False), metric(b, key, False)),
                                           "learned_pairs": both_learned(a, b, key)}
                                     for key in ("primary", "abs_log_odds_area")}
    pairs = {a: {s: r["diagnostics"]["count_pairs"] for s, r in by[a].items()} for a in ARMS}
    count: dict[str, Any] = {a: slope_interval(pairs[a]) for a in ARMS}
    for a, b in (("gspo", "gspo_eq"), ("mr_w", "mr_w_eq")):
        count[f"{a} - {b}"] = slope_interval(pairs[a], pairs[b])
    arms = {a: {"runs": sum(r["arm"] == a for r in rows), "complete": len(by[a]),
                "crashed": sum(r["arm"] == a and not r["complete"] for r in rows),
                "learned": sum(r["learned"] for r in by[a].values()),
                "set_mass_final_median": median([r["diagnostics"]["set_mass_final"] for r in by[a].values()]),
                "one_sided_share_mean": mean([r["diagnostics"]["one_sided_share"] for r in by[a].values()]),
                "clipped_share_mean": mean([r["diagnostics"]["clipped_share"] for r in by[a].values()])}
            for a in ARMS}
    stage = json.loads((out_dir / "main" / "stage.json").read_text()) if (out_dir / "main" / "stage.json").exists() \
        else {}
    gates_file = hashlib.sha256((out_dir / "pilot_gates.json").read_bytes()).hexdigest()
    made = list(report_study_v3.arm_figures(rows, figures, out).values()) if figures is not None else []
    unchanged = (stage.get("pilot_gates_sha256") == gates_file
                 and result.get("written_at", "") <= stage.get("started_at", ""))  # gates before main, untouched
    round_ = int(result.get("round", 1))
    study = {"study": "v3", "round": round_, "preregistered": REGISTRATIONS[round_],
             "preregistration_sha256": preregistration_sha(round_),
             "pilot_gates": result, "gates_before_main_unchanged": unchanged, "design": design, "arms": arms,
             "comparisons": comparisons, "count_effect": count, "figures": made, "runs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(study) + "\n")
    return study


def mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


# ------------------------------------------------------------------------------------------------ smoke, main
def smoke(args: argparse.Namespace) -> dict[str, Any]:
    """The CPU path: a tiny random model, 2 optimizer steps, one rollout of 2 steps, ``args.arms`` × seed 0 of one
    design; the pilot's gates computed (a tiny model passes none) and recorded."""
    out = pathlib.Path(args.out_dir)
    args.model = common.smoke_model(out)
    args.steps, args.parallel, args.pilot_seeds = 2, 2, [0]
    args.extra = [*common.SMOKE_FLAGS, "--eval_every", "0", "--drift_every", "1", *args.extra]
    args.designs = [REGISTRATIONS[args.round]["designs"][-1]["name"]]
    return pilot(args) or {}


def main(argv: list[str] | None = None) -> Any:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--preregister", action="store_true", help="write PREREGISTERED to --preregistered")
    mode.add_argument("--stage", choices=["pilot", "main"])
    mode.add_argument("--aggregate", metavar="OUT_DIR")
    mode.add_argument("--smoke", action="store_true", help="CPU path: tiny model, 2 steps")
    p.add_argument("--round", type=int, choices=sorted(REGISTRATIONS), default=1,
                   help="which registration: 1 (the first designs), 2 or 3 (each registered after the last one's gates "
                   "failed)")
    p.add_argument("--preregistered", default=None, help="default: results/study_v3/preregistered[_roundN].json")
    p.add_argument("--recipe", default=str(common.RECIPE))
    p.add_argument("--model", default=None)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--designs", nargs="+", default=None, help="pilot only these pre-registered designs")
    p.add_argument("--seeds", type=int, default=None, help="main seeds per arm (default: from the pilot's paired SD)")
    p.add_argument("--out-dir", default="/tmp/study_v3")
    p.add_argument("--parallel", type=int, default=PREREGISTERED["parallel"])
    p.add_argument("--gpus", nargs="*", type=int, default=[], help="CUDA devices; --parallel runs at once on each")
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--expected-run-s", type=float, default=300.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "study_v3.json"))
    p.add_argument("--figures-dir", default=str(ROOT / "benchmarks" / "figures"))
    p.add_argument("extra", nargs="*", help="further dfpo-train flags after --")
    args = p.parse_args(argv)
    args.began = time.time()
    args.preregistered = args.preregistered or str(REGISTRATION_FILES[args.round])
    args.steps, args.pilot_seeds = PREREGISTERED["steps"], PREREGISTERED["pilot_seeds"]
    args.via_accelerate, args.vllm_memory, args.start_timeout, args.skip_done = False, None, 0.0, []
    if args.preregister:
        path = pathlib.Path(args.preregistered)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"sha256": preregistration_sha(args.round), "preregistered":
                                    REGISTRATIONS[args.round]}, indent=1) + "\n")
        return None
    if args.smoke:
        return smoke(args)
    if args.stage == "pilot":
        return pilot(args)
    if args.stage == "main":
        return main_stage(args)
    return aggregate(pathlib.Path(args.aggregate), pathlib.Path(args.out), pathlib.Path(args.figures_dir))


if __name__ == "__main__":
    main()
