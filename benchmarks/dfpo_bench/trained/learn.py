"""Runs that learn with trained weights: DFPO off against Min-Replace on Qwen2.5-Coder-0.5B-Instruct, colocated vLLM.

Each run is ``dfpo-train benchmarks/dfpo_bench/trained/qwen05_lora.yaml`` (the 8B LoRA recipe's objective, LoRA, batch
shape, completion length and sampling settings; the offline two-step arithmetic task) with ``--group_transform none``
or ``min_replace`` and a seed. The runs go through the benchmarks' launcher (dfpo_bench.lib.common): ``--parallel`` at
a time on the one GPU, each started once the one before has built its vLLM engine, the two arms of a seed started next
to each other so that they share the GPU's load; one record per run with its checkout. Beside them ``nvidia-smi``
samples each process's GPU memory every 2 s. ``--is-flags`` are the importance-sampling fields every run gets (the
setting chosen from dfpo_bench.trained.is_ratio's measurement); ``--contrasts`` adds one-off runs (:data:`CONTRASTS`);
``--gpus 0 1`` spreads the runs over two GPUs, ``--parallel`` on each.

    python -m dfpo_bench.trained.learn --model /root/models/qwen2.5-coder-0.5b-instruct --out-dir /tmp/learn \
        --parallel 3 --seeds 0 1 2
    python -m dfpo_bench.trained.learn --aggregate /tmp/learn --out $OUT/learn_qwen05.json

The aggregate keeps, per run: the held-out curve, TRL's ``sampling/importance_sampling_ratio/*`` and
``step_time`` per step, DFPO's off-policy φ, clipped share among rows with signal and one-sided share, the
whole-loop time and the peak GPU memory of the run's process.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import shutil
import subprocess
import time
from typing import Any

from dfpo_bench.lib import common
from dfpo_bench.lib.common import Run

RECIPE = pathlib.Path(__file__).resolve().parent / "qwen05_lora.yaml"
ARMS = {"off": ["--group_transform", "none"], "min_replace": ["--group_transform", "min_replace"]}
# One run each (seed 0), beside the arms; their flags come after ``--is-flags``, so they override them:
# * ``min_replace_is_on``: TRL 1.16's default importance-sampling correction (``sequence_mask``) left on, the setting
#   the recipes had before the measurement, to show in a run what the chosen setting (correction off) changes;
# * ``transformers_eval``: the CLI's held-out path without vLLM (greedy ``generate``, before and after one step), to
#   time against the avg@k evaluation through vLLM of the other runs on the same card.
CONTRASTS = {"min_replace_is_on": ["--group_transform", "min_replace", "--vllm_importance_sampling_correction", "true"],
             "transformers_eval": ["--group_transform", "min_replace", "--use_vllm", "false", "--max_steps", "1",
                                   "--eval_every", "0"]}
KEPT = ("step_time", "reward", "heldout/accuracy", "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max",
        "sampling/sampling_logp_difference/mean", "diagnostics/phi_mean_off_policy",
        "diagnostics/clip_fraction_signal", "cancellation/one_sided_groups", "completions/mean_length",
        "diagnostics/is_ratio_min", "diagnostics/is_ratio_max", "diagnostics/is_ratio_std", "grad_norm")


def memory_sampler(path: pathlib.Path) -> subprocess.Popen | None:
    """``nvidia-smi`` writing (time, pid, MiB) of every GPU process to ``path`` every 2 s until stopped (None where
    there is no ``nvidia-smi``: a CPU smoke run)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = open(path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(["nvidia-smi", "--query-compute-apps=timestamp,pid,used_memory", "--format=csv,noheader",
                             "-l", "2"], stdout=out, stderr=subprocess.DEVNULL, start_new_session=True)


def build_queue(args: argparse.Namespace) -> list[Run]:
    """The runs in start order: per seed its arms side by side, the IS contrast beside seed 0's Min-Replace run,
    the other contrasts last."""
    is_flags = shlex.split(args.is_flags)
    queue = [Run("dfpo_bench.trained.tasks:two_step", arm, seed, ARMS[arm] + is_flags)
             for seed in args.seeds for arm in args.arms]
    contrasts = {name: Run("dfpo_bench.trained.tasks:two_step", name, args.seeds[0], is_flags + CONTRASTS[name])
                 for name in args.contrasts}
    if "min_replace_is_on" in contrasts:  # next to its seed's Min-Replace run, under the same load
        queue.insert(2, contrasts.pop("min_replace_is_on"))
    queue += contrasts.values()
    return queue


def launch_runs(args: argparse.Namespace) -> None:
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    queue = build_queue(args)
    sampler = memory_sampler(out / "gpu_memory.csv")
    try:
        common.launch(args, queue, skip_failed=True)
    finally:
        if sampler is not None:
            sampler.terminate()
    # the launcher keeps each Run's process: its pid names the run's rows in the memory samples
    pids = {run.name: run.process.pid for run in queue if run.process is not None}
    (out / "pids.json").write_text(json.dumps(pids))


def peak_memory_mib(out: pathlib.Path, pid: int) -> float | None:
    """The largest GPU memory ``nvidia-smi`` saw for ``pid`` (the run's process: its trainer and colocated engine)."""
    path = out / "gpu_memory.csv"
    if not path.exists():
        return None
    values = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1] == str(pid) and parts[2].endswith("MiB"):
            values.append(float(parts[2].split()[0]))
    return max(values) if values else None


