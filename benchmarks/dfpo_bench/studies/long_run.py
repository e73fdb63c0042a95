"""The long-run study: the DFPO paper's long-training predictions with vLLM generation, several seeds per method.

    # on the GPU machine (after the kit's setup with vLLM): every (task, method, seed) is one `dfpo-train` run of
    # recipes/smollm2_gpu_vllm.yaml, N at a time on one GPU, vLLM engines started one after another
    python -m dfpo_bench.studies.long_run --launch --model /root/models/smollm2-135m-instruct --out-dir /tmp/long_run \
        --tasks two_forms sum_sentence --methods gspo min_replace min_replace_grad positive_orth_proj_grad \
        --seeds 0 1 2 3 4 --parallel 10
    python -m dfpo_bench.studies.long_run --status /tmp/long_run           # finished, failed, running
    # here: one record per run in benchmarks/results/long_run/, merged with the statistics into long_run.json
    python -m dfpo_bench.studies.long_run --aggregate benchmarks/results/long_run/*.json.gz
    # CPU check of the launcher and the aggregation (a tiny random model, transformers' generate, 2 x 2 runs)
    python -m dfpo_bench.studies.long_run --smoke --out-dir /tmp/long-run-smoke

Each run trains one method from the same pretrained weights with one seed (the seed sets the training problems'
order and TRL's sampler; vLLM's sampler is seeded by TRL with the process index, the same in every run) for
``--steps`` optimizer steps, and its `dfpo_summary.json` (held-out greedy accuracy every 50 steps, the drift meter
every 10, every logged step) is reduced to one record: ``<task>__<method>__s<seed>.json``, written as soon as the
run ends. ``--aggregate`` computes, per task and method, the checkpoints' values (:data:`CHECKPOINTS`) and each
method's difference from its baseline (GSPO, or DAPO for GRPO-fix) with a seed-paired 95% t-interval (the same seed
gives both methods the same problems), and a verdict per prediction: "resolved for" when the interval excludes 0
in the predicted direction, "resolved against" when it excludes 0 in the other, "not resolved" otherwise.

Several vLLM engines on one GPU: an engine measures free memory while it starts, and another engine starting or
freeing memory at that moment fails it ("Error in memory profiling"); so the launcher starts the next run only
once the last one's engine is up (its trainer logged the group layout), and retries a run that failed that way.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]
from dfpo_bench.lib import common  # noqa: E402
from dfpo_bench.lib.common import RECIPE, SEQUENCE_GSPO, SMOKE_FLAGS, Run, read_record, smoke_model, status  # noqa: E402

CHECKPOINTS = (100, 200, 300)
WINDOW = 25  # per-step metrics at a checkpoint: the mean over the WINDOW steps up to it
TOKEN_DAPO = ["--importance_sampling_level", "token", "--loss_type", "dapo", "--epsilon", "0.2",
              "--epsilon_high", "0.28"]
# method -> (flags on top of the recipe, baseline method, label)
METHODS: dict[str, tuple[list[str], str, str]] = {
    "gspo": ([*SEQUENCE_GSPO, "--group_transform", "none", "--group_granular_batches", "true"], "gspo", "GSPO"),
    "min_replace": ([*SEQUENCE_GSPO, "--group_transform", "min_replace"], "gspo", "Min-Replace (weights)"),
    "min_replace_grad": (
        [*SEQUENCE_GSPO, "--group_transform", "min_replace", "--cancellation_target", "gradient"], "gspo",
        "Min-Replace (gradient)",
    ),
    "positive_orth_proj_grad": (
        [*SEQUENCE_GSPO, "--group_transform", "positive_orth_proj", "--cancellation_target", "gradient"], "gspo",
        "Positive Orth-Proj (gradient)",
    ),
    "dapo": ([*TOKEN_DAPO, "--group_transform", "none", "--group_granular_batches", "true"], "dapo", "DAPO"),
    "grpo_fix": (
        [*TOKEN_DAPO, "--group_transform", "none", "--group_granular_batches", "true", "--symmetric_clip", "true"],
        "dapo", "GRPO-fix",
    ),
}
# Predictions (DFPO paper §4.5 and Corollary 3.2): (name, metric, None = whole run or "last" checkpoint, direction).
# direction -1: the method should be lower than its baseline; +1: higher.
PREDICTIONS = (
    ("learning tax", "energy_bucket0", None, -1,
     "share of the LM-head gradient energy on the most frequent quarter of token occurrences (eq. 24), mean over "
     "all steps"),
    ("sample efficiency", "steps_to_threshold", None, -1, "optimizer steps until the reward EMA reaches κ (eq. 19)"),
    ("stability", "jitter2", None, -1, "Jitter₂ of the per-step training reward over the run (eq. 20)"),
    ("endpoint", "heldout", "last", +1, "held-out greedy accuracy at the last checkpoint"),
    ("equivalent-solution drift", "drift_abs", "last", -1,
     "mean |log-odds| between the equivalent forms at the last checkpoint (D2)"),
    ("entropy on the equivalent set", "set_entropy", "last", +1,
     "entropy over the equivalent forms at the last checkpoint (D3)"),
)


# ------------------------------------------------------------------------------------------------ one run
def value_at(curve: list[list[float]], step: int) -> float | None:
    """The value of a [[step, value]] curve at ``step`` (None if not measured there)."""
    for s, v in curve:
        if int(s) == step:
            return float(v)
    return None


def window_mean(points: list[list[float]], step: int | None, width: int = WINDOW) -> float | None:
    """Mean of a per-step series over (step − width, step]; over every point when ``step`` is None."""
    values = [v for s, v in points if step is None or step - width < s <= step]
    return statistics.fmean(values) if values else None


def jitter2(values: list[float]) -> float | None:
    """eq. 20: mean |m_{t+2} − 2 m_{t+1} + m_t|."""
    if len(values) < 3:
        return None
    return statistics.fmean(abs(values[t + 2] - 2 * values[t + 1] + values[t]) for t in range(len(values) - 2))


def run_metrics(record: dict[str, Any], steps: int, checkpoints: tuple[int, ...] = CHECKPOINTS) -> dict[str, Any]:
    """The study's metrics of one run: per checkpoint and over the whole run."""
    s = record.get("series", {})
    drift = (record.get("drift") or {}).get("curve") or []
    heldout = (record.get("heldout") or {}).get("curve") or []
    out: dict[str, Any] = {}
    for c in [*checkpoints, None]:
        if c is not None and c > steps:
            continue
        tag = "run" if c is None else str(c)
        out[tag] = {
            "heldout": value_at(heldout, c) if c is not None else (record.get("heldout") or {}).get("after"),
            "entropy": window_mean(s.get("entropy", []), c),
            "energy_bucket0": window_mean(s.get("energy/freq_bucket_0", []), c),
            "clip_fraction": window_mean(s.get("clip_ratio/region_mean", []), c),
            "shared_residual": window_mean(s.get("cancellation/shared_prefix_residual", []), c),
            "drift_abs": next((d["log_odds_abs_mean"] for d in drift if d["step"] == c), None)
            if c is not None else (drift[-1]["log_odds_abs_mean"] if drift else None),
            "set_entropy": next((d["set_entropy"] for d in drift if d["step"] == c), None)
            if c is not None else (drift[-1]["set_entropy"] if drift else None),
            "reward": window_mean(s.get("step_reward", []), c),
            "jitter2": jitter2([v for st, v in s.get("step_reward", []) if c is None or st <= c]),
        }
    threshold_steps = record.get("steps_to_threshold")
    # never reaching κ: counted as steps + 1, a lower bound (censored), and said so in the report
    out["run"]["steps_to_threshold"] = threshold_steps if threshold_steps is not None else steps + 1
    out["run"]["reached_threshold"] = threshold_steps is not None
    return out


