"""Study v4, part 1: the paired branch test, its positive control, and a registration that guards the stages.

    python -m dfpo_bench.studies.study_v4 --preregister   # writes results/study_v4/preregistered.json; put the printed
                                                          # SHA-256 in REGISTRATION_SHA256 and commit both BEFORE a run
    python -m dfpo_bench.studies.study_v4 --stage pilot --model MODEL --out-dir /tmp/v4   # both settings, pilot seeds;
                                                          # then writes OUT/plan.json (the main seeds, by the rule)
    python -m dfpo_bench.studies.study_v4 --stage main --model MODEL --out-dir /tmp/v4    # the seeds plan.json names
    python -m dfpo_bench.studies.study_v4 --analyse /tmp/v4      # -> results/study_v4.json

Every stage refuses to start unless results/study_v4/preregistered.json hashes (whole content) to
REGISTRATION_SHA256 and is committed and clean (dfpo_bench.lib.registration). Each trajectory writes one JSON-lines
file: a header (registration state, checkout with its source hash, versions, device, model), one line per branch
point (branch_test.branch), and a ``complete`` line; a file without it is a crash and is reported as one.
Design, MDE and analysis: :data:`PREREGISTRATION` and benchmarks/README.md, "Study v4".
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pathlib
import statistics
import time
from collections.abc import Iterable
from typing import Any

from dfpo_bench.lib import common  # noqa: E402
from dfpo_bench.lib.registration import (
    check_registration,
    registration_text,
    run_provenance,
    write_registration,
)
from dfpo_bench.lib.stats import cluster_bootstrap, cluster_bootstrap_ols, mde_t  # noqa: E402

ROOT = common.ROOT
RESULTS = ROOT / "benchmarks" / "results" / "study_v4"
REGISTRATION_FILE = RESULTS / "preregistered.json"
REGISTRATION_SHA256 = "f983bef5eee1d89a228c41096b7e2155d618aab09c5066713d349054e6f75a34"  # the file's whole content
PREREGISTRATION: dict[str, Any] = {
    "study": "v4 part 1: the paired branch test and its positive control",
    "task": "dfpo_bench.study_v3_tasks:strict",
    "trajectory": "GSPO (group_transform none), sequence-level ratio, loss_type grpo, scale_rewards none, whole groups "
                  "per micro-batch, one micro-batch per optimizer step, steps_per_generation = S + 1, constant lr, "
                  "AdamW (the Trainer's default), max_grad_norm 1.0, float32 weights, TF32 off",
    "settings": {
        "main": {"staleness": 4, "learning_rate": 5e-5, "epsilon": 0.1, "epsilon_high": 0.12, "steps": 60},
        "control": {"staleness": 16, "learning_rate": 2e-4, "epsilon": 0.5, "epsilon_high": 0.6, "steps": 68},
    },
    "shared": {"num_generations": 8, "groups_per_micro_batch": 4, "max_completion_length": 24, "temperature": 1.0,
               "probe_prompts": 32, "min_staleness": 1, "train_size": 512},
    "arms": ["none", "min_replace"],
    "branch": "at every optimizer step k whose next micro-batch is j >= 1 steps stale: copy θ_k and the AdamW state "
              "into two branch trainers (checked bit-identical), one real optimizer step each on that micro-batch "
              "(same rows, order, RNG seed); every 10th point a third arm repeats GSPO (A/A: the device's "
              "nondeterminism floor)",
    "term_size": "imbalance I = Σ_g |Σ_i Â_i s̄_i| / Σ_g Σ_i |Â_i| s̄_i at θ_k on the branch micro-batch (0 under "
                 "Min-Replace); secondary: removed share Σ |Â_i (s̄_i − s̃_i)| / Σ |Â_i| s̄_i",
    "primary": "main setting: the mean over branch points of the oriented paired effect (GSPO − Min-Replace) in the "
               "probe prompts' log-odds, d_p (Δo_p^GSPO − Δo_p^MR) with d_p = sign(o_p(θ_k) − o_p(θ_rollout)), "
               "relative to GSPO's own mean movement mean|Δo_p^GSPO| (ratio of means); 95% interval resampling "
               "trajectories (4000 draws, seed 0); predicted > 0",
    "co_primary": "slope of the per-point relative oriented effect on I, least squares with intercept, main and "
                  "control points pooled; 95% interval resampling trajectories; predicted slope > 0, the intercept "
                  "near 0",
    "secondary": ["paired |log-odds| after the step (GSPO − MR)", "paired set log-mass (GSPO − MR)",
                  "shared-prefix residual per arm (trainer meter), paired", "pre-clip gradient norm ratio MR / GSPO",
                  "the same primary on the control setting alone", "A/A floor: |GSPO − GSPO repeat| on the probe"],
    "control_gate": {"measure": "mean GSPO imbalance I over the control's branch points at j = S", "min": 0.10,
                     "if_failed": "reported as 'the control did not reach the gate'; the slope is still reported, "
                                  "labelled"},
    "mde": {"relative_effect": 0.02, "units": "the primary's units: a share of GSPO's own per-step movement of the "
            "probe log-odds (the removed term is a share of the update, so the effect can reach it)",
            "slope_half_width": 0.5, "power": 0.8, "alpha": 0.05},
    "pilot_seeds": [0, 1, 2], "main_seed_start": 100,
    "sample_size": "per setting, from the pilot (its trajectories are not analysed): σ = SD over pilot branch points "
                   "of the oriented effect, inflated × 2 for a pilot's optimism, times √deff with deff = max(2, "
                   "1 + (m − 1) ρ) (ρ the intra-trajectory correlation, m points per trajectory); branch points n = "
                   "the smallest with (t_.975 + t_.8)(n − 1) σ √deff / √n ≤ 0.02 × the pilot's mean GSPO movement, "
                   "clamped to [200, 1000]; trajectories = ceil(n / m)",
    "no_signal": "a branch point whose micro-batch has no group with signal (advantage mass 0) gives both arms a zero "
                 "update: counted and reported, left out of the primary, the slope and the sample-size rule",
    "crashes": "a trajectory file without its complete line is a crash, counted as such; its branch points are kept "
               "only in a sensitivity analysis",
    "wording": "a primary interval that holds 0 is reported as 'not detected above the MDE reached', never 'no effect'",
}


def preregistration_text() -> str:
    return registration_text(PREREGISTRATION)


def admitted() -> dict[str, Any]:
    """The registration state, or SystemExit when the file is altered, uncommitted or untracked."""
    return check_registration(REGISTRATION_FILE, REGISTRATION_SHA256, ROOT)


def setting(name: str) -> Any:
    from dfpo_bench.studies.branch_test import Setting

    shared = {k: v for k, v in PREREGISTRATION["shared"].items() if k != "train_size"}
    return Setting(name=name, **PREREGISTRATION["settings"][name], **shared)


def load_task(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)()


def load_model(path: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def run_one(args: argparse.Namespace, stage: str, name: str, seed: int, state: dict[str, Any]) -> pathlib.Path:
    """One trajectory with its branch points -> OUT/<stage>/<setting>/s<seed>.jsonl (header, points, complete)."""
    from dfpo_bench.studies import branch_test

    path = pathlib.Path(args.out_dir) / stage / name / f"s{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    began = time.time()
    header = {"stage": stage, "setting": name, "seed": seed, "model": args.model, "versions": common.versions(),
              "card": common.card(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **run_provenance(ROOT, state)}
    with path.open("w") as out:
        out.write(json.dumps({"header": header}) + "\n")
        out.flush()

        def on_record(record: dict[str, Any]) -> None:
            out.write(json.dumps({**record, "elapsed_s": time.time() - began}) + "\n")
            out.flush()

        model, tokenizer = load_model(args.model)
        extra = {"use_cpu": True} if args.cpu else {}
        branch_test.run_trajectory(model, tokenizer, load_task(PREREGISTRATION["task"]), setting(name), seed,
                                   str(path.parent / f"trainer_s{seed}"), on_record,
                                   max_points=args.max_points, train_size=PREREGISTRATION["shared"]["train_size"],
                                   aa_every=10, **extra)
        out.write(json.dumps({"complete": True, "wall_s": time.time() - began}) + "\n")
    return path


def read_trajectory(path: pathlib.Path) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"path": str(path), "header": lines[0].get("header") if lines else None,
            "points": [x for x in lines if "arms" in x], "complete": any(x.get("complete") for x in lines),
            "wall_s": next((x["wall_s"] for x in lines if x.get("complete")), None)}


def stage(args: argparse.Namespace, name: str) -> None:
    """Run the stage's trajectories not yet complete (a crash is recorded and not rerun), within --deadline-s."""
    state = admitted()
    if name == "cpu-pilot" and not (args.cpu and args.seeds):
        raise SystemExit("--stage cpu-pilot needs --cpu and --seeds (seeds outside the registered ones, e.g. 900)")
    seeds = PREREGISTRATION["pilot_seeds"] if name == "pilot" else args.seeds if name == "cpu-pilot" \
        else planned_seeds(args)
    began = time.time()
    for setting_name in args.settings:
        for seed in seeds.get(setting_name, []) if isinstance(seeds, dict) else seeds:
            path = pathlib.Path(args.out_dir) / name / setting_name / f"s{seed}.jsonl"
            if args.deadline_s is not None and time.time() - began > args.deadline_s:
                print(f"{name}: deadline reached; run the same command again", flush=True)
                return
            if not claim(path):
                continue  # complete, a crash (never rerun), or another process of the same command runs it
            try:
                run_one(args, name, setting_name, seed, state)
            except Exception as error:  # recorded as a crash (no complete line), the stage goes on
                with path.open("a") as out:
                    out.write(json.dumps({"crash": f"{type(error).__name__}: {error}"[:400]}) + "\n")
    if name == "pilot":
        out = pathlib.Path(args.out_dir)
        files = [out / "pilot" / n / f"s{seed}.jsonl" for n in PREREGISTRATION["settings"] for seed in seeds]
        waiting = [str(f) for f in files if not f.exists() or not finished(f)]
        if waiting:  # another process still runs them, or one was cut: `--plan OUT` once every process has ended
            print(f"pilot: {len(waiting)} trajectories not finished; plan.json not written", flush=True)
        else:
            plan(out)


