"""Group layouts under ZeRO-3: DFPO Min-Replace in the ``pre_pass`` and ``redistributed`` layouts
against TRL's own GSPO, at the paper's shape scaled down, and the in-group coefficients of both layouts against
a single-process reference.

Commands (4 GPUs, after the kit's setup ``bash .dev/setup.sh && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks``).
Each stops itself within ``--deadline-s`` (default 510 s). Timing and check in two commands, each with the whole
budget, then merged here (the safer plan: a 1.7B model loads five times in all):

    python -m dfpo_bench.launch.layouts --no-check --out-dir $OUT   # reference init + timing  -> $OUT/layouts.json
    python -m dfpo_bench.launch.layouts --no-time --out-dir $OUT    # reference + coefficient check -> $OUT/layouts.json
    # here, with the two files copied to timing/ and check/:
    python -m dfpo_bench.launch.layouts --merge timing/layouts.json check/layouts.json \
        --out-dir benchmarks/results/layouts

    # or everything in one command (the check's share of the budget is bounded, the timing gets the rest)
    python -m dfpo_bench.launch.layouts --out-dir $OUT

    # the same, phase by phase (the work dir carries the random init and the reference between them)
    python -m dfpo_bench.launch.layouts --phase reference --work-dir /tmp/dfpo-layouts
    accelerate launch --config_file recipes/accelerate/zero3_4gpu.yaml dfpo_bench.launch.layouts --phase check \
        --work-dir /tmp/dfpo-layouts
    accelerate launch --config_file recipes/accelerate/zero3_4gpu.yaml dfpo_bench.launch.layouts --phase time \
        --work-dir /tmp/dfpo-layouts --deadline-s 400
    python -m dfpo_bench.launch.layouts --phase report --work-dir /tmp/dfpo-layouts --out-dir $OUT

    # CPU check of the pipeline (tiny random model, 4 gloo processes through torchrun, no DeepSpeed), ~2.5 min
    python -m dfpo_bench.launch.layouts --device cpu --random-config tiny --completion-length 24 \
        --min-completion-length 12 --rounds 2 --out-dir /tmp/layouts-cpu

Shape (defaults): per-device batch 1, G = 4 = processes, ``steps_per_generation`` 16 and accumulation 4, so a
rollout is 4 optimizer steps (1 on-policy, 3 off-policy) as in recipes/qwen3_32b.yaml (128 / 32) and the
pre-pass forwards about as many rows per trained row as at the paper's shape; completions of 256-384 tokens
(random lengths), prompts of 32 tokens; Qwen3-1.7B's shape with SmolLM2's vocabulary, random init.

Phases:

* ``reference`` (one process, no DeepSpeed, float32): saves a random init of ``--random-config`` (Qwen3-1.7B's
  shape, no pad id in the config: trainers.random_config) and computes s̄ (eq. 47) and s̃ (Min-Replace per group,
  ``dfpo_trl.transforms``) of every row of one fixed generation batch at those weights, as zero3.py does.
* ``check`` (``accelerate launch``, ZeRO-3, float32): the ``pre_pass`` and ``redistributed`` trainers, one after the
  other, train one rollout (``steps_per_generation / gradient_accumulation_steps`` optimizer steps) on that batch
  at learning rate 1e-30 (DFPOConfig refuses 0; every float32 update of that size rounds off, so θ stays the
  initial θ bit for bit), and record the s̄ / s̃ their losses used (each micro-step's ``ObjectiveValues.weights``,
  by ``row_ids``) in the first off-policy optimizer step (the second of the rollout: in the first, θ = θ_old and the
  pre-pass skips its forward, every s = 1). That step's θ is the initial θ, so it must match the reference. The
  check uses ε = 0.2 / 0.28 and old log-probs shifted by N(0, 0.15) per row (as zero3.py), so s̄ spans the whole
  clip range and a wrong or stale member would show as an O(0.1) difference; float32 against float32, tolerance
  ``--tolerance`` (1e-4).
* ``time`` (``accelerate launch``, ZeRO-3, bf16): three trainers in ONE process, each with its own DeepSpeed
  engine, on the same random init and the same fixed rollout: TRL's ``GRPOTrainer`` with GSPO's settings
  (``trainers.trainer_and_config("gspo", baseline_trainer="trl")``), and DFPO Min-Replace (GSPO's ε) forced to
  ``group_layout="pre_pass"`` and to ``"redistributed"``. No generation: every trainer's rollout
  (``_generate_and_score_completions`` below TRL's buffering, so DFPO's own rollout code, the redistribution
  included, runs as in training) returns this process's slice of one hand-built generation batch, with old
  log-probs computed by the model at the rollout (TRL's forward) minus a small per-row shift. Interleaving: each
  trainer's ``train()`` runs in its own thread, and only one thread runs at a time: the threads hand a baton
  over at optimizer-step boundaries (``on_step_end``), in an order drawn per round from a seeded generator,
  identical on every rank, so every rank issues the same collectives in the same order. A round gives every
  method one turn of ``--steps-per-turn`` optimizer steps (default 1: the methods' steps alternate, so a round's
  ratio compares steps a few seconds apart and drift between rounds cancels); one untimed warm-up turn of
  ``--warmup-rollouts`` rollouts per method comes first, so every method is at the same step of its rollout in
  every round.
* ``report``: ``layouts.json`` and the table.

Why threads: a ``Trainer.train()`` call creates its DeepSpeed engine on entry, so calling ``train()`` again per
phase would build a new engine (and leak the old one) every time, and three trainers' loops cannot otherwise be
interleaved step by step in one process. The accelerate state is a process-wide singleton that only the first
``Accelerator`` may configure with a DeepSpeed plugin, so the later trainers share the first one's plugin
(``share_deepspeed_plugin``); every trainer has the same batch sizes, precision and accumulation, so the shared
DeepSpeed config is the same for all.

Timed: an optimizer step from ``on_step_begin`` to ``on_step_end`` (every micro-step's forward and backward, the
pre-pass where there is one, the optimizer step), every rank aligned at both ends (a one-float all-reduce, then a
CUDA synchronise: the time from all ranks starting to the slowest finishing), for the *off-policy* steps only:
every optimizer step but the first of each rollout. The first step holds the rollout (here: slicing the fixed batch,
TRL's old-log-prob forward, and the redistributed layout's one all-to-all per rollout) and the pre-pass skips its
forward there, so it is reported apart (``first_step_median_s``). Per round and method the median of its timed
steps; ``median_step_s`` is the median over rounds with a 95% percentile-bootstrap interval over rounds;
``ratio_to_gspo`` the median over rounds of the within-round ratio to GSPO, bootstrapped the same way. Garbage
collection (``--gc between-turns``, the default): after the warm-up the long-lived heap is frozen, and between turns
the collector runs untimed, as ``timeit`` keeps it out of what it times; collections a step triggers itself stay in
its time and are recorded (``gc_s`` per step). Every timed step is kept in the report (``steps``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import socket
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]


from dfpo_bench.launch.layouts_report import merge_reports, phase_report, print_table  # noqa: E402
from dfpo_bench.launch.layouts_setup import DEFAULT_ACCELERATE_CONFIG, METHODS, phase_check, phase_reference  # noqa: E402
from dfpo_bench.launch.layouts_timing import phase_time  # noqa: E402
from dfpo_bench.lib import common, trainers  # noqa: E402
from dfpo_bench.lib.common import stop_process_group  # noqa: E402

HERE = pathlib.Path(__file__).resolve()

# ------------------------------------------------------------------------------------------ phase: all
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase_args(args: argparse.Namespace, phase: str, *extra: str) -> list[str]:
    """This script's command line for ``phase``, every shape argument passed on explicitly."""
    out = [str(HERE), "--phase", phase, "--work-dir", args.work_dir, "--device", args.device,
           "--random-config", args.random_config, "--dtype", args.dtype, "--seed", str(args.seed),
           "--processes", str(args.processes), "--per-device", str(args.per_device),
           "--num-generations", str(args.num_generations), "--steps-per-generation", str(args.steps_per_generation),
           "--gradient-accumulation-steps", str(args.gradient_accumulation_steps),
           "--prompt-length", str(args.prompt_length), "--completion-length", str(args.completion_length),
           "--min-completion-length", str(args.min_completion_length), "--rounds", str(args.rounds),
           "--steps-per-turn", str(args.steps_per_turn), "--warmup-rollouts", str(args.warmup_rollouts),
           "--gc", args.gc,
           "--learning-rate", str(args.learning_rate), "--shift", str(args.shift),
           "--check-shift", str(args.check_shift), "--check-epsilon", *map(str, args.check_epsilon),
           "--check-learning-rate", str(args.check_learning_rate),
           "--turn-timeout-s", str(args.turn_timeout_s), "--methods", *args.methods]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    if args.prepass_batch_size is not None:
        out += ["--prepass-batch-size", str(args.prepass_batch_size)]
    if args.no_gradient_checkpointing:
        out.append("--no-gradient-checkpointing")
    return out + list(extra)


