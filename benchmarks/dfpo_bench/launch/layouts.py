"""Group layouts under ZeRO-3: DFPO Min-Replace's off-policy optimizer step in the ``pre_pass`` and the
``redistributed`` layout against TRL's GSPO, interleaved step by step (commands: benchmarks/README.md).

Shape (defaults): per-device batch 1, G = 4 = processes, ``steps_per_generation`` 16 and accumulation 4 (a rollout is
1 on-policy and 3 off-policy optimizer steps, as in recipes/qwen3_32b.yaml); completions of 256-384 tokens; a random
Qwen3-1.7B-shaped init in bf16. The three trainers share ONE process, init and hand-built rollout (below TRL's
buffering, so DFPO's own rollout code runs); each ``train()`` runs in its own thread and the threads hand a baton over
at optimizer-step boundaries, in a seeded order per round, so a round's ratio compares steps seconds apart.

Timed: the off-policy steps, every rank aligned at both ends; per round a method's median, then the median over rounds
and of the within-round ratio to GSPO with 95% bootstrap intervals. ``--gc between-turns`` freezes the heap after the
warm-up and collects between turns, untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from dfpo_bench.launch.layouts_timing import METHODS, phase_time, save_init
from dfpo_bench.lib import common, trainers
from dfpo_bench.lib.stats import bootstrap_median, fmt

SHAPE = ("device", "gpus", "model", "per_device_train_batch_size", "num_generations", "steps_per_generation",
         "gradient_accumulation_steps", "completion_length_range", "steps_per_turn", "gc")


def per_round(steps: list[dict[str, Any]], off_policy: bool) -> dict[int, float]:
    """Median step time per timed round (of the off-policy steps, or of the first step of each rollout)."""
    by_round: dict[int, list[float]] = {}
    for s in steps:
        if s.get("round") is not None and s["round"] >= 0 and (s["step_in_rollout"] != 0) == off_policy:
            by_round.setdefault(s["round"], []).append(s["seconds"])
    return {r: statistics.median(v) for r, v in by_round.items()}


def method_entry(values: list[float], base: list[float]) -> dict[str, Any]:
    """A method's per-round medians, their median and interval, and its within-round ratios to GSPO's."""
    entry: dict[str, Any] = {"rounds": len(values), "round_median_s": values, "median_step_s": None,
                             "interval_95": None, "ratio_to_gspo": None, "ratio_interval_95": None}
    if values:
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        entry.update(median_step_s=statistics.median(values), interval_95=bootstrap_median(values),
                     ratio_to_gspo=statistics.median(ratios), ratio_interval_95=bootstrap_median(ratios),
                     round_ratio_to_gspo=ratios)
    return entry


def phase_report(args: argparse.Namespace) -> dict[str, Any]:
    """``layouts.json`` of one run from the timing phase's ``timing.json``, and its table."""
    timing = common.load_json(pathlib.Path(args.work_dir) / "timing.json") or {}
    report: dict[str, Any] = {
        "device": timing.get("device"), "gpus": timing.get("processes"), "zero_stage": timing.get("zero_stage"),
        "per_device_train_batch_size": args.per_device, "num_generations": args.num_generations,
        "steps_per_generation": args.steps_per_generation,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "completion_length_range": [args.min_completion_length, args.completion_length],
        "prompt_length": args.prompt_length, "model": f"random-{args.random_config}", "dtype": args.dtype,
        "timed": "off-policy optimizer steps, every rank aligned at both ends; per round a method's median",
        **{key: timing.get(key) for key in ("steps_per_turn", "gc", "layouts", "engines", "loss_finite",
                                            "peak_memory_gb", "versions", "errors")},
        "rounds": timing.get("rounds_done", 0), "complete": timing.get("complete", False),
    }
    steps = timing.get("steps", {})
    base = per_round(steps.get("gspo", []), True)
    for name in METHODS:
        rounds, first = per_round(steps.get(name, []), True), per_round(steps.get(name, []), False)
        shared = sorted(set(rounds) & set(base))  # the rounds both this method and GSPO timed
        timed = [s for s in steps.get(name, []) if s.get("round") is not None and s["round"] >= 0]
        report[name] = {
            **method_entry([rounds[r] for r in shared], [base[r] for r in shared]),
            "first_step_median_s": statistics.median(first.values()) if first else None,
            "gc_s_in_timed_steps": round(sum(s.get("gc_s", 0.0) for s in timed), 3),
            "steps": [{k: s[k] for k in ("round", "step_in_rollout", "seconds", "gc_s") if k in s} for s in timed],
        }
    return report