def finished(path: pathlib.Path) -> bool:
    """A trajectory file with its complete line or a recorded crash (not one still running, nor one cut off)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return any(x.get("complete") or "crash" in x for x in lines)


def claim(path: pathlib.Path) -> bool:
    """Create ``path`` exclusively (O_EXCL): True for the one process that may run that trajectory, so several
    processes of the same stage command can share one GPU without running a seed twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.open("x").close()
    except FileExistsError:
        return False
    return True


def effect_rows(folder: pathlib.Path, with_no_signal: bool = False,
                with_crashes: bool = False) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{setting: {trajectory: [row per branch point]}} of complete trajectories (``with_crashes``: of crashed ones
    too, for the registered sensitivity analysis); a row holds the terms and effects. Points without signal
    (advantage mass 0: no update in either arm, I undefined) are left out unless ``with_no_signal``."""
    from dfpo_bench.studies.branch_test import effects

    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted(folder.glob("*/s*.jsonl")):
        t = read_trajectory(path)
        if not (t["complete"] or with_crashes):
            continue
        rows = [{"staleness": p["staleness"], **p["terms"], **effects(p),
                 "residual": [a["residual"] for a in p["arms"]], "grad_norm": [a["grad_norm"] for a in p["arms"]],
                 "identical_start": p["identical_start"], "aa": p.get("aa_floor")} for p in t["points"]]
        out.setdefault(path.parent.name, {})[path.stem] = rows if with_no_signal else [
            r for r in rows if r["advantage_mass"] > 0]
    return out


def plan(out_dir: pathlib.Path) -> dict[str, Any]:
    """The registered sample-size rule on the pilot's branch points -> OUT/plan.json."""
    result: dict[str, Any] = {"registration_sha256": REGISTRATION_SHA256, "settings": {}}
    target = PREREGISTRATION["mde"]["relative_effect"]
    for name, trajectories in effect_rows(out_dir / "pilot").items():
        values = [[r["oriented"] for r in rows] for rows in trajectories.values() if rows]
        flat = [v for vs in values for v in vs]
        if len(flat) < 3 or len(values) < 2:
            result["settings"][name] = {"error": "fewer than 3 pilot branch points or 2 trajectories"}
            continue
        m = statistics.fmean(len(vs) for vs in values)
        rho = intra_class(values)
        deff = max(2.0, 1 + (m - 1) * rho)
        sd = 2 * statistics.stdev(flat) * math.sqrt(deff)
        move = statistics.fmean(r["gspo_move"] for rows in trajectories.values() for r in rows)
        n = 200
        while n < 1000 and mde_t(sd / math.sqrt(n), n - 1) > target * move:
            n += 1
        count = math.ceil(n / m)
        result["settings"][name] = {"points": n, "points_per_trajectory": m, "rho": rho, "deff": deff, "sd": sd,
                                    "gspo_move": move, "trajectories": count, "mde_at_n": mde_t(sd / math.sqrt(n),
                                                                                                n - 1) / move,
                                    "seeds": list(range(PREREGISTRATION["main_seed_start"],
                                                        PREREGISTRATION["main_seed_start"] + count))}
    common.write_json(out_dir / "plan.json", result)
    return result