def paired_interval(a: list[float | None], b: list[float | None]) -> dict[str, Any] | None:
    """mean(a_s − b_s) over seeds with both values, with a 95% paired t-interval; None for fewer than 2 pairs."""
    from dfpo_bench.lib.stats import t_quantile  # noqa: PLC0415 - benchmarks/dfpo_bench/lib/stats.py

    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    if len(pairs) < 2:
        return None
    d = [x - y for x, y in pairs]
    mean = statistics.fmean(d)
    half = t_quantile(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(d)}


def verdict(interval: dict[str, Any] | None, direction: int) -> str:
    if interval is None:
        return "not measured"
    if (interval["low"] > 0 and direction > 0) or (interval["high"] < 0 and direction < 0):
        return "resolved for"
    if (interval["low"] > 0 and direction < 0) or (interval["high"] < 0 and direction > 0):
        return "resolved against"
    return "not resolved"


def launch(args: argparse.Namespace, queue: list[Run] | None = None) -> None:
    """The launcher on ``queue`` (default: every seed x task x method of ``args``, with :data:`METHODS`' flags)."""
    if queue is None:
        queue = [Run(t, m, s, METHODS[m][0]) for s in args.seeds for t in args.tasks for m in args.methods]
    common.launch(args, queue)


def aggregate(paths: list[str], out: str, checkpoints: tuple[int, ...] = CHECKPOINTS) -> dict[str, Any]:
    records = [read_record(p) for p in paths]
    complete = [r for r in records if r.get("complete")]
    steps = min((r["steps"] for r in complete), default=0)
    checkpoints = tuple(c for c in checkpoints if c <= steps)
    last = str(checkpoints[-1]) if checkpoints else "run"
    study: dict[str, Any] = {
        "card": sorted({r["card"] for r in records}), "versions": complete[0]["versions"] if complete else {},
        "steps": steps, "checkpoints": list(checkpoints), "window": WINDOW,
        "settings": complete[0]["settings"] if complete else {},
        "runs": [{k: r.get(k) for k in ("task", "method", "seed", "complete", "steps", "wall_s", "attempts",
                                        "exit_code", "card")} for r in records],
        "tasks": {},
    }
    for task in sorted({r["task"] for r in complete}):
        per_method: dict[str, Any] = {}
        for method in [m for m in METHODS if any(r["method"] == m and r["task"] == task for r in complete)]:
            runs = sorted((r for r in complete if r["task"] == task and r["method"] == method),
                          key=lambda r: r["seed"])
            per_method[method] = {
                "label": METHODS[method][2], "baseline": METHODS[method][1], "seeds": [r["seed"] for r in runs],
                "metrics": [run_metrics(r, steps, checkpoints) for r in runs],
                "curves": {name: [r["series"].get(name, []) for r in runs] for name in
                           ("step_reward", "entropy", "energy/freq_bucket_0", "clip_ratio/region_mean")},
                "heldout_curves": [(r.get("heldout") or {}).get("curve") or [] for r in runs],
                "drift_curves": [(r.get("drift") or {}).get("curve") or [] for r in runs],
            }
        for method, entry in per_method.items():
            base = per_method.get(entry["baseline"])
            if base is None or method == entry["baseline"]:
                continue
            comparisons = {}
            for tag in [*map(str, study["checkpoints"]), "run"]:
                for metric in entry["metrics"][0].get(tag, {}) if entry["metrics"] else {}:
                    mine = {s: m.get(tag, {}).get(metric) for s, m in zip(entry["seeds"], entry["metrics"],
                                                                          strict=True)}
                    theirs = {s: m.get(tag, {}).get(metric) for s, m in zip(base["seeds"], base["metrics"],
                                                                            strict=True)}
                    seeds = sorted(set(mine) & set(theirs))
                    interval = paired_interval([mine[s] for s in seeds], [theirs[s] for s in seeds])
                    if interval is not None:
                        comparisons[f"{metric}@{tag}"] = interval
            entry["difference_from_baseline"] = comparisons
            entry["verdicts"] = {}
            for name, metric, at, direction, what in PREDICTIONS:
                tag = last if at == "last" else "run"
                entry["verdicts"][name] = {
                    "metric": metric, "at": tag, "direction": direction, "what": what,
                    "difference": comparisons.get(f"{metric}@{tag}"),
                    "verdict": verdict(comparisons.get(f"{metric}@{tag}"), direction),
                }
        study["tasks"][task] = per_method
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(json.dumps(study) + "\n")
    return study