def merge_reports(args: argparse.Namespace) -> dict[str, Any]:
    """One ``layouts.json`` from the timing runs of one setting: rounds pooled, ratios to GSPO within each round."""
    runs = [(path, json.loads(pathlib.Path(path).read_text())) for path in args.merge]
    runs = [(path, r) for path, r in runs if r.get("rounds")]
    if not runs:
        raise SystemExit("--merge: no file has timed rounds")
    if any(r.get(key) != runs[0][1].get(key) for _, r in runs for key in SHAPE):
        raise SystemExit("--merge: the timing runs differ in device, shape or turn design; pool only runs of one "
                         "setting")
    merged = {k: v for k, v in runs[0][1].items() if k not in METHODS}
    pooled = {name: [t for _, r in runs for t in r[name]["round_median_s"]] for name in METHODS}
    merged["rounds"] = len(pooled["gspo"])
    for name in METHODS:
        merged[name] = {
            **method_entry(pooled[name], pooled["gspo"]),
            "gc_s_in_timed_steps": round(sum(r[name].get("gc_s_in_timed_steps", 0.0) for _, r in runs), 3),
            "first_step_median_s_per_run": [r[name].get("first_step_median_s") for _, r in runs],
            "runs": [{key: r[name].get(key) for key in ("rounds", "median_step_s", "ratio_to_gspo",
                                                        "ratio_interval_95")} for _, r in runs],
        }
    merged["merged_from"] = [path for path, _ in runs]
    merged["steps_in_run_files"] = "every timed step: the 'steps' of each file in merged_from"
    for key in ("stages", "wall_s", "command"):
        merged[key] = {path: r.get(key) for path, r in runs}
    return merged


