"""Robustness of the main job's recipe across seeds: the CPU recipe's runs, many at once on one GPU.

The main job (``dfpo-train recipes/smollm2_cpu.yaml``) must gain at least +0.25 held-out accuracy in a few
minutes on a 2-core CPU. One CPU run takes 6–9 minutes, so a recipe cannot be checked over several seeds
(each seed changes sampling *and* batch order) on the CPU in reasonable time. This script runs the recipe
itself, float32 as on the CPU, with ``--use_cpu false`` and the same model converted from the same GGUF, for
each candidate setting × seed as parallel processes on one GPU, and tabulates held-out accuracy before/after.
The GPU's kernels differ from the CPU's, so a seed's exact trajectory differs; what carries over is how often a
setting reaches the gain, which is what picks the recipe. The pick is then measured on the CPU (README).

    python -m dfpo_bench.studies.main_job_sweep --model /root/models/smollm2-135m-instruct --seeds 0 1 2 3 \\
        --parallel 16 --out-dir $OUT

Writes ``main_job_sweep.json``: per candidate its overrides, per seed held-out before/after, the peak of the
reward EMA and the training seconds, and the count of seeds whose gain reaches ``--target-gain``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

from dfpo_bench.lib import common

ROOT = pathlib.Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "smollm2_cpu.yaml"

# Candidate settings (overrides of the recipe). Every candidate keeps 16 completions per optimizer step, so its
# CPU time per step is the recipe's; they differ in step count, learning rate and schedule, sampling temperature,
# and prompts per step.
CANDIDATES: dict[str, list[str]] = {
    "recipe": [],
    "lr5e-5_linear_32": ["--lr_scheduler_type", "linear"],
    "lr3e-5_const_32": ["--learning_rate", "3e-5"],
    "lr7e-5_linear_24": ["--learning_rate", "7e-5", "--lr_scheduler_type", "linear", "--max_steps", "24"],
    "lr5e-5_const_24": ["--max_steps", "24"],
    "t0.7_lr5e-5_24": ["--temperature", "0.7", "--max_steps", "24"],
    "t0.7_lr5e-5_linear_24": ["--temperature", "0.7", "--max_steps", "24", "--lr_scheduler_type", "linear"],
    "t0.7_lr3e-5_24": ["--temperature", "0.7", "--max_steps", "24", "--learning_rate", "3e-5"],
    "g4_lr5e-5_24": ["--num_generations", "4", "--max_steps", "24"],
    "g4_t0.7_lr5e-5_24": ["--num_generations", "4", "--temperature", "0.7", "--max_steps", "24"],
    "grad0.5_lr5e-5_24": ["--max_grad_norm", "0.5", "--max_steps", "24"],
    "spg2_lr5e-5_24": ["--steps_per_generation", "2", "--max_steps", "24"],
    "t0.7_lr3e-5_20": ["--temperature", "0.7", "--max_steps", "20", "--learning_rate", "3e-5"],
    "t0.7_lr4e-5_20": ["--temperature", "0.7", "--max_steps", "20", "--learning_rate", "4e-5"],
    "t0.7_lr3e-5_16": ["--temperature", "0.7", "--max_steps", "16", "--learning_rate", "3e-5"],
    "t0.5_lr3e-5_20": ["--temperature", "0.5", "--max_steps", "20", "--learning_rate", "3e-5"],
}


def launch(name: str, seed: int, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], pathlib.Path]:
    out = pathlib.Path(args.runs_dir) / f"{name}_s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "dfpo_trl", str(RECIPE), "--output_dir", str(out), "--seed", str(seed),
        "--use_cpu", "false", "--model_name_or_path", args.model, *CANDIDATES[name],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": common.child_pythonpath()}
    log = open(out / "run.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), out


def summary(out: pathlib.Path) -> dict[str, Any] | None:
    path = out / "dfpo_summary.json"
    if not path.exists():
        return None
    s = json.loads(path.read_text())
    return {
        "before": s["heldout"]["before"], "after": s["heldout"]["after"],
        "gain": round(s["heldout"]["after"] - s["heldout"]["before"], 4),
        "reward_ema_peak": s["reward_ema_peak"], "reward_ema_last": s["reward_ema_last"],
        "training_s": s["time_split"]["training"],
    }


def write_report(results: dict[str, dict[str, Any]], args: argparse.Namespace, started: float) -> dict[str, Any]:
    """``main_job_sweep.json`` with the runs finished so far and each candidate's gains summarised."""
    import torch

    for entry in results.values():
        gains = [r["gain"] for r in entry["seeds"].values() if "gain" in r]
        entry["median_gain"] = statistics.median(gains) if gains else None
        entry["seeds_reaching_target"] = sum(g >= args.target_gain for g in gains)
        entry["seeds_run"] = len(gains)
    report = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "recipe": str(RECIPE.relative_to(ROOT)), "dtype": "float32 (the recipe's)", "seeds": args.seeds,
        "target_gain": args.target_gain, "wall_s": round(time.time() - started, 1), "candidates": results,
    }
    (pathlib.Path(args.out_dir) / "main_job_sweep.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the SmolLM2-135M-Instruct checkpoint")
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--target-gain", type=float, default=0.25)
    parser.add_argument("--out-dir", required=True, help="where main_job_sweep.json goes")
    parser.add_argument("--runs-dir", default="/tmp/main_job_sweep", help="the runs' output_dir (each saves a model)")
    args = parser.parse_args()

    queue = [(name, seed) for seed in args.seeds for name in args.candidates]
    running: list[tuple[str, int, subprocess.Popen[bytes], pathlib.Path]] = []
    results: dict[str, dict[str, Any]] = {
        name: {"overrides": CANDIDATES[name], "seeds": {}} for name in args.candidates
    }
    started = time.time()
    while queue or running:
        while queue and len(running) < args.parallel:
            name, seed = queue.pop(0)
            running.append((name, seed, *launch(name, seed, args)))
        time.sleep(2)
        for entry in list(running):
            name, seed, process, out = entry
            if process.poll() is None:
                continue
            running.remove(entry)
            results[name]["seeds"][str(seed)] = summary(out) or {"failed": process.returncode}
            write_report(results, args, started)  # after every run: a job cut by its time limit keeps them
    report = write_report(results, args, started)
    print(f"device: {report['device']}; {len(args.seeds)} seeds, {report['wall_s']} s")
    print(f"{'candidate':24s} {'median gain':>11s} {'>= target':>9s}  gains by seed")
    for name, entry in results.items():
        gains = " ".join(f"{r.get('gain', float('nan')):+.2f}" for r in entry["seeds"].values())
        median = entry["median_gain"]
        print(f"{name:24s} {median if median is not None else float('nan'):11.3f} "
              f"{entry['seeds_reaching_target']:>4d}/{entry['seeds_run']:<4d}  {gains}")


if __name__ == "__main__":
    main()
