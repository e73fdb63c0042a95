"""Study v2: does DFPO's transform change equivalent-solution drift beyond the count effect?

    # on the GPU machine: the pilot (seeds 0-3 of anchor, gspo, mr_w, mr_g; scale too with --kappa), which writes
    # the gates to /tmp/v2/gates.json once every pilot run has a record. A command starts no run that would end after
    # --deadline-s; repeat it (finished runs are skipped) until nothing is left
    python benchmarks/study_v2.py --stage pilot --model /root/models/smollm2-135m-instruct --out-dir /tmp/v2 \
        --parallel 12 --deadline-s 540
    # the gates again from /tmp/v2/pilot (refused once /tmp/v2/main holds a record)
    python benchmarks/study_v2.py --write-gates --out-dir /tmp/v2
    # the main stage: refused unless /tmp/v2/gates.json exists, passed and has this design (--force: recorded);
    # scale's κ: --kappa, else the pilot's mean off-policy φ of mr_w (matched φ)
    python benchmarks/study_v2.py --stage main --model /root/models/smollm2-135m-instruct --out-dir /tmp/v2 \
        --parallel 12 --deadline-s 540 [--gpus 0 1 2 3]
    python benchmarks/study_v2.py --sd-check /tmp/v2/main --effect 0.05  # after 10 seeds: SDs, n needed, no means
    python benchmarks/study_v2.py --status /tmp/v2/main
    # after each command: gates.json, pilot/ and main/ (stage.json, runs/) copied to $OUT; on a fresh machine copied
    # back into /tmp/v2 first (the stage resumes: complete runs are skipped, its start time and gates kept)
    # here: those files in benchmarks/results/study_v2/
    python benchmarks/study_v2.py --aggregate benchmarks/results/study_v2/main
    # CPU check of the whole pipeline (tiny random model, transformers' generate): pilot -> gates -> main -> aggregate
    python benchmarks/study_v2.py --smoke --out-dir /tmp/study-v2-smoke

Design. Task ``two_forms``, recipe ``recipes/smollm2_gpu_vllm.yaml`` with transformers' generation
(``--use_vllm false``; ``--vllm`` for colocated vLLM), ``--steps`` optimizer steps (64), the drift meter every
``--drift-every`` steps (8), held-out greedy accuracy before and after only. Every arm has GSPO's sequence-level
ratio and clip (common.SEQUENCE_GSPO) and group-granular batches; they differ only in (:func:`arm_flags`):

* ``anchor``: on-policy GSPO, ``steps_per_generation`` = gradient accumulation, so φ ≡ 1 and the coupling term is 0;
* ``gspo``: stale GSPO, ``steps_per_generation`` S (16), ``group_transform none`` (the baseline; it differs from
  ``anchor`` in rollout size and clipping too, so ``gspo`` − ``anchor`` isolates neither the term nor a count effect);
* ``mr_w`` / ``mr_g``: stale Min-Replace, weights / gradient cancellation target;
* ``scale``: s̃ = κ s̄ off-policy with κ = the pilot's mean off-policy φ of ``mr_w`` (matched φ, no balancing).

Stages. ``--stage pilot`` runs few seeds per arm, then writes the gates before any main outcome exists: (a) ``gspo``
learns the format without diverging (held-out after ≥ ``--learned-threshold`` in ≥ ``--min-learned-share`` of its
pilot runs; a failed run counts as not learned); (b) the transform moves the weights (mean over ``mr_w``'s pilot runs
of the mean off-policy φ ≤ ``--max-phi``). ``--stage main`` (fresh seeds from 100; ``gspo`` and ``mr_w`` 40 each,
the others 10) refuses to start without passed gates of the same design. Same seed = same problem order in every arm.

Aggregation. Per run the primary metric is the area under the equivalent-set entropy curve (``set_entropy`` at every
drift measurement, trapezoid, divided by the step span) among runs that learned the format; failures are counts. Per
comparison (each arm − ``gspo``, ``gspo`` − ``anchor``): difference of means with a Welch 95% interval (unpaired:
exclusions break the seed pairs) and the minimum detectable effect at 80% power, two-sided α = 0.05, from the observed
SDs and n; a null reads "not detected above MDE". Per-run diagnostics: mean off-policy φ, clip fraction, share of
zero-gradient steps, one-sided groups, IS-ratio spread (where logged). One figure per arm.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402 - the launcher
from provenance import checkout_state  # noqa: E402
from report_stats import mde_t, t_quantile  # noqa: E402 - the two-sided 95% t quantile, the MDE with t

ROOT = common.ROOT
TASK = "two_forms"
ARMS = {"anchor": "on-policy GSPO (φ ≡ 1)", "gspo": "stale GSPO", "mr_w": "stale Min-Replace (weights)",
        "mr_g": "stale Min-Replace (gradient)", "scale": "stale scale at matched φ"}
PRIMARY = ("gspo", "mr_w")
COMPARISONS = (("mr_w", "gspo"), ("mr_g", "gspo"), ("scale", "gspo"), ("gspo", "anchor"))
Z_ALPHA = statistics.NormalDist().inv_cdf(0.975)  # two-sided α = 0.05
Z_POWER = statistics.NormalDist().inv_cdf(0.80)  # 80% power
PHI_KEYS = ("diagnostics/phi_mean_off_policy", "diagnostics/phi_offpolicy_mean")  # logged off-policy φ, if any
CLIP_KEYS = ("diagnostics/clip_fraction_signal", "clip_ratio/region_mean")  # among rows with Â ≠ 0 first
DESIGN_KEYS = ("task", "recipe", "model", "steps", "steps_per_generation", "grad_accum", "learning_rate",
               "drift_every", "use_vllm", "extra")


# ------------------------------------------------------------------------------------------------ statistics
def curve_auc(curve: list[list[float]]) -> float | None:
    """Area under [[step, value], ...] by the trapezoid rule, divided by the step span (a mean level over the run);
    None for fewer than two distinct steps."""
    points = sorted({int(s): float(v) for s, v in curve}.items())
    if len(points) < 2:
        return None
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(points, points[1:], strict=False))
    return area / (points[-1][0] - points[0][0])


def mde(sd_a: float, n_a: int, sd_b: float, n_b: int) -> float:
    """Minimum detectable difference of means at 80% power, two-sided α = 0.05 (normal approximation):
    (z_0.975 + z_0.8) · sqrt(s_a²/n_a + s_b²/n_b)."""
    return (Z_ALPHA + Z_POWER) * math.sqrt(sd_a**2 / n_a + sd_b**2 / n_b)


def n_needed(sd_a: float, sd_b: float, effect: float) -> int:
    """Runs per arm (equal n) whose MDE is ``effect``: (z_0.975 + z_0.8)² (s_a² + s_b²) / effect²."""
    if not effect > 0:
        raise ValueError(f"--effect must be > 0, got {effect}")
    return max(2, math.ceil((Z_ALPHA + Z_POWER) ** 2 * (sd_a**2 + sd_b**2) / effect**2))


def welch(a: list[float], b: list[float]) -> dict[str, Any] | None:
    """mean(a) − mean(b) with a Welch 95% interval (Welch–Satterthwaite df) and the MDE (``mde``: Student t at the
    Welch df; ``mde_z``: the normal approximation, which understates it with few runs a side); None below 2 runs a
    side."""
    if len(a) < 2 or len(b) < 2:
        return None
    sd_a, sd_b = statistics.stdev(a), statistics.stdev(b)
    va, vb = sd_a**2 / len(a), sd_b**2 / len(b)
    diff, se = statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else len(a) + len(b) - 2
    half = t_quantile(df) * se
    return {"difference": diff, "low": diff - half, "high": diff + half, "df": df, "se": se, "n": [len(a), len(b)],
            "sd": [sd_a, sd_b], "mde": mde_t(se, df) if se > 0 else 0.0, "mde_z": mde(sd_a, len(a), sd_b, len(b))}


def verdict(name: str, result: dict[str, Any] | None) -> str:
    """One sentence; a null is "not detected above" the MDE, never "no effect"."""
    if result is None:
        return f"{name}: not measured (fewer than 2 learned runs on a side)"
    d, lo, hi, m = result["difference"], result["low"], result["high"], result["mde"]
    found = "detected (the interval excludes 0)" if lo > 0 or hi < 0 else f"not detected above MDE {m:.3g}"
    return (f"{name}: {d:+.3g} [{lo:+.3g}, {hi:+.3g}], {found} (n = {result['n'][0]}, {result['n'][1]}; "
            f"MDE {m:.3g} at 80% power, two-sided α = 0.05, t at Welch's df)")


# ------------------------------------------------------------------------------------------------ one run
def flag(record: dict[str, Any], name: str, default: Any = None) -> Any:
    """The last value of ``--name`` among a record's flags and extra flags (later flags win, as in dfpo-train)."""
    settings = record.get("settings") or {}
    flags = [*settings.get("flags", []), *settings.get("extra", [])]
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == f"--{name}"]
    return values[-1] if values else default