def aggregate(out: pathlib.Path, target: pathlib.Path) -> dict[str, Any]:
    pids = json.loads((out / "pids.json").read_text()) if (out / "pids.json").exists() else {}
    runs = []
    for record_path in sorted((out / "runs").glob("*.json")):
        record = json.loads(record_path.read_text())
        name = record_path.name[: -len(".json")]
        summary_path = out / "work" / name / "dfpo_summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        history = summary.get("log_history") or []
        runs.append({
            "name": name, "method": record.get("method"), "seed": record.get("seed"),
            "exit_code": record.get("exit_code"), "complete": record.get("complete"),
            "wall_s": record.get("wall_s"), "checkout": record.get("checkout"), "card": record.get("card"),
            "settings": record.get("settings"), "heldout": summary.get("heldout"),
            "time_split": summary.get("time_split"), "steps": summary.get("steps"),
            "peak_gpu_memory_mib": peak_memory_mib(out, pids[name]) if name in pids else None,
            "series": {key: common.series(history, key) for key in KEPT},
            "log_tail": record.get("log_tail"),
        })
    result = {"recipe": str(RECIPE.relative_to(common.ROOT)), "runs": runs}
    target.write_text(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aggregate", metavar="OUT_DIR", default=None)
    parser.add_argument("--out", default=None, help="with --aggregate: the results JSON")
    parser.add_argument("--model", default=None)
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--out-dir", default="/tmp/learn")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=None)
    parser.add_argument("--expected-run-s", type=float, default=300.0)
    parser.add_argument("--is-flags", default="", help="importance-sampling fields every run gets, one string")
    parser.add_argument("--contrasts", nargs="*", choices=list(CONTRASTS), default=[],
                        help="one-off runs beside the arms (seed: the first of --seeds)")
    parser.add_argument("--gpus", type=int, nargs="*", default=[], help="CUDA devices; --parallel runs on each")
    parser.add_argument("--vllm-memory", type=float, default=None,
                        help="vllm_gpu_memory_utilization of every run (default: the recipe's)")
    parser.add_argument("extra", nargs="*", help="further dfpo-train flags after --")
    args = parser.parse_args(argv)
    if args.aggregate:
        aggregate(pathlib.Path(args.aggregate), pathlib.Path(args.out))
        return
    args.via_accelerate, args.skip_done = False, []
    args.start_timeout = 300.0  # the next run starts once this one's engine is up (vLLM's start-up profiling)
    args.began = time.time()
    launch_runs(args)


if __name__ == "__main__":
    main()