def intra_class(groups: list[list[float]]) -> float:
    """One-way ANOVA estimate of the intra-cluster correlation (0 when undefined or negative)."""
    k, n = len(groups), sum(len(g) for g in groups)
    if k < 2 or n <= k:
        return 0.0
    grand = statistics.fmean(v for g in groups for v in g)
    between = sum(len(g) * (statistics.fmean(g) - grand) ** 2 for g in groups) / (k - 1)
    within = sum((v - statistics.fmean(g)) ** 2 for g in groups for v in g) / (n - k)
    m0 = (n - sum(len(g) ** 2 for g in groups) / n) / (k - 1)
    denominator = between + (m0 - 1) * within
    return max(0.0, (between - within) / denominator) if denominator > 0 else 0.0


def planned_seeds(args: argparse.Namespace) -> dict[str, list[int]]:
    path = pathlib.Path(args.out_dir) / "plan.json"
    if not path.exists():
        raise SystemExit(f"no {path}: run --stage pilot first")
    result = json.loads(path.read_text())
    if result["registration_sha256"] != REGISTRATION_SHA256:
        raise SystemExit(f"{path} was planned under another registration")
    return {name: entry.get("seeds", []) for name, entry in result["settings"].items()}


def ratio_of_means(rows: list[dict[str, Any]]) -> float | None:
    move = sum(r["gspo_move"] for r in rows)
    return sum(r["oriented"] for r in rows) / move if move > 0 else None