def plot_ratios(report: dict[str, Any], path: pathlib.Path) -> None:
    """Each round's step time over GSPO's in the same round, per layout, with the median and its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    names = [name for name in METHODS if name != "gspo"]
    for x, name in enumerate(names):
        entry = report[name]
        rounds, (low, high), mid = entry["round_ratio_to_gspo"], entry["ratio_interval_95"], entry["ratio_to_gspo"]
        ax.scatter([x] * len(rounds), rounds, color="0.5", s=14, zorder=2, label="rounds" if x == 0 else None)
        ax.errorbar([x + 0.12], [mid], yerr=[[mid - low], [high - mid]], fmt="o", color="C0", capsize=4, zorder=3,
                    label="median, 95% interval" if x == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="C3", lw=0.8, ls="--", label="1.05 x GSPO")
    ax.set_xticks(range(len(names)), [f"Min-Replace\n{name}" for name in names])
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylabel("step time / TRL GSPO (same round)")
    ax.set_title(f"{report['gpus']} x {report['device']}, ZeRO-{report['zero_stage']}, {report['model']}, "
                 f"{report['rounds']} rounds", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    common.save_figure(fig, path.parent, path.name, path, dpi=130)


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}: {report['gpus']} processes, ZeRO-{report['zero_stage']}, {report['model']}, "
          f"{report['rounds']} rounds, off-policy optimizer steps")
    for name in METHODS:
        e = report[name]
        low, high = e["ratio_interval_95"] or (None, None)
        print(f"{name:15s} median {fmt(e['median_step_s'])} s, ratio to gspo {fmt(e['ratio_to_gspo'])} "
              f"[{fmt(low)}, {fmt(high)}]" + (f"  error: {report['errors'][name][:80]}"
                                                    if name in (report.get("errors") or {}) else ""))


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def run_logged(command: list[str], log: Any, timeout: float, env: dict[str, str]) -> int:
    """Run ``command`` in its own process group with output to ``log``; kill the group after ``timeout`` s."""
    log.write(f"\n$ {shlex.join(command)}\n")
    log.flush()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        common.stop_process_group(proc)
        log.write(f"[killed after {timeout:.0f} s]\n")
        return -9


def phase_all(args: argparse.Namespace) -> dict[str, Any]:
    """The init (its own process, bounded), then the timing under the launcher with the rest of the deadline."""
    start = time.time()
    out, work = pathlib.Path(args.out_dir), pathlib.Path(args.work_dir)
    for folder in (out, work):
        folder.mkdir(parents=True, exist_ok=True)
    (work / "timing.json").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": common.child_pythonpath()}
    if args.device == "cpu":
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if args.launcher == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes),
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
                    "--num_processes", str(args.processes), "--main_process_port", str(free_port())]
    this = [str(pathlib.Path(__file__).resolve()), *args.argv]
    log_path, stages = out / "layouts.log", []
    with log_path.open("w") as log:
        for phase, share in (("init", 0.25), ("time", 1.0)):
            left = start + args.deadline_s - time.time() - args.report_margin_s
            stop_at = time.time() + left - args.teardown_margin_s  # the timing starts no round ending after it
            command = {"init": [sys.executable, *this, "--phase", "init"],
                       "time": [*launcher, *this, "--phase", "time", "--stop-at", f"{stop_at:.0f}"]}[phase]
            stage_start = time.time()
            code = run_logged(command, log, share * left, env)
            stages.append({"phase": phase, "returncode": code, "seconds": round(time.time() - stage_start, 1)})
            print(f"{phase}: exit {code} after {stages[-1]['seconds']} s (log: {log_path})", flush=True)
    report = {**phase_report(args), "stages": stages, "wall_s": round(time.time() - start, 1),
              "command": shlex.join([sys.executable, "-m", "dfpo_bench.launch.layouts", *args.argv])}
    if any(s["returncode"] != 0 for s in stages):
        print("\nlast lines of the log:\n" + "\n".join(log_path.read_text().splitlines()[-40:]))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="all", choices=("all", "init", "time", "report"))
    p.add_argument("--merge", nargs="+", default=None, metavar="LAYOUTS_JSON",
                   help="instead of a run: pool the layouts.json of timing runs into --out-dir/layouts.json")
    p.add_argument("--plot", default=None, help="--merge: also draw the per-round ratios to this PNG")
    p.add_argument("--work-dir", default="/tmp/dfpo-layouts")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--launcher", default=None, choices=("accelerate", "torchrun"),
                   help="default: accelerate on cuda, torchrun on cpu")
    p.add_argument("--accelerate-config", default=str(common.ROOT / "recipes" / "accelerate" / "zero3_4gpu.yaml"))
    p.add_argument("--random-config", default="qwen3-1.7b", choices=trainers.RANDOM_CONFIGS)
    p.add_argument("--tokenizer", default=None, help="default: the kit's SmolLM2 (trainers.default_tokenizer_path)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help="default bfloat16, float32 on cpu")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    for name, default in (("processes", 4), ("per-device", 1), ("num-generations", 4), ("steps-per-generation", 16),
                          ("gradient-accumulation-steps", 4), ("prompt-length", 32), ("completion-length", 384),
                          ("min-completion-length", 256), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rounds", type=int, default=400, help="at most; the deadline may stop earlier")
    p.add_argument("--steps-per-turn", type=int, default=1, help="optimizer steps of a method per turn")
    p.add_argument("--warmup-rollouts", type=int, default=1, help="untimed rollouts per method before round 0")
    p.add_argument("--gc", default="between-turns", choices=("between-turns", "as-is"),
                   help="between-turns: freeze the heap after the warm-up and collect between turns, untimed")
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--shift", type=float, default=3e-4, help="std of the per-row old-log-prob offset")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--deadline-s", type=float, default=510.0, help="phase all: everything ends within this")
    p.add_argument("--stop-at", type=float, default=None, help="phase time: no round starts after this epoch time")
    p.add_argument("--report-margin-s", type=float, default=15.0)
    p.add_argument("--teardown-margin-s", type=float, default=45.0)
    p.add_argument("--turn-timeout-s", type=float, default=300.0, help="a turn longer than this counts as a hang")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.launcher = args.launcher or ("torchrun" if args.device == "cpu" else "accelerate")
    if args.steps_per_generation % args.gradient_accumulation_steps:
        p.error("--steps-per-generation must be a multiple of --gradient-accumulation-steps")
    if args.steps_per_generation // args.gradient_accumulation_steps < 2:
        p.error("one rollout needs at least two optimizer steps (an off-policy one to time)")
    if "gspo" not in args.methods:
        p.error("--methods must include gspo (the ratios are taken to it)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.phase == "init":
        return save_init(args)
    if args.phase == "time":
        if int(world := os.environ.get("WORLD_SIZE", "1")) != args.processes:
            raise SystemExit(f"launched with {world} processes, --processes says {args.processes}")
        return phase_time(args)
    report = merge_reports(args) if args.merge else phase_all(args) if args.phase == "all" else phase_report(args)
    common.write_json(pathlib.Path(args.out_dir) / "layouts.json", report)
    if args.merge and args.plot:
        plot_ratios(report, pathlib.Path(args.plot))
    print_table(report)


if __name__ == "__main__":
    main()
