"""Learning dynamics of every method on a task, several seeds, runs in parallel; also the cancellation study.

    # on the GPU machine: every (method, seed) run as its own process, N at a time, all on cuda:0
    python -m dfpo_bench.studies.learning --launch --model /root/models/smollm2-135m-instruct --seeds 0 --out-dir $OUT
    # here: merge the parts into benchmarks/results/learning.json and learning_curves.json
    python -m dfpo_bench.studies.learning --aggregate benchmarks/results/learning_*_runs.json
    # CPU check of the whole pipeline (tiny random model, 2 generations, 2 methods x 1 seed)
    python -m dfpo_bench.studies.learning --launch --smoke --out-dir /tmp/learning-smoke

    # the cancellation study: 6 methods x 5 seeds on a task (``--tasks arithmetic sum_sentence``: both), runs spread
    # over every visible GPU; then cancellation.json from the parts (benchmarks/README.md has the sizes)
    python -m dfpo_bench.studies.learning --launch --study cancellation --model /root/models/smollm2-135m-instruct \
        --task sum_sentence --seeds 0 1 2 3 4 --parallel 30 --generations 36 --deadline-s 560 --out-dir $OUT
    python -m dfpo_bench.studies.learning --aggregate benchmarks/results/cancellation/*_runs.json --study cancellation

One run (``--run``) trains one method from the same pretrained weights with one seed (sampling, data order and
training problems follow the seed) for ``--generations`` rollouts of ``batch_size * steps_per_generation /
num_generations`` prompts, off-policy (``steps_per_generation`` > gradient accumulation = 1), and writes its
curves after every rollout: sampled reward per generation, and per optimizer step entropy, ``asym/*``,
``cancellation/*`` (the shared-prefix residual, overall and two-sided, the one-sided group fraction), ``transform/*``,
clip ratios. At the end: greedy accuracy on the fixed held-out problems of the task (``--task``: ``arithmetic`` or
``sum_sentence`` of ``dfpo_trl.cli.tasks``). Summaries average the cancellation metrics and the clip fraction over the
off-policy steps (index within the rollout ≠ 0) as well. Every method runs through DFPOTrainer by default
(``--baseline-trainer dfpo``: GSPO and GRPO are DFPOTrainer with no DFPO option, the same loss and gradients as
TRL), so every method has the same group-granular batches and the same mechanism metrics.

``--launch`` starts the runs, prints progress with an ETA, stops every run in time to evaluate before
``--deadline-s`` and writes to ``--out-dir`` three files: ``learning_<tag>_runs.json`` (every run, full
curves, rewritten as runs finish), ``learning_<tag>.json`` (the summary ``report.py`` reads, for these runs;
with ``--study cancellation``: ``cancellation_<tag>.json``) and ``learning_<tag>.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]

from dfpo_bench.lib import common, trainers  # noqa: E402
from dfpo_bench.studies.learning_summary import (  # noqa: E402
    STEP_KEYS,
    STEP_PREFIXES,
    aggregate,
    cancellation_summary,
    load_runs,
    reward_curve,
    run_task,
    settings_of,
    table,
)

# Per-step log keys kept in a run's curves (besides every asym/, cancellation/, transform/, delta/, grpo_fix/).
EVAL_MARGIN_S = 45.0  # time a run keeps for its held-out evaluation and the final write


# ---------------------------------------------------------------------------------------------- one run
def run_one(args: argparse.Namespace) -> None:
    """Train one (method, seed), write its JSON after every rollout and at the end."""
    common.quiet()
    import torch
    from dfpo_trl.cli import greedy_accuracy
    from transformers import PrinterCallback, TrainerCallback

    started = time.time()
    torch.manual_seed(args.seed)
    tokenizer = trainers.load_tokenizer(args.tokenizer or args.model or trainers.default_tokenizer_path())
    model = trainers.build_model(
        args.model, args.random_config, tokenizer, trainers.DTYPES[args.dtype], args.device, args.seed
    )
    task, rewards = trainers.task_and_rewards(args.reward, args.task)
    heldout = task.build_dataset("test", args.heldout)
    spg = args.steps_per_generation
    trainer_cls, config_cls, overrides = trainers.trainer_and_config(
        args.method, args.baseline_trainer, allow_missing=args.allow_missing_fields
    )
    record: dict[str, Any] = {
        "task": args.task, "method": args.method, "seed": args.seed, "device": common.device_name(args.device),
        # Config fields of the method this dfpo_trl lacked and the run went without (--allow-missing-fields).
        "missing_fields": trainers.missing_config_fields(args.method) if args.allow_missing_fields else [],
        "model": pathlib.Path(args.model).name if args.model else f"random-{args.random_config}",
        "settings": settings_of(args), "versions": common.versions(), "complete": False,
        "initial_accuracy": None, "final_accuracy": None, "steps": [], "log": {},
    }
    if args.initial_eval:
        record["initial_accuracy"] = greedy_accuracy(
            model, tokenizer, heldout, task, max_new_tokens=args.eval_max_new_tokens, batch_size=64
        )

    def write() -> None:
        record["wall_s"] = time.time() - started
        record["generations_done"] = len(reward_curve(record))
        common.write_json(args.out, record)

    class Recorder(TrainerCallback):
        """Keep the logged metrics per optimizer step; write after every rollout; stop at ``--stop-at``."""

        def on_log(self, a, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs and "reward" not in logs:
                return
            step = len(record["steps"])
            record["steps"].append(state.global_step)
            for key, value in logs.items():
                if isinstance(value, (int, float)) and (key in STEP_KEYS or key.startswith(STEP_PREFIXES)):
                    column = record["log"].setdefault(key, [])
                    column.extend([None] * (step - len(column)))
                    column.append(float(value) if math.isfinite(value) else None)  # JSON has no NaN
            if "reward" in logs:
                write()

        def on_step_end(self, a, state, control, **kwargs):
            if args.stop_at and time.time() > args.stop_at:
                control.should_training_stop = True
                record["stopped_early"] = True

    if args.sequence_loss_type and overrides.get("importance_sampling_level") == "sequence":
        overrides["loss_type"] = args.sequence_loss_type
    if args.energy_buckets:
        if "log_energy_buckets" not in config_cls.__dataclass_fields__:
            raise SystemExit(f"--energy-buckets needs DFPOTrainer for {args.method}: use --baseline-trainer dfpo")
        overrides["log_energy_buckets"] = args.energy_buckets
    kwargs = trainers.config_kwargs(
        device=args.device, seed=args.seed, max_steps=args.generations * spg,
        per_device_train_batch_size=args.batch_size, num_generations=args.num_generations,
        steps_per_generation=spg, max_completion_length=args.max_completion_length, learning_rate=args.lr,
        temperature=args.temperature, beta=args.beta, gradient_checkpointing=args.gradient_checkpointing,
    )
    prompts = args.generations * args.batch_size * spg // args.num_generations
    trainer = trainer_cls(
        model=model, reward_funcs=rewards, args=config_cls(**kwargs, **overrides),
        train_dataset=task.build_dataset("train", max(prompts, args.train_size), args.seed),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Recorder())
    trainer.train()
    for column in record["log"].values():  # pad every column to the number of logged steps
        column.extend([None] * (len(record["steps"]) - len(column)))
    final_model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    record["final_accuracy"] = greedy_accuracy(
        final_model, tokenizer, heldout, task, max_new_tokens=args.eval_max_new_tokens, batch_size=64
    )
    record["complete"] = len(reward_curve(record)) >= args.generations
    if args.device.startswith("cuda"):
        record["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    write()
    rewards = reward_curve(record)
    print(
        f"{args.task} {args.method} seed {args.seed}: {len(rewards)} generations, final reward "
        f"{statistics.fmean(rewards[-3:]) if rewards else float('nan'):.3f}, held-out "
        f"{record['initial_accuracy']} -> {record['final_accuracy']:.3f}, {record['wall_s']:.0f} s"
    )


# ---------------------------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace) -> None:
    """Run every (method, seed) as a subprocess, ``--parallel`` at a time; collect and summarise."""
    methods = trainers.check_methods(list(args.methods), allow_missing=args.allow_missing_fields)
    tasks = list(args.tasks or [args.task])
    gpus = gpu_slots(args)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="dfpo-learning-"))
    (work / "runs").mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("seeds" + "-".join(str(s) for s in args.seeds))
    log_path = out_dir / f"learning_{tag}.log"
    log_file = log_path.open("a")
    start = time.time()

    def say(text: str) -> None:
        line = f"[{time.time() - start:6.0f} s] {text}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    everything = [(t, m, s) for t in tasks for s in args.seeds for m in methods]
    queue = list(everything)
    say(
        f"{len(queue)} runs (tasks {tasks} x {len(methods)} methods x seeds {args.seeds}), {args.parallel} in "
        f"parallel on {len(gpus) or 'no'} GPU(s) {gpus}, {args.generations} generations each, deadline "
        f"{args.deadline_s:.0f} s; work dir {work}"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    running: dict[tuple[str, str, int], tuple[subprocess.Popen, float, str | None]] = {}
    durations: list[float] = []
    failed: list[str] = []
    skipped: list[str] = []
    last_report = 0.0

    def collect() -> list[dict[str, Any]]:
        runs = []
        for t, m, s in everything:
            path = run_file(work, t, m, s)
            if path.exists():
                runs.append(json.loads(path.read_text()))
        return runs

    def write_outputs() -> None:
        runs = collect()
        common.write_json(out_dir / f"learning_{tag}_runs.json", runs)
        if runs:
            write_summary(runs, args, out_dir, tag)

    while queue or running:
        now = time.time()
        for key, (proc, t0, _) in list(running.items()):
            if proc.poll() is not None:
                del running[key]
                name = f"{key[0]} {key[1]} seed {key[2]}"
                if proc.returncode == 0:
                    durations.append(now - t0)
                    say(f"done {name} in {now - t0:.0f} s")
                else:
                    failed.append(name)
                    tail = run_file(work, *key).with_suffix(".log").read_text(errors="replace")[-3000:]
                    say(f"FAILED {name} (exit {proc.returncode}); log tail:\n{tail}")
                write_outputs()
        left = args.deadline_s - (now - start)
        while queue and len(running) < args.parallel:
            expected = max(durations) if durations else 0.0
            if left < EVAL_MARGIN_S + 30 or (durations and left < 0.5 * expected):
                say(f"not starting {len(queue)} queued runs: {left:.0f} s left, a run takes ~{expected:.0f} s")
                skipped.extend(f"{t} {m} seed {s}" for t, m, s in queue)
                queue.clear()
                break
            t, m, s = queue.pop(0)
            out = run_file(work, t, m, s)
            # The untrained model's greedy accuracy is the same for every run of a task: measured once per task.
            first_of_task = (m, s) == (methods[0], args.seeds[0])
            initial = args.initial_eval and (first_of_task or not args.initial_eval_once)
            cmd = [sys.executable, __file__, "--run", "--task", t, "--method", m, "--seed", str(s), "--out", str(out),
                   "--stop-at", str(start + args.deadline_s - EVAL_MARGIN_S), *child_flags(args),
                   "--initial-eval" if initial else "--no-initial-eval"]
            gpu = least_busy(gpus, [g for _, _, g in running.values()])
            child_env = env if gpu is None else dict(env, CUDA_VISIBLE_DEVICES=gpu)
            log = out.with_suffix(".log").open("w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
            running[(t, m, s)] = (proc, time.time(), gpu)
        if now - last_report >= args.report_every:
            last_report = now
            say(progress(running, queue, durations, args, start))
        if left <= 0:
            for key, (proc, _, _) in running.items():
                say(f"deadline: terminating {key[0]} {key[1]} seed {key[2]}")
                proc.send_signal(signal.SIGTERM)
            time.sleep(5)
            for proc, _, _ in running.values():
                if proc.poll() is None:
                    proc.kill()
            running.clear()
        time.sleep(args.poll_s)
    write_outputs()
    runs = collect()
    say(
        f"finished: {len(runs)} runs written, failed: {', '.join(failed) or 'none'}, not started (deadline): "
        f"{', '.join(skipped) or 'none'}; {time.time() - start:.0f} s"
    )
    for t in tasks:
        task_runs = [r for r in runs if run_task(r) == t]
        if task_runs:
            summary, _ = aggregate(task_runs, args.threshold, args.ema)
            say(f"{t}:\n" + table(summary, study=args.study == "cancellation"))
    log_file.close()
    if failed or not runs:
        raise SystemExit(1)


def progress(running: dict, queue: list, durations: list[float], args: argparse.Namespace, start: float) -> str:
    """One status line: generations done per running run and an ETA from their rates so far."""
    parts, etas = [], []
    for (t, m, s), (_, t0, _) in running.items():
        path = run_file(pathlib.Path(args.work_dir), t, m, s) if args.work_dir else None
        done = 0
        if path is not None and path.exists():
            try:
                done = json.loads(path.read_text()).get("generations_done", 0)
            except ValueError:
                done = 0
        parts.append(f"{t[:5]}/{m}/{s}:{done}")
        if done:
            etas.append((time.time() - t0) / done * (args.generations - done) + 20)
    status = f"running {len(running)}, queued {len(queue)}, generations done: {' '.join(parts)}"
    if not etas:
        return status + "; ETA after the first generation"
    waves = -(-len(queue) // max(args.parallel, 1))
    oldest = min(t0 for _, t0, _ in running.values())
    per_run = statistics.fmean(durations) if durations else max(etas) + time.time() - oldest
    eta = max(etas) + waves * per_run
    end = time.time() - start + eta
    return status + f"; ETA ~{eta:.0f} s, {end:.0f} s after start (deadline {args.deadline_s:.0f} s)"


def run_file(work: pathlib.Path, task: str, method: str, seed: int) -> pathlib.Path:
    """Where a run writes its JSON (its log: the same name with ``.log``)."""
    return work / "runs" / f"{task}_{method}_s{seed}.json"


def write_summary(runs: list[dict[str, Any]], args: argparse.Namespace, out_dir: pathlib.Path, tag: str) -> None:
    """The launcher's summary file: ``cancellation_<tag>.json`` for the cancellation study, else
    ``learning_<tag>.json`` (one task's runs)."""
    if args.study == "cancellation":
        common.write_json(out_dir / f"cancellation_{tag}.json", cancellation_summary(runs, args.threshold, args.ema))
    else:
        summary, _ = aggregate(runs, args.threshold, args.ema)
        common.write_json(out_dir / f"learning_{tag}.json", summary)


def gpu_slots(args: argparse.Namespace) -> list[str]:
    """The GPUs runs are spread over (``--gpus``: "auto" = every visible one; a count; or a list of ids), as
    CUDA_VISIBLE_DEVICES values; empty on the CPU. A run's memory stays on its own card."""
    if not args.device.startswith("cuda") or args.gpus == "none":
        return []
    if args.gpus == "auto":
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    if args.gpus.isdigit():
        return [str(i) for i in range(int(args.gpus))]
    return args.gpus.split(",")


def least_busy(gpus: list[str], busy: list[str | None]) -> str | None:
    """The GPU with the fewest running runs (first on a tie); None when runs are not placed on GPUs."""
    if not gpus:
        return None
    return min(gpus, key=lambda g: busy.count(g))


def child_flags(args: argparse.Namespace) -> list[str]:
    """The launcher's settings, passed on to every run."""
    flags = []
    for key in (
        "lr", "num_generations", "steps_per_generation", "batch_size", "max_completion_length", "temperature",
        "beta", "generations", "threshold", "ema", "heldout", "train_size", "dtype", "baseline_trainer",
        "eval_max_new_tokens", "device", "model", "random_config", "tokenizer", "sequence_loss_type",
        "energy_buckets", "reward",
    ):
        value = getattr(args, key)
        if value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    flags.append("--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing")
    if args.allow_missing_fields:
        flags.append("--allow-missing-fields")
    return flags


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--launch", action="store_true", help="run every (method, seed) in parallel processes")
    mode.add_argument("--run", action="store_true", help="one (method, seed) run (what --launch starts)")
    mode.add_argument("--aggregate", nargs="+", metavar="RUNS_JSON", help="merge *_runs.json into --out-dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint path (GPU kit: /root/models/smollm2-135m-instruct)")
    src.add_argument("--random-config", choices=trainers.RANDOM_CONFIGS)
    p.add_argument("--tokenizer")
    p.add_argument("--methods", nargs="+", default=None,
                   help="default: the learning methods, or with --study cancellation the study's six")
    p.add_argument("--task", choices=trainers.BENCHMARK_TASKS, default="arithmetic",
                   help="training reward and held-out accuracy (dfpo_trl.cli.tasks)")
    p.add_argument("--reward", choices=["task", "id_parity"], default="task",
                   help="training reward: the task's, or id_parity (random models, which never solve the task: "
                   "about half of each group scores 1, so the mechanism metrics have non-zero advantages)")
    p.add_argument("--tasks", nargs="+", choices=trainers.BENCHMARK_TASKS,
                   help="launcher: several tasks in one launch (default: --task)")
    p.add_argument("--study", choices=["learning", "cancellation"], default="learning",
                   help="cancellation: the study's methods by default and cancellation_<tag>.json / cancellation.json")
    p.add_argument("--allow-missing-fields", action="store_true",
                   help="run methods whose DFPOConfig fields this dfpo_trl lacks without them (CPU smoke only; "
                   "every run records what it went without)")
    p.add_argument("--gpus", default="auto",
                   help="launcher: spread runs over GPUs: auto (all visible), a count, ids '0,1', or none")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--num-generations", type=int, default=16, help="G")
    p.add_argument("--steps-per-generation", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per_device_train_batch_size (completions)")
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--generations", type=int, default=36, help="rollouts per run (the same for every method)")
    p.add_argument("--threshold", type=float, default=0.6)
    p.add_argument("--ema", type=float, default=0.3, help="EMA weight of the newest reward")
    p.add_argument("--heldout", type=int, default=200, help="held-out problems (tasks' fixed test split)")
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--dtype", choices=sorted(trainers.DTYPES), default="float32",
                   help="master weights (float32 = TRL's default; bf16 autocast on GPU either way)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="TRL's default; keeps 10 parallel runs of SmolLM2 within an 80 GB card")
    p.add_argument("--baseline-trainer", choices=["dfpo", "trl"], default="dfpo")
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument(
        "--sequence-loss-type", choices=["grpo", "dapo", "bnpo", "dr_grpo"], default=None,
        help="loss_type of the sequence-level methods (GSPO and the transforms; default: grpo, as in "
        "docs/source/concepts/reference-runs.md). "
        "A token-sum aggregation (dapo) makes shared tokens cancel whatever the completion lengths (NOTES.md)",
    )
    p.add_argument(
        "--energy-buckets", type=int, default=0,
        help="log eq. 24's energy/freq_bucket_* with this many frequency buckets (DFPOConfig.log_energy_buckets)",
    )
    p.add_argument("--initial-eval", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--initial-eval-once", action=argparse.BooleanOptionalAction, default=True,
                   help="launcher: the untrained model's held-out accuracy only in each task's first run (it is the "
                   "same weights and greedy decoding for every run)")
    p.add_argument("--device", default=None)
    p.add_argument("--parallel", type=int, default=10)
    p.add_argument("--deadline-s", type=float, default=480.0, help="launcher: all runs end (evaluated) by then")
    p.add_argument("--stop-at", type=float, default=None, help="run: stop training at this epoch time")
    p.add_argument("--report-every", type=float, default=30.0)
    p.add_argument("--poll-s", type=float, default=2.0)
    p.add_argument("--out", help="run: its JSON file")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--work-dir", help="launcher: per-run files and logs (default: a temporary directory)")
    p.add_argument("--tag", help="launcher: output file tag (default: from the seeds)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny random model, 2 generations, 2 methods x 1 seed "
                   "(with --study cancellation: 3 generations, sum_sentence x 6 methods x 1 seed)")
    args = p.parse_args(argv)
    if args.methods is None:
        args.methods = trainers.CANCELLATION_METHODS if args.study == "cancellation" else trainers.LEARNING_METHODS
    if args.smoke:
        args.model, args.random_config, args.device, args.dtype = None, "tiny", "cpu", "float32"
        args.generations, args.num_generations, args.batch_size, args.steps_per_generation = 2, 4, 8, 2
        args.max_completion_length, args.eval_max_new_tokens, args.lr = 8, 8, 1e-3
        if args.launch and args.study == "cancellation":
            # Every study method on the new task, trained on id_parity (a random model never solves the task, and
            # zero advantages would leave the mechanism metrics empty); the pipeline, not the numbers, is checked.
            args.generations, args.heldout, args.reward = 3, 8, "id_parity"
            args.tasks, args.seeds, args.parallel, args.deadline_s = ["sum_sentence"], [0], 2, 500.0
            args.allow_missing_fields = True
            args.report_every, args.poll_s, args.tag = 20.0, 0.5, args.tag or "smoke"
        elif args.launch:
            args.methods, args.seeds, args.parallel, args.deadline_s = ["gspo", "min_replace"], [0], 2, 170.0
            args.report_every, args.poll_s, args.tag = 10.0, 0.5, args.tag or "smoke"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (args.model or args.random_config or args.aggregate):
        p.error("give --model PATH or --random-config NAME (or --smoke)")
    if args.run and not (args.method and args.out):
        p.error("--run needs --method and --out")
    if args.steps_per_generation <= 1:
        p.error("--steps-per-generation must be > 1 (off-policy, so the transforms act)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run:
        trainers.check_methods([args.method], allow_missing=args.allow_missing_fields)
        run_one(args)
    elif args.launch:
        if args.work_dir is None:
            args.work_dir = tempfile.mkdtemp(prefix="dfpo-learning-")
        launch(args)
    elif args.study == "cancellation":
        runs = load_runs(args.aggregate)
        first = runs[0]["settings"] if runs else {}
        result = cancellation_summary(runs, first.get("threshold", args.threshold), first.get("ema", args.ema))
        path = pathlib.Path(args.out_dir) / "cancellation.json"
        common.write_json(path, result)
        for t in result["tasks"]:
            summary, _ = aggregate([r for r in runs if run_task(r) == t], result["threshold"], result["ema_alpha"])
            print(f"{t}:\n{table(summary, study=True)}")
        print(f"wrote {path} ({len(runs)} runs)")
    else:
        runs = load_runs(args.aggregate)
        first = runs[0]["settings"] if runs else {}
        summary, curves = aggregate(runs, first.get("threshold", args.threshold), first.get("ema", args.ema))
        out_dir = pathlib.Path(args.out_dir)
        common.write_json(out_dir / "learning.json", summary)
        common.write_json(out_dir / "learning_curves.json", curves)
        print(table(summary))
        print(f"wrote {out_dir / 'learning.json'} and {out_dir / 'learning_curves.json'} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