def analyse(out_dir: pathlib.Path) -> dict[str, Any]:
    """The registered analysis of the main stage (plus the crash count and the gate) -> a dict."""
    data = effect_rows(out_dir / "main")
    files = {p: read_trajectory(p) for p in sorted((out_dir / "main").glob("*/s*.jsonl"))}
    crashes = [str(p.relative_to(out_dir)) for p, t in files.items() if not t["complete"]]
    out: dict[str, Any] = {"registration_sha256": REGISTRATION_SHA256, "crashes": crashes,
                           "coverage": coverage(out_dir, files), "provenance": provenance(files.values()),
                           "settings": {}}
    pooled: dict[str, list[tuple[float, float]]] = {}
    for name, trajectories in data.items():
        move = statistics.fmean(r["gspo_move"] for rows in trajectories.values() for r in rows) if any(
            trajectories.values()) else 0.0
        primary = cluster_bootstrap(trajectories, ratio_of_means)
        everything = effect_rows(out_dir / "main", with_no_signal=True).get(name, {})
        entry = {"trajectories": len(trajectories), "points": sum(map(len, trajectories.values())),
                 "no_signal_points": sum(map(len, everything.values())) - sum(map(len, trajectories.values())),
                 "primary_relative": primary, "gspo_move_mean": move,
                 "mde_relative": None if primary is None else 2.8 * primary["se"],
                 "identical_starts": all(r["identical_start"] for rows in trajectories.values() for r in rows)}
        for key in ("abs_log_odds", "set_logp"):
            entry[key] = cluster_bootstrap(trajectories, lambda rows, k=key: statistics.fmean(r[k] for r in rows)
                                           if rows else None)
        points = [r for rows in trajectories.values() for r in rows]
        entry["means"] = {key: mean_of([r[key] for r in points]) for key in ("imbalance", "removed_share",
                                                                             "clipped_share", "gspo_move")}
        entry["residual"] = {arm: mean_of([r["residual"][i] for r in points]) for i, arm in
                             enumerate(PREREGISTRATION["arms"])}
        entry["grad_norm_ratio"] = mean_of([r["grad_norm"][1] / r["grad_norm"][0] for r in points
                                            if r["grad_norm"][0] > 0])
        entry["aa_floor_max"] = max((r["aa"] for r in points if r["aa"] is not None), default=None)
        entry["aa_points"] = sum(r["aa"] is not None for r in points)
        entry["point_columns"] = {  # every analysed point, for the scatter of the effect against the term
            "trajectory": [seed for seed, rows in trajectories.items() for _ in rows],
            **{key: [r[key] for rows in trajectories.values() for r in rows]
               for key in ("staleness", "imbalance", "removed_share", "clipped_share", "gspo_move", "relative")},
            "grad_norm_ratio": [r["grad_norm"][1] / r["grad_norm"][0] if r["grad_norm"][0] > 0 else None
                                for rows in trajectories.values() for r in rows],
            # the shared-prefix residual before (GSPO's step) and after (Min-Replace's), None where undefined
            **{f"residual_{arm}": [r["residual"][i] for rows in trajectories.values() for r in rows]
               for i, arm in enumerate(PREREGISTRATION["arms"])}}
        at_s = [r["imbalance"] for rows in trajectories.values() for r in rows
                if r["staleness"] == PREREGISTRATION["settings"][name]["staleness"]]
        entry["imbalance_at_S"] = statistics.fmean(at_s) if at_s else None
        if name == "control":
            gate = PREREGISTRATION["control_gate"]["min"]
            entry["gate"] = {"value": entry["imbalance_at_S"], "min": gate,
                             "passed": entry["imbalance_at_S"] is not None and entry["imbalance_at_S"] >= gate}
        for seed, rows in trajectories.items():  # the registered co-primary: each point's own relative effect
            pooled.setdefault(f"{name}/{seed}", []).extend((r["imbalance"], r["relative"]) for r in rows)
        out["settings"][name] = entry
    with_crashes = effect_rows(out_dir / "main", with_crashes=True).get("main", {})
    out["sensitivity_with_crashed_points"] = cluster_bootstrap(with_crashes, ratio_of_means) if crashes else None
    out["slope"], out["intercept"] = cluster_bootstrap_ols(pooled)  # cluster_bootstrap's draws of ols, from sums
    return out