def rollout_steps(record: dict[str, Any]) -> int:
    """Optimizer steps per rollout: steps_per_generation × num_iterations / gradient_accumulation_steps (TRL
    generates every steps_per_generation × num_iterations micro-steps)."""
    micro = int(flag(record, "steps_per_generation", 1)) * int(flag(record, "num_iterations", 1))
    return max(1, micro // int(flag(record, "gradient_accumulation_steps", 1)))


def phi_offpolicy(record: dict[str, Any]) -> float | None:
    """Mean off-policy φ = s̃/s̄: the logged diagnostic if present, else ``transform/phi_mean`` on the steps that
    are not the first of a rollout (step k is on-policy iff (k − 1) mod rollout_steps = 0; logging_steps = 1)."""
    series = record.get("series") or {}
    for key in PHI_KEYS:
        if series.get(key):
            return statistics.fmean(v for _, v in series[key])
    length = rollout_steps(record)
    values = [v for s, v in series.get("transform/phi_mean", []) if (int(s) - 1) % length]
    return statistics.fmean(values) if values else None


LearnedRule = tuple[float, float | None]  # (held-out after at least, gain over before at least: None = not used)


def learned(record: dict[str, Any], rule: LearnedRule) -> bool:
    """Learned (without diverging): complete, and held-out greedy accuracy after training ≥ ``rule[0]``, or, when
    ``rule[1]`` is set, after − before ≥ ``rule[1]`` (accuracies are counts out of n: 1e-9 absorbs their rounding)."""
    heldout = record.get("heldout") or {}
    after, before = heldout.get("after"), heldout.get("before")
    if not record.get("complete") or after is None:
        return False
    if rule[1] is not None:
        return before is not None and after - before >= rule[1] - 1e-9
    return after >= rule[0]


def diagnostics(record: dict[str, Any]) -> dict[str, Any]:
    """The per-run diagnostics every study reports (None where not logged)."""
    series = record.get("series") or {}

    def mean(*keys: str) -> tuple[float | None, str | None]:
        key = next((k for k in keys if series.get(k)), None)
        return (statistics.fmean(v for _, v in series[key]), key) if key else (None, None)

    grad = [v for _, v in series.get("grad_norm", [])]
    clip, clip_key = mean(*CLIP_KEYS)
    low = [v for k in ("diagnostics/is_ratio_min", "sampling/importance_sampling_ratio/min") for _, v in
           series.get(k, [])]
    high = [v for k in ("diagnostics/is_ratio_max", "sampling/importance_sampling_ratio/max") for _, v in
            series.get(k, [])]
    return {"phi_offpolicy": phi_offpolicy(record), "clip_fraction": clip, "clip_key": clip_key,
            "zero_grad_share": sum(g == 0 for g in grad) / len(grad) if grad else None,
            "one_sided_groups": mean("cancellation/one_sided_groups")[0],
            "zero_variance_groups": mean("diagnostics/zero_variance_groups", "frac_reward_zero_std")[0],
            "is_ratio_min": min(low) if low else None, "is_ratio_max": max(high) if high else None,
            "is_ratio_std": mean("diagnostics/is_ratio_std")[0]}


def run_row(record: dict[str, Any], threshold: LearnedRule, gates_state: dict[str, Any]) -> dict[str, Any]:
    curve = [[d["step"], d["set_entropy"]] for d in (record.get("drift") or {}).get("curve") or []]
    heldout = record.get("heldout") or {}
    return {"arm": record["method"], "seed": record["seed"], "card": record.get("card"),
            "versions": record.get("versions"), "complete": bool(record.get("complete")),
            "exit_code": record.get("exit_code"), "wall_s": record.get("wall_s"), "steps": record.get("steps"),
            "heldout_before": heldout.get("before"), "heldout_after": heldout.get("after"),
            "learned": learned(record, threshold), "auc_set_entropy": curve_auc(curve), "set_entropy_curve": curve,
            "diagnostics": diagnostics(record) if record.get("complete") else None, "gates": gates_state,
            "settings": record.get("settings")}


# ------------------------------------------------------------------------------------------------ design, gates
def design_of(args: argparse.Namespace) -> dict[str, Any]:
    try:
        recipe = str(pathlib.Path(args.recipe).resolve().relative_to(ROOT))
    except ValueError:
        raise SystemExit(f"--recipe {args.recipe} must be inside the repository ({ROOT}): the records name it from "
                         "there") from None
    return {"task": TASK, "recipe": recipe, "model": args.model, "steps": args.steps,
            "steps_per_generation": args.steps_per_generation, "grad_accum": args.grad_accum,
            "learning_rate": args.learning_rate, "drift_every": args.drift_every, "use_vllm": args.vllm,
            "extra": list(args.extra)}


def arm_flags(arm: str, design: dict[str, Any], kappa: float | None) -> list[str]:
    """The dfpo-train flags of one arm on top of the recipe (the module docstring says why each)."""
    ga = design["grad_accum"]
    spg = ga if arm == "anchor" else design["steps_per_generation"]
    if spg % ga:
        raise SystemExit(f"--steps-per-generation {spg} must be a multiple of --grad-accum {ga} (TRL's rule)")
    transform = {"anchor": "none", "gspo": "none", "mr_w": "min_replace", "mr_g": "min_replace", "scale": "scale"}
    flags = [*common.SEQUENCE_GSPO, "--group_granular_batches", "true", "--steps_per_generation", str(spg),
             "--gradient_accumulation_steps", str(ga), "--learning_rate", str(design["learning_rate"]),
             "--drift_every", str(design["drift_every"]), "--eval_every", "0", "--logging_steps", "1",
             "--use_vllm", "true" if design["use_vllm"] else "false", "--group_transform", transform[arm]]
    if arm == "mr_g":
        flags += ["--cancellation_target", "gradient"]
    if arm == "scale":
        if kappa is None or not 0 < kappa:
            raise SystemExit("arm scale needs --kappa > 0 (the pilot's mean off-policy φ of mr_w: matched φ)")
        flags += ["--transform_scale", f"{kappa:.6g}"]
    return flags


def compute_gates(records: list[dict[str, Any]], thresholds: dict[str, float]) -> dict[str, Any]:
    """Gate (a): gspo learned in ≥ min_learned_share of its pilot runs; gate (b): mr_w's mean off-policy φ ≤ max_phi."""
    base = [r for r in records if r["method"] == "gspo"]
    n_learned = sum(learned(r, learned_rule(thresholds)) for r in base)
    share = n_learned / len(base) if base else None
    phis = [p for r in records if r["method"] == "mr_w" and r.get("complete") and (p := phi_offpolicy(r)) is not None]
    phi = statistics.fmean(phis) if phis else None
    a = {"passed": share is not None and share >= thresholds["min_learned_share"], "runs": len(base),
         "learned": n_learned, "share": share}
    b = {"passed": phi is not None and phi <= thresholds["max_phi"], "runs": len(phis), "phi_offpolicy_mean": phi,
         "per_run": phis}
    return {"baseline_learns": a, "transform_moves_weights": b, "passed": a["passed"] and b["passed"],
            "thresholds": thresholds, "kappa_matched": phi}


def records_in(stage_dir: pathlib.Path) -> list[dict[str, Any]]:
    paths = sorted([*(stage_dir / "runs").glob("*.json"), *(stage_dir / "runs").glob("*.json.gz")])
    return [common.read_record(str(p)) for p in paths]


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write_gates(out_dir: pathlib.Path, thresholds: dict[str, float], force: bool = False) -> dict[str, Any]:
    """Gates from OUT/pilot's records to OUT/gates.json; refused once OUT/main holds a record (an outcome could have
    been read), unless ``force`` (recorded)."""
    if records_in(out_dir / "main") and not force:
        raise SystemExit(f"{out_dir / 'main'} already holds run records: gates are written before the main stage "
                         "(--force rewrites them and records that)")
    stage = json.loads((out_dir / "pilot" / "stage.json").read_text())
    gates = {**compute_gates(records_in(out_dir / "pilot"), thresholds), "design": stage["design"],
             "written_at": now(), "forced_after_main": bool(records_in(out_dir / "main"))}
    (out_dir / "gates.json").write_text(json.dumps(gates, indent=1) + "\n")
    return gates


def check_gates(path: pathlib.Path, design: dict[str, Any], force: bool) -> dict[str, Any]:
    """The gate state the main stage starts under; SystemExit (naming the fix) unless gates exist, passed and were
    measured on this design, or ``force``."""
    problem, gates = None, None
    if not path.exists():
        problem = f"no gates file {path}: run --stage pilot (or --write-gates) first"
    else:
        gates = json.loads(path.read_text())
        changed = [k for k in DESIGN_KEYS if gates["design"].get(k) != design.get(k)]
        if not gates["passed"]:
            problem = f"the pilot's gates failed ({path}): change the design (--steps-per-generation, --learning-rate)"
        elif changed:
            problem = f"the main design differs from the pilot's in {changed}: use the pilot's values"
    if problem and not force:
        raise SystemExit(problem + " (or --force, which is recorded)")
    return {"passed": bool(gates and gates["passed"]), "forced": bool(problem), "problem": problem,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None,
            "written_at": gates.get("written_at") if gates else None}


def select_design(stage_dirs: list[pathlib.Path], root: pathlib.Path) -> dict[str, Any] | None:
    """The design the main stage runs: the first of ``stage_dirs`` (in the order given, fixed before any pilot ran)
    whose gates passed. None until every pilot has written its gates; writes ROOT/selection.json (every candidate's
    gates and the rule) and ROOT/selected (the chosen folder, empty when none passed)."""
    gates = {}
    for folder in stage_dirs:
        path = folder / "gates.json"
        if not path.exists():
            return None
        gates[str(folder)] = json.loads(path.read_text())
    chosen = next((name for name, g in gates.items() if g["passed"]), None)
    selection = {"rule": "the first design in the listed order whose two gates passed (order fixed before the "
                         "pilots ran)", "order": [str(f) for f in stage_dirs], "selected": chosen,
                 "candidates": {name: {"design": g["design"], "passed": g["passed"],
                                       "gspo_learned": [g["baseline_learns"]["learned"], g["baseline_learns"]["runs"]],
                                       "mr_w_phi_offpolicy": g["transform_moves_weights"]["phi_offpolicy_mean"]}
                                for name, g in gates.items()},
                 "written_at": now()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "selection.json").write_text(json.dumps(selection, indent=1) + "\n")
    (root / "selected").write_text((chosen or "") + "\n")
    return selection


# ------------------------------------------------------------------------------------------------ launch
def launch_stage(args: argparse.Namespace) -> None:
    """Run one stage's queue through the launcher (common.launch) (seed-major, so a stopped stage stays balanced)."""
    out = pathlib.Path(args.out_dir)
    design, gates_state, kappa, kappa_source = design_of(args), None, args.kappa, "--kappa"
    arms = args.arms or (list(ARMS) if args.stage == "main" or args.kappa else [a for a in ARMS if a != "scale"])
    if args.stage == "main":
        gates_state = check_gates(out / "gates.json", design, args.force)
        if kappa is None and gates_state["written_at"]:
            kappa, kappa_source = json.loads((out / "gates.json").read_text())["kappa_matched"], "gates (matched φ)"
        seeds = {a: list(range(args.seed_start, args.seed_start + (args.primary_seeds if a in PRIMARY
                                                                   else args.secondary_seeds))) for a in arms}
    else:
        seeds = {a: list(args.pilot_seeds) for a in arms}
    flags = {a: arm_flags(a, design, kappa) for a in arms}
    stage_dir = out / args.stage
    stage_dir.mkdir(parents=True, exist_ok=True)
    stage_file = stage_dir / "stage.json"
    before = json.loads(stage_file.read_text()) if stage_file.exists() else {}  # a stage resumed after a deadline
    if before and before["flags"] != flags and not args.force:
        raise SystemExit(f"{stage_dir} was started with other flags: resume it with the same options or use a new "
                         "--out-dir")
    stage = {"stage": args.stage, "design": design, "arms": arms, "seeds": seeds, "kappa": kappa,
             "kappa_source": kappa_source if "scale" in arms else None, "gates": gates_state,
             "started_at": before.get("started_at", now()), "launches": [*before.get("launches", []), now()],
             "checkout": checkout_state(ROOT), "flags": flags}
    stage_file.write_text(json.dumps(stage, indent=1) + "\n")
    queue = [common.Run(TASK, a, s, flags[a]) for s in sorted({s for v in seeds.values() for s in v})
             for a in arms if s in seeds[a]]
    args.out_dir, args.vllm_memory = str(stage_dir), args.vllm_memory if args.vllm else None
    common.launch(args, queue)
    args.out_dir = str(out)
    done = {(r["method"], r["seed"]) for r in records_in(stage_dir)}
    left = [r.name for r in queue if (r.method, r.seed) not in done]
    if left:
        print(f"{args.stage}: {len(left)} runs not run yet (run the same command again); gates not written", flush=True)
    elif args.stage == "pilot":
        gates = write_gates(out, thresholds(args), force=args.force)
        print(f"gates ({out / 'gates.json'}): passed {gates['passed']}, gspo learned "
              f"{gates['baseline_learns']['learned']}/{gates['baseline_learns']['runs']}, mr_w off-policy φ "
              f"{gates['transform_moves_weights']['phi_offpolicy_mean']}", flush=True)


def learned_rule(thresholds: dict[str, Any]) -> LearnedRule:
    return thresholds["learned_threshold"], thresholds.get("learned_gain")


def thresholds(args: argparse.Namespace) -> dict[str, Any]:
    return {"learned_threshold": args.learned_threshold, "learned_gain": args.learned_gain,
            "min_learned_share": args.min_learned_share,
            "max_phi": args.max_phi}


# ------------------------------------------------------------------------------------------------ aggregate
def stage_context(stage_dir: pathlib.Path, gates_path: pathlib.Path | None, default_threshold: LearnedRule
                  ) -> tuple[dict[str, Any], dict[str, Any] | None, LearnedRule]:
    """The stage's launch record, the gates (None if absent) and the learned rule (the gates', as recorded)."""
    stage_file = stage_dir / "stage.json"
    stage = json.loads(stage_file.read_text()) if stage_file.exists() else {}
    path = gates_path or stage_dir.parent / "gates.json"
    gates = json.loads(path.read_text()) if path.exists() else None
    threshold = learned_rule(gates["thresholds"]) if gates else default_threshold
    return stage, gates, threshold


def aggregate(stage_dir: pathlib.Path, out: pathlib.Path, figures: pathlib.Path | None,
              gates_path: pathlib.Path | None = None, default_threshold: LearnedRule = (0.8, None)
              ) -> dict[str, Any]:
    """Per-run rows, per-arm summaries, the comparisons with their MDEs and verdicts, one figure per arm."""
    stage, gates, threshold = stage_context(stage_dir, gates_path, default_threshold)
    gates_state = stage.get("gates") or {"passed": bool(gates and gates["passed"]), "forced": False}
    rows = sorted((run_row(r, threshold, gates_state) for r in records_in(stage_dir)),
                  key=lambda r: (list(ARMS).index(r["arm"]), r["seed"]))
    if not rows:
        raise SystemExit(f"no run records in {stage_dir / 'runs'}: give a stage folder (e.g. OUT/main)")
    arms: dict[str, Any] = {}
    for arm in [a for a in ARMS if any(r["arm"] == a for r in rows)]:
        mine = [r for r in rows if r["arm"] == arm]
        values = [r["auc_set_entropy"] for r in mine if r["learned"] and r["auc_set_entropy"] is not None]
        diag = [r["diagnostics"] for r in mine if r["diagnostics"]]
        arms[arm] = {
            "label": ARMS[arm], "runs": len(mine), "complete": sum(r["complete"] for r in mine),
            "learned": len(values), "failed_or_short": sum(not r["complete"] for r in mine),
            "not_learned": sum(r["complete"] and not r["learned"] for r in mine),
            "auc_mean": statistics.fmean(values) if values else None,
            "auc_sd": statistics.stdev(values) if len(values) > 1 else None, "auc": values,
            "diagnostics": {k: statistics.fmean(v) if (v := [d[k] for d in diag if d[k] is not None]) else None
                            for k in ("phi_offpolicy", "clip_fraction", "zero_grad_share", "one_sided_groups",
                                      "zero_variance_groups", "is_ratio_std")},
        }
    comparisons = {}
    for a, b in COMPARISONS:
        if a in arms and b in arms:
            name = f"{a} - {b}"
            result = welch(arms[a]["auc"], arms[b]["auc"])
            comparisons[name] = {"welch": result, "verdict": verdict(name, result)}
    made = [repo_relative(f) for f in plot_arms(rows, figures)] if figures is not None else []
    study = {"study": "v2", "task": TASK, "stage": stage.get("stage"), "design": stage.get("design"),
             "kappa": stage.get("kappa"), "kappa_source": stage.get("kappa_source"), "stage_record": stage,
             "gates": gates, "gates_before_stage": gates_before(stage, gates_path or stage_dir.parent / "gates.json"),
             "learned_threshold": threshold[0], "learned_gain": threshold[1],
             "primary_metric": "area under drift set_entropy over optimizer steps (trapezoid) / step span, "
                               "among runs that learned (held-out after >= learned_threshold, or after - before >= "
                               "learned_gain when set)",
             "mde_power": 0.8, "alpha": 0.05, "card": sorted({str(r["card"]) for r in rows}),
             "arms": arms, "comparisons": comparisons, "figures": made, "runs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(study) + "\n")
    return study


def repo_relative(path: str) -> str:
    """A path inside the repository as the repository names it (a results file names no machine's folders)."""
    resolved = pathlib.Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def gates_before(stage: dict[str, Any], path: pathlib.Path) -> bool | None:
    """Whether the gates were written before this (main) stage started and are unchanged since; None for a stage
    launched without gates (the pilot)."""
    state = stage.get("gates")
    if not state or not state.get("sha256") or not path.exists():
        return None
    unchanged = hashlib.sha256(path.read_bytes()).hexdigest() == state["sha256"]
    return unchanged and state["written_at"] <= stage["started_at"]


def plot_arms(rows: list[dict[str, Any]], folder: pathlib.Path) -> list[str]:
    """figures/study_v2_<arm>.png: every run's set-entropy curve (dotted: did not learn), the learned runs' mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for arm in [a for a in ARMS if any(r["arm"] == a for r in rows)]:
        mine = [r for r in rows if r["arm"] == arm and r["set_entropy_curve"]]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for r in mine:
            steps, values = zip(*r["set_entropy_curve"], strict=True)
            ax.plot(steps, values, color="0.6", lw=0.7, ls="-" if r["learned"] else ":")
        good = [dict(map(tuple, r["set_entropy_curve"])) for r in mine if r["learned"]]
        common = sorted(set.intersection(*(set(g) for g in good))) if good else []
        if common:
            ax.plot(common, [statistics.fmean(g[s] for g in good) for s in common], color="C0", lw=2.2,
                    label=f"mean of {len(good)} learned runs")
            ax.legend(loc="best", fontsize=8)
        ax.set(xlabel="optimizer step", ylabel="set entropy (nats)",
               title=f"{arm}: {ARMS[arm]} ({len(mine)} runs; dotted: did not learn)")
        ax.title.set_fontsize(9)
        fig.tight_layout()
        path = folder / f"study_v2_{arm}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(str(path))
    return made


def sd_check(stage_dir: pathlib.Path, effect: float, first: int, gates_path: pathlib.Path | None = None,
             default_threshold: LearnedRule = (0.8, None)) -> dict[str, Any]:
    """The SD of each arm's primary metric over its first ``first`` seeds (learned runs only) and the n per arm
    whose MDE is ``effect``; no means are shown, so reading it does not read an outcome."""
    _, _, threshold = stage_context(stage_dir, gates_path, default_threshold)
    records = records_in(stage_dir)
    sds: dict[str, Any] = {}
    for arm in [a for a in ARMS if any(r["method"] == a for r in records)]:
        seeds = sorted({r["seed"] for r in records if r["method"] == arm})[:first]
        rows = [run_row(r, threshold, {}) for r in records if r["method"] == arm and r["seed"] in seeds]
        values = [r["auc_set_entropy"] for r in rows if r["learned"] and r["auc_set_entropy"] is not None]
        sds[arm] = {"seeds": seeds, "learned": len(values), "sd": statistics.stdev(values) if len(values) > 1
                    else None}
    needs = {}
    for a, b in COMPARISONS:
        if sds.get(a, {}).get("sd") is not None and sds.get(b, {}).get("sd") is not None:
            needs[f"{a} - {b}"] = n_needed(sds[a]["sd"], sds[b]["sd"], effect)
    result = {"effect": effect, "first": first, "learned_threshold": threshold[0], "learned_gain": threshold[1],
              "sd": sds, "n_per_arm": needs,
              "written_at": now()}
    (stage_dir / "sd_check.json").write_text(json.dumps(result, indent=1) + "\n")
    for arm, entry in sds.items():
        print(f"{arm:7s} SD {entry['sd']} over {entry['learned']} learned runs of seeds {entry['seeds']}")
    for name, n in needs.items():
        print(f"{name:15s} n per arm for MDE {effect}: {n}")
    return result


# ------------------------------------------------------------------------------------------------ smoke, main
def smoke(args: argparse.Namespace) -> dict[str, Any]:
    """The whole pipeline on the CPU: a tiny random model (common.smoke_model), transformers' generate, 4 steps
    with a rollout every 2; pilot (gspo, mr_w, seed 0) -> gates -> main (every arm, 2 seeds) -> SD check ->
    aggregate. The tiny model learns nothing, so the smoke gates are learned_threshold 0 and max_phi 1 (recorded)."""
    out = pathlib.Path(args.out_dir)
    args.model = common.smoke_model(out)
    args.steps, args.steps_per_generation, args.grad_accum, args.drift_every, args.vllm = 4, 2, 1, 2, False
    args.parallel, args.gpus, args.learned_threshold, args.max_phi = 2, [], 0.0, 1.0
    args.extra = [*common.SMOKE_FLAGS, "--eval_every", "0", *args.extra]
    args.stage, args.arms, args.pilot_seeds = "pilot", ["gspo", "mr_w"], [0]
    launch_stage(args)
    args.stage, args.arms, args.primary_seeds, args.secondary_seeds = "main", None, 2, 2
    launch_stage(args)
    sd_check(out / "main", effect=0.1, first=2)
    return aggregate(out / "main", out / "study_v2.json", out / "figures")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stage", choices=["pilot", "main"], help="launch a stage's runs")
    mode.add_argument("--write-gates", action="store_true", help="gates from OUT_DIR/pilot to OUT_DIR/gates.json")
    mode.add_argument("--status", metavar="STAGE_DIR")
    mode.add_argument("--aggregate", metavar="STAGE_DIR", help="a stage folder with runs/ (and stage.json)")
    mode.add_argument("--sd-check", metavar="STAGE_DIR", help="SDs over the first --first seeds, n for --effect")
    mode.add_argument("--smoke", action="store_true", help="CPU check of the whole pipeline")
    mode.add_argument("--select", nargs="+", metavar="PILOT_OUT_DIR",
                      help="choose the main design among pilots (each an --out-dir): the first whose gates passed")
    p.add_argument("--recipe", default=str(common.RECIPE))
    p.add_argument("--model", default=None, help="model_name_or_path (default: the recipe's, the embedded model)")
    p.add_argument("--steps", type=int, default=64, help="optimizer steps per run")
    p.add_argument("--steps-per-generation", type=int, default=16, help="S of the stale arms")
    p.add_argument("--grad-accum", type=int, default=None, help="gradient_accumulation_steps (default: recipe's)")
    p.add_argument("--learning-rate", type=float, default=None, help="default: the recipe's")
    p.add_argument("--drift-every", type=int, default=8)
    p.add_argument("--vllm", action="store_true", help="colocated vLLM generation (default: transformers')")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=None,
                   help="default: pilot every arm but scale (scale too with --kappa); main every arm")
    p.add_argument("--kappa", type=float, default=None, help="κ of scale (main default: the gates' matched φ)")
    p.add_argument("--pilot-seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--seed-start", type=int, default=100, help="first main seed (fresh: not the pilot's)")
    p.add_argument("--primary-seeds", type=int, default=40, help="main seeds of gspo and mr_w")
    p.add_argument("--secondary-seeds", type=int, default=10, help="main seeds of the other arms")
    p.add_argument("--learned-threshold", type=float, default=0.8, help="held-out after >= this: learned the format")
    p.add_argument("--learned-gain", type=float, default=None,
                   help="learned instead: held-out after - before >= this (replaces --learned-threshold)")
    p.add_argument("--min-learned-share", type=float, default=0.8, help="gate (a): share of gspo pilot runs learned")
    p.add_argument("--max-phi", type=float, default=0.95, help="gate (b): mr_w's mean off-policy φ at most this")
    p.add_argument("--force", action="store_true", help="start main without passed gates (recorded)")
    p.add_argument("--out-dir", default="/tmp/study_v2")
    p.add_argument("--parallel", type=int, default=12)
    p.add_argument("--gpus", nargs="*", type=int, default=[], help="CUDA device indices, round-robin")
    p.add_argument("--vllm-memory", type=float, default=0.05, help="vllm_gpu_memory_utilization (with --vllm)")
    p.add_argument("--via-accelerate", action="store_true")
    p.add_argument("--start-timeout", type=float, default=None,
                   help="s before the next run starts anyway (default 240 with --vllm: engines start one at a time; "
                        "0 without)")
    p.add_argument("--deadline-s", type=float, default=None, help="start no run that would end after this")
    p.add_argument("--expected-run-s", type=float, default=300.0)
    p.add_argument("--skip-done", nargs="*", default=[])
    p.add_argument("--gates", default=None, help="gates file (default: STAGE_DIR/../gates.json)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "study_v2.json"))
    p.add_argument("--figures-dir", default=str(ROOT / "benchmarks" / "figures"))
    p.add_argument("--effect", type=float, default=0.05, help="--sd-check: the difference to detect")
    p.add_argument("--first", type=int, default=10, help="--sd-check: seeds per arm")
    p.add_argument("extra", nargs="*", help="further dfpo-train flags after --, given to every run")
    args = p.parse_args(argv)
    recipe = long_run_recipe(args.recipe)
    args.grad_accum = args.grad_accum or int(recipe.get("gradient_accumulation_steps", 1))
    args.learning_rate = args.learning_rate or float(recipe["learning_rate"])
    if args.start_timeout is None:
        args.start_timeout = 240.0 if args.vllm else 0.0
    gates = pathlib.Path(args.gates) if args.gates else None
    if args.smoke:
        study = smoke(args)
    elif args.stage:
        return launch_stage(args)
    elif args.select:
        selection = select_design([pathlib.Path(d) for d in args.select], pathlib.Path(args.out_dir))
        print(json.dumps(selection, indent=1) if selection else "not every pilot has written its gates yet")
        return selection
    elif args.write_gates:
        return write_gates(pathlib.Path(args.out_dir), thresholds(args), force=args.force)
    elif args.status:
        return common.status(args.status)
    elif args.sd_check:
        return sd_check(pathlib.Path(args.sd_check), args.effect, args.first, gates,
                        (args.learned_threshold, args.learned_gain))
    else:
        study = aggregate(pathlib.Path(args.aggregate), pathlib.Path(args.out), pathlib.Path(args.figures_dir), gates,
                          (args.learned_threshold, args.learned_gain))
    for name, entry in study["arms"].items():
        print(f"{name:7s} runs {entry['runs']}, learned {entry['learned']}, failed {entry['failed_or_short']}, "
              f"not learned {entry['not_learned']}, off-policy φ {entry['diagnostics']['phi_offpolicy']}")
    for entry in study["comparisons"].values():
        print(entry["verdict"])
    if study["stage"] == "main" and study["gates_before_stage"] is not True:
        print("WARNING: the gates were not written before this stage started, or changed since (gates_before_stage)")
    return study


def long_run_recipe(path: str) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(pathlib.Path(path).read_text())


if __name__ == "__main__":
    main()