def launcher(args: argparse.Namespace) -> list[str]:
    if args.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(args.accelerate_config),
            "--num_processes", str(args.processes), "--main_process_port", str(free_port())]


def run_logged(command: list[str], log: Any, timeout: float, env: dict[str, str]) -> int:
    """Run ``command`` in its own process group with output to ``log``; kill the group after ``timeout`` s."""
    log.write(f"\n$ {shlex.join(command)}\n")
    log.flush()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        stop_process_group(proc)
        log.write(f"[killed after {timeout:.0f} s]\n")
        return -9


def phase_all(args: argparse.Namespace) -> None:
    start = time.time()
    deadline = start + args.deadline_s
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for stale in [*work.glob("check_*_rank*.pt"), work / "timing.json"]:
        stale.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": common.child_pythonpath()}
    if args.device == "cpu":
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log_path = out / "layouts.log"
    stages = []
    with log_path.open("w") as log:
        # (phase, share of the time left it may take): the reference and the check are bounded so that the
        # timing always gets most of the budget; the timing stops starting rounds before its own end.
        phases = [("reference", 0.25), ("check", 0.45), ("time", 1.0)]
        phases = [(phase, share) for phase, share in phases
                  if not (phase == "check" and args.no_check) and not (phase == "time" and args.no_time)]
        for index, (phase, share) in enumerate(phases):
            share = 1.0 if index == len(phases) - 1 else share  # the last stage may use all that is left
            left = deadline - time.time() - args.report_margin_s
            if phase == "reference":
                command = [sys.executable, *phase_args(args, "reference", *(["--init-only"] if args.no_check else []))]
            elif phase == "check":
                command = [*launcher(args), *phase_args(args, "check")]
            else:
                stop_at = time.time() + left - args.teardown_margin_s
                command = [*launcher(args), *phase_args(args, "time", "--stop-at", f"{stop_at:.0f}")]
            stage_start = time.time()
            code = run_logged(command, log, share * left, env)
            stages.append({"phase": phase, "returncode": code, "seconds": round(time.time() - stage_start, 1)})
            print(f"{phase}: exit {code} after {stages[-1]['seconds']} s (log: {log_path})", flush=True)
    report = phase_report(args)
    report["stages"] = stages
    report["wall_s"] = round(time.time() - start, 1)
    report["command"] = shlex.join([sys.executable, *sys.argv])
    common.write_json(out / "layouts.json", report)
    if any(s["returncode"] != 0 for s in stages):
        tail = log_path.read_text().splitlines()[-40:]
        print("\nlast lines of the log:\n" + "\n".join(tail))
        print_table(report)  # the table stays the last thing printed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="all", choices=("all", "reference", "check", "time", "report"))
    p.add_argument("--merge", nargs="+", default=None, metavar="LAYOUTS_JSON",
                   help="instead of a phase: merge the layouts.json of separate runs into --out-dir/layouts.json")
    p.add_argument("--plot", default=None, help="--merge: also draw the per-round ratios to this PNG")
    p.add_argument("--work-dir", default="/tmp/dfpo-layouts")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--launcher", default=None, choices=("accelerate", "torchrun"),
                   help="phase all: how check/time are launched (default: accelerate on cuda, torchrun on cpu)")
    p.add_argument("--accelerate-config", default=str(DEFAULT_ACCELERATE_CONFIG))
    p.add_argument("--random-config", default="qwen3-1.7b", choices=trainers.RANDOM_CONFIGS)
    p.add_argument("--tokenizer", default=None, help="default: the kit's SmolLM2 (trainers.default_tokenizer_path)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="precision of the timed trainers (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--per-device", type=int, default=1)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--steps-per-generation", type=int, default=16)
    p.add_argument("--gradient-accumulation-steps", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--completion-length", type=int, default=384)
    p.add_argument("--min-completion-length", type=int, default=256)
    p.add_argument("--rounds", type=int, default=400, help="at most; the deadline may stop earlier")
    p.add_argument("--steps-per-turn", type=int, default=1,
                   help="optimizer steps a method runs per turn (a round is one turn of each method)")
    p.add_argument("--warmup-rollouts", type=int, default=1, help="untimed rollouts per method before round 0")
    p.add_argument("--gc", default="between-turns", choices=("between-turns", "as-is"),
                   help="between-turns: freeze the heap after the warm-up and collect between turns (untimed), as "
                        "timeit keeps the collector out of what it times; as-is: Python's collector untouched")
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--shift", type=float, default=3e-4, help="timing: std of the per-row old-log-prob offset")
    p.add_argument("--prepass-batch-size", type=int, default=None, help="DFPOConfig.prepass_batch_size (default: None)")
    p.add_argument("--check-shift", type=float, default=0.15, help="check: std of the per-row old-log-prob offset")
    p.add_argument("--check-epsilon", type=float, nargs=2, default=[0.2, 0.28])
    p.add_argument("--check-learning-rate", type=float, default=1e-30,
                   help="check: so small that every float32 update rounds off (DFPOConfig refuses 0)")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--reference-chunk", type=int, default=8)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="phase all: skip the coefficient check")
    p.add_argument("--no-time", action="store_true", help="phase all: skip the timing")
    p.add_argument("--init-only", action="store_true", help="phase reference: only save the random init")
    p.add_argument("--deadline-s", type=float, default=510.0, help="phase all: everything ends within this")
    p.add_argument("--stop-at", type=float, default=None, help="phase time: no round starts after this epoch time")
    p.add_argument("--report-margin-s", type=float, default=15.0)
    p.add_argument("--teardown-margin-s", type=float, default=45.0)
    p.add_argument("--turn-timeout-s", type=float, default=300.0, help="a turn longer than this counts as a hang")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.launcher = args.launcher or ("torchrun" if args.device == "cpu" else "accelerate")
    if args.steps_per_generation % args.gradient_accumulation_steps:
        p.error("--steps-per-generation must be a multiple of --gradient-accumulation-steps")
    if args.steps_per_generation // args.gradient_accumulation_steps < 2:
        p.error("one rollout needs at least two optimizer steps (an off-policy one to time and check)")
    if "gspo" not in args.methods and args.phase in ("all", "time"):
        p.error("--methods must include gspo (the ratios are taken to it)")
    return args


def main() -> None:
    args = parse_args()
    if args.merge:
        merge_reports(args)
        return
    if args.phase in ("check", "time"):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != args.processes:
            raise SystemExit(f"launched with {world} processes, --processes says {args.processes}")
    {"all": phase_all, "reference": phase_reference, "check": phase_check, "time": phase_time,
     "report": phase_report}[args.phase](args)


if __name__ == "__main__":
    main()
