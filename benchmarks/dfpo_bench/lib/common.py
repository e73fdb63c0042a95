"""What every benchmark script shares: the machine and package labels a result records, atomic JSON records,
stopping a launched process group, and the launcher that runs one ``dfpo-train`` process per run
(long_run.py, study_v3.py), each run reduced to a record with its checkout.

Scripts run as ``python -m dfpo_bench.<kind>.<script>`` (the package installed with ``pip install -e benchmarks``)
and import the shared modules as ``dfpo_bench.lib.<module>``. This module imports torch only inside the
functions that need it, so a launcher can import it before torch.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time
from typing import Any

from dfpo_bench.lib.provenance import checkout_state

ROOT = pathlib.Path(__file__).resolve().parents[3]


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, torch threads={torch.get_num_threads()})"


def versions() -> dict[str, str]:
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}


def utc_now() -> str:
    """The current UTC time as an ISO 8601 string to the second (``2026-11-29T00:52:26+00:00``): run records' stamps."""
    import datetime

    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def load_json(path: pathlib.Path) -> Any:
    """A result file's JSON, or None when the run has not written it (the reports skip what is missing)."""
    return json.loads(path.read_text()) if path.exists() else None


def save_figure(fig: Any, fig_dir: pathlib.Path, name: str, out: pathlib.Path, dpi: int) -> str:
    """Save a matplotlib figure as ``fig_dir/name`` and close it; its path as RESULTS.md (``out``) links it: relative
    to the report's folder when the figure is inside it."""
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    path = fig_dir / name
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return str(path.relative_to(out.parent)) if path.is_relative_to(out.parent) else str(path)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Atomic JSON write (a reader never sees a half file; a killed job leaves the previous version)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def quiet() -> None:
    """Keep logs short: transformers/TRL warnings once, no progress bars."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``), SIGKILL it after
    ``grace_s`` seconds, and reap ``proc``: an ``accelerate launch`` leaves one worker per GPU behind otherwise."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ------------------------------------------------------------------------------------------------ launcher
# One `dfpo-train` process per (task, method or arm, seed), N at a time, each reduced to a record as it ends (the
# long-run study, study v2 and study v3 launch their runs through it). Several vLLM engines on one GPU: an engine
# measures free memory while it starts, and another engine starting or freeing memory then fails it, so the next run
# starts only once the last one's engine is up (its trainer logged the group layout), and a run that failed that way
# is retried.
RECIPE = ROOT / "recipes" / "smollm2_gpu_vllm.yaml"
SEQUENCE_GSPO = ["--importance_sampling_level", "sequence", "--loss_type", "grpo", "--epsilon", "3e-4",
                 "--epsilon_high", "4e-4"]
ENGINE_READY = ("DFPO group layout", "group layout:")  # logged once the trainer (and its vLLM engine) is built
ENGINE_START_FAILURES = ("Error in memory profiling", "release GPU memory while vLLM is profiling")
MAX_ATTEMPTS = 3
# Per-step log keys a record keeps (besides every drift/, energy/, cancellation/, asym/, sampling/, clip_ratio/).
STEP_KEYS = ("step_reward", "reward", "entropy", "loss", "grad_norm", "completions/mean_length",
             "heldout/accuracy", "frac_reward_zero_std")
STEP_PREFIXES = ("drift/", "energy/", "cancellation/", "asym/", "sampling/", "clip_ratio/", "transform/",
                 "grpo_fix/", "diagnostics/")


def run_flags(
    args: argparse.Namespace, task: str, method: str, seed: int, output_dir: pathlib.Path, port: int,
    flags: list[str],
) -> list[str]:
    """The `dfpo-train` command line of one run: the recipe, task, seed and step count of ``args``, then ``flags``
    (the method's or arm's), then ``args.extra``."""
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


def child_pythonpath() -> str:
    """The import path a job's child process gets: this checkout's library and its benchmarks package first (the
    GPU kit installs neither), then what the job had."""
    return os.pathsep.join(p for p in (str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)


# what every dfpo-train run writes to its output_dir (docs/source/guides/cli.md, "Outputs")
SUMMARY_FILE = "dfpo_summary.json"


def train_in_process(argv: list[str], output_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``dfpo-train argv`` in this process (``dfpo_trl.cli.dfpo_train``, so that a job's instruments see the run) and
    the summary it wrote to ``output_dir``; a run that exits non-zero raises, naming its exit code."""
    from dfpo_trl.cli import dfpo_train

    code = dfpo_train(argv)
    if code != 0:
        raise RuntimeError(f"dfpo-train {' '.join(map(str, argv))} exited with {code}")
    return load_json(pathlib.Path(output_dir) / SUMMARY_FILE)


def part_seconds(run: dict[str, Any], part: str) -> float:
    """A run record's seconds in one part of its steps (``lib/timing.StepClock``'s ``generation_s``, ``pre_pass_s``,
    ...): the sum over its steps, 0 where no step had that part."""
    return sum(step.get(part) or 0.0 for step in run["steps"])


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