def coverage(out_dir: pathlib.Path, files: dict[pathlib.Path, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per setting, the main stage's trajectories (``files``: path -> :func:`read_trajectory`): planned
    (``plan.json``), complete, crashed (a file without its complete line) and never started (a planned seed without
    a file: not a crash, no data). Reported beside the analysis because a stage stopped by a deadline set before it
    began analyses fewer trajectories than planned."""
    plan_file = out_dir / "plan.json"
    planned = {name: entry.get("seeds", []) for name, entry in
               json.loads(plan_file.read_text())["settings"].items()} if plan_file.exists() else {}
    out = {}
    for name in PREREGISTRATION["settings"]:
        mine = {int(p.stem[1:]): t for p, t in files.items() if p.parent.name == name}
        out[name] = {"planned": len(planned.get(name, [])), "complete": sum(t["complete"] for t in mine.values()),
                     "crashed": sum(not t["complete"] for t in mine.values()),
                     "not_started": len(set(planned.get(name, [])) - set(mine))}
    return out


def provenance(trajectories: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct (checkout, registration, card, versions) of the main stage's trajectory headers, each with the
    number of trajectories that ran under it: what ran, read from the records themselves."""
    seen: dict[str, dict[str, Any]] = {}
    for trajectory in trajectories:
        header = trajectory["header"] or {}
        key = {k: header.get(k) for k in ("checkout", "registration", "card", "versions")}
        entry = seen.setdefault(json.dumps(key, sort_keys=True), {**key, "trajectories": 0})
        entry["trajectories"] += 1
    return list(seen.values())


def mean_of(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def main(argv: list[str] | None = None) -> Any:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--preregister", action="store_true")
    mode.add_argument("--stage", choices=["pilot", "main", "cpu-pilot"],
                      help="cpu-pilot: a labelled look at a few points on the CPU, never analysed or planned from")
    mode.add_argument("--analyse", metavar="OUT_DIR")
    mode.add_argument("--plan", metavar="OUT_DIR", help="the sample-size rule on the pilot -> OUT_DIR/plan.json (once "
                      "every pilot process has ended; a trajectory cut off counts as a crash)")
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", default="/tmp/study_v4")
    p.add_argument("--settings", nargs="+", default=list(PREREGISTRATION["settings"]))
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--max-points", type=int, default=None, help="branch points per trajectory (default: all)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (a CPU pilot)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="cpu-pilot only: its trajectory seeds")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "study_v4.json"))
    args = p.parse_args(argv)
    if args.preregister:
        print(write_registration(REGISTRATION_FILE, PREREGISTRATION))
        return None
    if args.stage:
        if not args.model:
            raise SystemExit("--model is required for a stage")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return stage(args, args.stage)
    if args.plan:
        return plan(pathlib.Path(args.plan))
    result = analyse(pathlib.Path(args.analyse))
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