# ------------------------------------------------------------------------------------------------ smoke
def smoke(args: argparse.Namespace) -> dict[str, Any]:
    """The launcher and the aggregation on the CPU: a tiny random model (tests/tiny.py), transformers' generate,
    one task x (GSPO, Min-Replace) x 2 seeds of 4 steps, two at a time."""
    out = pathlib.Path(args.out_dir)
    args.model, args.steps, args.parallel, args.vllm_memory, args.gpus = smoke_model(out), 4, 2, None, []
    args.tasks, args.methods, args.seeds = ["two_forms"], ["gspo", "min_replace"], [0, 1]
    args.extra = SMOKE_FLAGS + list(args.extra)
    launch(args)
    return aggregate(sorted(str(p) for p in (out / "runs").glob("*.json")), str(out / "long_run.json"),
                     checkpoints=(2, 4))


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--launch", action="store_true")
    mode.add_argument("--status", metavar="OUT_DIR")
    mode.add_argument("--aggregate", nargs="+", metavar="RUN_JSON")
    mode.add_argument("--smoke", action="store_true", help="CPU check of the launcher and the aggregation")
    p.add_argument("--recipe", default=str(RECIPE))
    p.add_argument("--model", default=None, help="model_name_or_path (default: the recipe's, the embedded model)")
    p.add_argument("--out-dir", default="/tmp/long_run")
    p.add_argument("--tasks", nargs="+", default=["two_forms", "sum_sentence"])
    p.add_argument("--methods", nargs="+", default=["gspo", "min_replace", "min_replace_grad",
                                                    "positive_orth_proj_grad"], choices=sorted(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoints", nargs="+", type=int, default=list(CHECKPOINTS))
    p.add_argument("--parallel", type=int, default=10, help="runs at once (on each GPU with --gpus)")
    p.add_argument("--gpus", nargs="*", type=int, default=[],
                   help="CUDA devices; each new run goes to the least busy (default: no pinning)")
    p.add_argument("--vllm-memory", type=float, default=0.05, help="vllm_gpu_memory_utilization of each run")
    p.add_argument("--via-accelerate", action="store_true", help="start each run with `accelerate launch`")
    p.add_argument("--start-timeout", type=float, default=240.0, help="s before the next run starts anyway")
    p.add_argument("--deadline-s", type=float, default=None, help="start no run that would end after this")
    p.add_argument("--expected-run-s", type=float, default=300.0, help="a run's wall time before one has finished")
    p.add_argument("--skip-done", nargs="*", default=[], help="directories of finished records to skip")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_run.json"))
    p.add_argument("extra", nargs="*", help="further dfpo-train flags after --, given to every run")
    args = p.parse_args(argv)
    if args.status:
        status(args.status)
    elif args.aggregate or args.smoke:
        study = smoke(args) if args.smoke else aggregate(args.aggregate, args.out, tuple(args.checkpoints))
        for task, methods in study["tasks"].items():
            for method, entry in methods.items():
                for name, v in (entry.get("verdicts") or {}).items():
                    print(f"{task:13s} {method:24s} {name:30s} {v['verdict']}")
    else:
        launch(args)


if __name__ == "__main__":
    main()