def installed_versions() -> dict[str, str]:
    """The installed versions of the packages a run's numbers depend on ("absent" when not installed)."""
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
    """One (task, method, seed) process of the launcher, with the dfpo-train ``flags`` of its method or arm (the
    long-run study, study v2 and study v3 each give their own)."""

    def __init__(self, task: str, method: str, seed: int, flags: list[str]) -> None:
        self.task, self.method, self.seed = task, method, seed
        self.flags = list(flags)
        self.attempts = 0
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self.log: pathlib.Path | None = None
        self.checkout: dict[str, Any] | None = None
        self.gpu: int | None = None  # the CUDA device it runs on (``--gpus``)
        self.out_dir: str | None = None  # its stage folder, when one launch runs several (default ``args.out_dir``)

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
    work = pathlib.Path(run.out_dir or args.out_dir)
    output_dir = work / "work" / run.name
    output_dir.mkdir(parents=True, exist_ok=True)
    run.log = work / "logs" / f"{run.name}.a{run.attempts}.log"
    run.log.parent.mkdir(parents=True, exist_ok=True)
    port = 29600 + index % 300
    env = dict(os.environ, MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    if args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(run.gpu)
    run.attempts += 1
    run.started = time.time()
    run.checkout = checkout_state(ROOT)  # the code this process runs (cwd=ROOT), read as it starts
    with open(run.log, "w") as log:
        command = run_flags(args, run.task, run.method, run.seed, output_dir, port, run.flags)
        run.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)


def finish(run: Run, args: argparse.Namespace, code: int) -> dict[str, Any]:
    """The record of a finished run (a failed one keeps its log's tail)."""
    work = pathlib.Path(run.out_dir or args.out_dir)
    key = {"task": run.task, "method": run.method, "seed": run.seed, "card": args.card, "versions": args.versions,
           "gpu": run.gpu, "attempts": run.attempts, "wall_s": round(time.time() - run.started, 1), "exit_code": code,
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


def launch(args: argparse.Namespace, queue: list[Run], skip_failed: bool = False) -> None:
    """Run ``queue``, ``args.parallel`` at a time on each GPU of ``args.gpus`` (each new run on the least busy one;
    without ``--gpus`` ``args.parallel`` at a time in all), skipping runs with a complete record in their folder's
    ``runs/`` (``run.out_dir``, default ``args.out_dir``) or ``args.skip_done`` (with ``skip_failed``, any record:
    a crash stays recorded as a crash, not retried); starts no run expected to end after ``args.deadline_s``: its
    expected wall time is the longest ended run of its method, ``args.expected_run_s`` before one has ended (the
    longest, not the median, because a run cut by the machine's return is a crash)."""
    args.card, args.versions = card(), installed_versions()

    def recorded(directory: pathlib.Path) -> set[str]:
        return {path.name.split(".json")[0] for path in [*directory.glob("*.json"), *directory.glob("*.json.gz")]
                if skip_failed or read_record(str(path)).get("complete")}

    elsewhere = set().union(*(recorded(pathlib.Path(d)) for d in args.skip_done))
    folders = {run.out_dir or args.out_dir for run in queue}
    done = {folder: recorded(pathlib.Path(folder) / "runs") | elsewhere for folder in folders}
    before = len(queue)
    queue = [r for r in queue if r.name not in done[r.out_dir or args.out_dir]]
    skipped = before - len(queue)
    began, index, running, starting = time.time(), 0, [], None
    gpus = list(args.gpus or [])
    capacity = args.parallel * max(1, len(gpus))
    where = f"each of GPUs {gpus}" if gpus else "one device"
    print(f"{len(queue)} runs to do ({skipped} already done), {args.parallel} at a time on {where} ({args.card})",
          flush=True)
    walls: dict[str, list[float]] = {}
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
                walls.setdefault(run.method, []).append(record["wall_s"])
            print(f"[{time.time() - began:6.0f}s] {run.name}: exit {code}, {record.get('steps')} steps, "
                  f"{record['wall_s']:.0f}s, held-out {(record.get('heldout') or {}).get('after')}", flush=True)
        if starting is not None and (starting.engine_ready() or time.time() - starting.started > args.start_timeout):
            starting = None
        elapsed = time.time() - began
        expected = max(walls.get(queue[0].method) or [args.expected_run_s]) if queue else 0.0
        fits = args.deadline_s is None or elapsed + expected < args.deadline_s
        if starting is None and queue and len(running) < capacity and fits:
            run = queue.pop(0)
            if gpus:
                run.gpu = min(gpus, key=lambda g: sum(r.gpu == g for r in running))
            start(run, args, index)
            index += 1
            running.append(run)
            starting = run
            on = f" on GPU {run.gpu}" if gpus else ""
            print(f"[{elapsed:6.0f}s] start {run.name}{on} (attempt {run.attempts})", flush=True)
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
def read_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A run record, plain or gzip-compressed (``.json.gz``: how the repository keeps them)."""
    path = pathlib.Path(path)
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)



SMOKE_FLAGS = ["--use_vllm", "false", "--use_cpu", "true", "--bf16", "false", "--eval_every", "2", "--drift_every",
               "2", "--eval_size", "4", "--drift_size", "2", "--eval_max_new_tokens", "4", "--eval_batch_size", "4",
               "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
               "--log_energy_buckets", "2", "--train_size", "32", "--report_to", "none"]


def smoke_model(out: pathlib.Path) -> str:
    """A tiny random model and its tokenizer (``dfpo_trl.testing``) saved in ``out/tiny_model``, for the CPU smoke
    runs."""
    from dfpo_trl.testing import save_tiny_chat_model

    return str(save_tiny_chat_model(out / "tiny_model"))
