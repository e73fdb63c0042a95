"""The long-run study: the DFPO paper's long-training predictions with vLLM generation, several seeds per method.

    # on the GPU machine (after the kit's setup with vLLM): every (task, method, seed) is one `dfpo-train` run of
    # recipes/smollm2_gpu_vllm.yaml, N at a time on one GPU, vLLM engines started one after another
    python benchmarks/long_run.py --launch --model /root/models/smollm2-135m-instruct --out-dir /tmp/long_run \
        --tasks two_forms sum_sentence --methods gspo min_replace min_replace_grad positive_orth_proj_grad \
        --seeds 0 1 2 3 4 --parallel 10
    python benchmarks/long_run.py --status /tmp/long_run           # finished, failed, running
    # here: one record per run in benchmarks/results/long_run/, merged with the statistics into long_run.json
    python benchmarks/long_run.py --aggregate benchmarks/results/long_run/*.json.gz
    # CPU check of the launcher and the aggregation (a tiny random model, transformers' generate, 2 x 2 runs)
    python benchmarks/long_run.py --smoke --out-dir /tmp/long-run-smoke

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
import gzip
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import checkout_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2_gpu_vllm.yaml"
CHECKPOINTS = (100, 200, 300)
WINDOW = 25  # per-step metrics at a checkpoint: the mean over the WINDOW steps up to it
ENGINE_READY = ("DFPO group layout", "group layout:")  # logged once the trainer (and its vLLM engine) is built
ENGINE_START_FAILURES = ("Error in memory profiling", "release GPU memory while vLLM is profiling")
MAX_ATTEMPTS = 3
SEQUENCE_GSPO = ["--importance_sampling_level", "sequence", "--loss_type", "grpo", "--epsilon", "3e-4",
                 "--epsilon_high", "4e-4"]
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
# Per-step log keys a record keeps (besides every drift/, energy/, cancellation/, asym/, sampling/, clip_ratio/).
STEP_KEYS = ("step_reward", "reward", "entropy", "loss", "grad_norm", "completions/mean_length",
             "heldout/accuracy", "frac_reward_zero_std")
STEP_PREFIXES = ("drift/", "energy/", "cancellation/", "asym/", "sampling/", "clip_ratio/", "transform/",
                 "grpo_fix/", "diagnostics/")
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
def run_flags(
    args: argparse.Namespace, task: str, method: str, seed: int, output_dir: pathlib.Path, port: int = 29600,
    flags: list[str] | None = None,
) -> list[str]:
    """The `dfpo-train` command line of one run (``flags``: the method's, default :data:`METHODS`')."""
    flags = METHODS[method][0] if flags is None else flags
    launcher = [sys.executable, "-m", "dfpo_trl"]
    if args.via_accelerate:
        launcher = ["accelerate", "launch", "--num_processes", "1", "--main_process_port", str(port), "-m", "dfpo_trl"]
    command = [*launcher, str(args.recipe), "--task", task, "--seed", str(seed),
               "--output_dir", str(output_dir), "--max_steps", str(args.steps), "--save_model", "false",
               "--plot", "false", "--disable_tqdm", "true", *flags]
    if args.model:
        command += ["--model_name_or_path", args.model]
    if args.vllm_memory is not None:
        command += ["--vllm_gpu_memory_utilization", str(args.vllm_memory)]
    return command + list(args.extra)


def series(log_history: list[dict[str, Any]], key: str) -> list[list[float]]:
    """[[step, value], ...] of one logged key (finite values only)."""
    out = []
    for row in log_history:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
            out.append([int(row["step"]), float(value)])
    return out


def compact_record(summary: dict[str, Any], key: dict[str, Any]) -> dict[str, Any]:
    """One run's record: its identity, the summary's scalars, the held-out and drift curves, the kept step keys."""
    history = summary.get("log_history") or []
    keys = sorted({k for row in history for k in row
                   if k in STEP_KEYS or k.startswith(STEP_PREFIXES)})
    return {
        **key,
        "steps": summary.get("steps"),
        "heldout": summary.get("heldout"),
        "drift": summary.get("drift"),
        "steps_to_threshold": summary.get("steps_to_threshold"),
        "reward_threshold": summary.get("reward_threshold"),
        "reward_jitter2": summary.get("reward_jitter2"),
        "reward_ema_last": summary.get("reward_ema_last"),
        "time_split": summary.get("time_split"),
        "series": {k: series(history, k) for k in keys},
    }


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "trl", "vllm", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def card() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - only a label
        return "unknown"


# ------------------------------------------------------------------------------------------------ launcher
class Run:
    """One (task, method, seed) process of the launcher; ``flags``: the method's (default :data:`METHODS`'), so
    another study (study_v2.py) can launch its own arms."""

    def __init__(self, task: str, method: str, seed: int, flags: list[str] | None = None) -> None:
        self.task, self.method, self.seed = task, method, seed
        self.flags = list(METHODS[method][0] if flags is None else flags)
        self.attempts = 0
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self.log: pathlib.Path | None = None
        self.checkout: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.task}__{self.method}__s{self.seed}"

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace") if self.log else ""
        except FileNotFoundError:
            return ""

    def engine_ready(self) -> bool:
        return any(marker in self.log_text() for marker in ENGINE_READY)


def start(run: Run, args: argparse.Namespace, index: int) -> None:
    work = pathlib.Path(args.out_dir)
    output_dir = work / "work" / run.name
    output_dir.mkdir(parents=True, exist_ok=True)
    run.log = work / "logs" / f"{run.name}.a{run.attempts}.log"
    run.log.parent.mkdir(parents=True, exist_ok=True)
    port = 29600 + index % 300
    env = dict(os.environ, MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    if args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(args.gpus[index % len(args.gpus)])
    run.attempts += 1
    run.started = time.time()
    run.checkout = checkout_state(ROOT)  # the code this process runs (cwd=ROOT), read as it starts
    with open(run.log, "w") as log:
        command = run_flags(args, run.task, run.method, run.seed, output_dir, port, run.flags)
        run.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)


def finish(run: Run, args: argparse.Namespace, code: int) -> dict[str, Any]:
    """The record of a finished run (a failed one keeps its log's tail)."""
    work = pathlib.Path(args.out_dir)
    key = {"task": run.task, "method": run.method, "seed": run.seed, "card": args.card, "versions": args.versions,
           "attempts": run.attempts, "wall_s": round(time.time() - run.started, 1), "exit_code": code,
           "checkout": run.checkout,
           "settings": {"recipe": str(pathlib.Path(args.recipe).relative_to(ROOT)), "flags": run.flags,
                        "steps": args.steps, "extra": list(args.extra)}}
    summary_path = work / "work" / run.name / "dfpo_summary.json"
    if code == 0 and summary_path.exists():
        record = compact_record(json.loads(summary_path.read_text()), key)
        record["complete"] = record["steps"] is not None and record["steps"] >= args.steps
    else:
        record = {**key, "complete": False, "log_tail": run.log_text()[-3000:]}
    path = work / "runs" / f"{run.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) + "\n")
    return record


def launch(args: argparse.Namespace, queue: list[Run] | None = None) -> None:
    """Run ``queue`` (default: every seed x task x method of ``args``), ``args.parallel`` at a time."""
    args.card, args.versions = card(), versions()
    done_dir = pathlib.Path(args.out_dir) / "runs"
    skip = set()
    for directory in [done_dir, *map(pathlib.Path, args.skip_done)]:
        for path in [*directory.glob("*.json"), *directory.glob("*.json.gz")]:
            if read_record(str(path)).get("complete"):
                skip.add(path.name.split(".json")[0])
    if queue is None:
        queue = [Run(t, m, s) for s in args.seeds for t in args.tasks for m in args.methods]
    queue = [r for r in queue if r.name not in skip]
    began, index, running, starting = time.time(), 0, [], None
    print(f"{len(queue)} runs to do ({len(skip)} already done), {args.parallel} at a time on {args.card}", flush=True)
    walls: list[float] = []
    while queue or running:
        for run in list(running):
            code = run.process.poll()
            if code is None:
                continue
            running.remove(run)
            if starting is run:
                starting = None
            text = run.log_text()
            if code != 0 and run.attempts < MAX_ATTEMPTS and any(m in text for m in ENGINE_START_FAILURES):
                print(f"{run.name}: vLLM start-up failed (memory profiling), retrying", flush=True)
                queue.insert(0, run)
                continue
            record = finish(run, args, code)
            if record.get("complete"):
                walls.append(record["wall_s"])
            print(f"[{time.time() - began:6.0f}s] {run.name}: exit {code}, {record.get('steps')} steps, "
                  f"{record['wall_s']:.0f}s, held-out {(record.get('heldout') or {}).get('after')}", flush=True)
        if starting is not None and (starting.engine_ready() or time.time() - starting.started > args.start_timeout):
            starting = None
        elapsed = time.time() - began
        expected = statistics.median(walls) if walls else args.expected_run_s
        fits = args.deadline_s is None or elapsed + expected < args.deadline_s
        if starting is None and queue and len(running) < args.parallel and fits:
            run = queue.pop(0)
            start(run, args, index)
            index += 1
            running.append(run)
            starting = run
            print(f"[{elapsed:6.0f}s] start {run.name} (attempt {run.attempts})", flush=True)
        elif queue and not running and not fits:
            print(f"deadline: {len(queue)} runs not started", flush=True)
            break
        time.sleep(1.0)


def status(out_dir: str) -> None:
    runs = sorted((pathlib.Path(out_dir) / "runs").glob("*.json"))
    records = [json.loads(p.read_text()) for p in runs]
    complete = [r for r in records if r.get("complete")]
    print(f"{len(complete)} complete, {len(records) - len(complete)} failed or short")
    for r in records:
        if not r.get("complete"):
            print("  not complete:", r["task"], r["method"], r["seed"], "exit", r.get("exit_code"))
    logs = sorted((pathlib.Path(out_dir) / "logs").glob("*.log"))
    print(f"{len(logs)} logs")


# ------------------------------------------------------------------------------------------------ statistics
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
    from report_stats import t_quantile  # noqa: PLC0415 - benchmarks/report_stats.py

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


def read_record(path: str) -> dict[str, Any]:
    """A run record, plain or gzip-compressed (``.json.gz``: how the repository keeps them)."""
    raw = pathlib.Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


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
SMOKE_FLAGS = ["--use_vllm", "false", "--use_cpu", "true", "--bf16", "false", "--eval_every", "2", "--drift_every",
               "2", "--eval_size", "4", "--drift_size", "2", "--eval_max_new_tokens", "4", "--eval_batch_size", "4",
               "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
               "--log_energy_buckets", "2", "--train_size", "32", "--report_to", "none"]


def smoke_model(out: pathlib.Path) -> str:
    """A tiny random model and its tokenizer (tests/tiny.py) saved in ``out/tiny_model``, for the CPU smoke runs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import tiny_model, tiny_tokenizer

    model_dir = out / "tiny_model"
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = tiny_model()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return str(model_dir)


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
    p.add_argument("--parallel", type=int, default=10)
    p.add_argument("--gpus", nargs="*", type=int, default=[], help="CUDA device indices, round-robin (default: all)")
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
