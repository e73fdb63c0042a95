"""Learning dynamics of every method on the arithmetic task, several seeds, runs in parallel (issue #5, part 2).

    # on the GPU machine: every (method, seed) run as its own process, N at a time, all on cuda:0
    python benchmarks/learning.py --launch --model /root/models/smollm2-135m-instruct --seeds 0 --out-dir $OUT
    # here: merge the parts into benchmarks/results/learning.json and learning_curves.json
    python benchmarks/learning.py --aggregate benchmarks/results/learning_*_runs.json
    # CPU check of the whole pipeline (tiny random model, 2 generations, 2 methods x 1 seed)
    python benchmarks/learning.py --launch --smoke --out-dir /tmp/learning-smoke

One run (``--run``) trains one method from the same pretrained weights with one seed (sampling, data order and
training problems follow the seed) for ``--generations`` rollouts of ``batch_size * steps_per_generation /
num_generations`` prompts, off-policy (``steps_per_generation`` > gradient accumulation = 1), and writes its
curves after every rollout: sampled reward per generation, and per optimizer step entropy, ``asym/*``,
``cancellation/shared_prefix_residual``, ``transform/*``, clip ratios. At the end: greedy accuracy on the fixed
held-out problems of ``dfpo_trl.tasks``. Every method runs through DFPOTrainer by default (``--baseline-trainer
dfpo``: GSPO and GRPO are DFPOTrainer with no DFPO option, the same loss and gradients as TRL), so every method
has the same group-granular batches and the same mechanism metrics.

``--launch`` starts the runs, prints progress with an ETA, stops every run in time to evaluate before
``--deadline-s`` and writes to ``--out-dir`` three files: ``learning_<tag>_runs.json`` (every run, full
curves, rewritten as runs finish), ``learning_<tag>.json`` (the issue's schema for these runs) and
``learning_<tag>.log``.
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402

# Per-step log keys kept in a run's curves (besides every asym/, cancellation/, transform/, delta/, grpo_fix/).
STEP_KEYS = (
    "reward", "reward_std", "frac_reward_zero_std", "entropy", "loss", "grad_norm", "kl",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length",
    "completions/clipped_ratio",
)
STEP_PREFIXES = ("asym/", "cancellation/", "transform/", "delta/", "grpo_fix/", "energy/")
RESIDUAL = "cancellation/shared_prefix_residual"
EVAL_MARGIN_S = 45.0  # time a run keeps for its held-out evaluation and the final write


# ---------------------------------------------------------------------------------------------- one run
def run_one(args: argparse.Namespace) -> None:
    """Train one (method, seed), write its JSON after every rollout and at the end."""
    common.quiet()
    import torch
    from transformers import PrinterCallback, TrainerCallback

    from dfpo_trl.tasks import greedy_accuracy

    started = time.time()
    torch.manual_seed(args.seed)
    tokenizer = common.load_tokenizer(args.tokenizer or args.model or common.default_tokenizer_path())
    model = common.build_model(
        args.model, args.random_config, tokenizer, common.DTYPES[args.dtype], args.device, args.seed
    )
    task, rewards = common.task_and_rewards("arithmetic")
    heldout = task.build_dataset("test", args.heldout)
    spg = args.steps_per_generation
    record: dict[str, Any] = {
        "method": args.method, "seed": args.seed, "device": common.device_name(args.device),
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

    trainer_cls, config_cls, overrides = common.trainer_and_config(args.method, args.baseline_trainer)
    if args.sequence_loss_type and overrides.get("importance_sampling_level") == "sequence":
        overrides["loss_type"] = args.sequence_loss_type
    if args.energy_buckets:
        if "log_energy_buckets" not in config_cls.__dataclass_fields__:
            raise SystemExit(f"--energy-buckets needs DFPOTrainer for {args.method}: use --baseline-trainer dfpo")
        overrides["log_energy_buckets"] = args.energy_buckets
    kwargs = common.config_kwargs(
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
    write()
    rewards = reward_curve(record)
    print(
        f"{args.method} seed {args.seed}: {len(rewards)} generations, final reward "
        f"{statistics.fmean(rewards[-3:]) if rewards else float('nan'):.3f}, held-out "
        f"{record['initial_accuracy']} -> {record['final_accuracy']:.3f}, {record['wall_s']:.0f} s"
    )


def reward_curve(run: dict[str, Any]) -> list[float]:
    """Sampled reward of each rollout (TRL logs ``reward`` on the optimizer step that generated)."""
    return [v for v in run["log"].get("reward", []) if v is not None]


def per_generation(run: dict[str, Any], key: str) -> list[float | None]:
    """Mean of a per-step metric over each rollout's optimizer steps (None where it was never logged)."""
    spg = run["settings"]["steps_per_generation"]
    values = run["log"].get(key, [])
    out = []
    for g in range(len(reward_curve(run))):
        chunk = [v for v in values[g * spg : (g + 1) * spg] if v is not None]
        out.append(statistics.fmean(chunk) if chunk else None)
    return out


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "lr", "num_generations", "steps_per_generation", "batch_size", "max_completion_length", "temperature",
        "beta", "generations", "threshold", "ema", "heldout", "dtype", "gradient_checkpointing",
        "baseline_trainer", "eval_max_new_tokens", "sequence_loss_type", "energy_buckets",
    )
    return {k: getattr(args, k, None) for k in keys}


# ---------------------------------------------------------------------------------------------- summary
def run_summary(run: dict[str, Any], threshold: float, alpha: float) -> dict[str, Any]:
    """The issue's per-run numbers (plus a few more) from a run's curves."""
    from dfpo_trl.metrics import jitter2, steps_to_threshold

    rewards = reward_curve(run)
    index = steps_to_threshold(rewards, threshold, alpha=alpha) if rewards else None
    spg = run["settings"]["steps_per_generation"]
    entropy = [v for v in run["log"].get("entropy", [])[-spg:] if v is not None]
    residual = [v for v in run["log"].get(RESIDUAL, []) if v is not None]

    def mean_of(key: str) -> float | None:
        values = [v for v in run["log"].get(key, []) if v is not None]
        return statistics.fmean(values) if values else None

    return {
        # 1-based: the number of rollouts used up to and including the one whose EMA reached the threshold.
        "generations_to_threshold": None if index is None else index + 1,
        "jitter2": jitter2(rewards) if len(rewards) >= 3 else None,
        "final_accuracy": run.get("final_accuracy"),
        "entropy_final": statistics.fmean(entropy) if entropy else None,
        "shared_prefix_residual": statistics.fmean(residual) if residual else None,
        "initial_accuracy": run.get("initial_accuracy"),
        "final_reward": statistics.fmean(rewards[-3:]) if rewards else None,
        "asym_before": mean_of("asym/before"),
        "asym_after": mean_of("asym/after"),
        # What the transform itself removes, same run and steps (0 for GSPO: s~ = s_bar).
        "asym_reduction": paired_mean(run["log"].get("asym/before", []), run["log"].get("asym/after", [])),
        # Eq. 24: share of the LM-head gradient norm on the most frequent tokens (bucket 0), mean over steps.
        "energy_frequent": mean_of("energy/freq_bucket_0"),
        "generations_done": len(rewards),
        "complete": bool(run.get("complete")),
        "wall_s": run.get("wall_s"),
    }


def paired_mean(before: list[float | None], after: list[float | None]) -> float | None:
    """Mean of before - after over the steps where both were logged."""
    pairs = [b - a for b, a in zip(before, after, strict=False) if b is not None and a is not None]
    return statistics.fmean(pairs) if pairs else None


def aggregate(runs: list[dict[str, Any]], threshold: float, alpha: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(learning.json in the issue's schema, learning_curves.json per method for plotting)."""
    if not runs:
        raise SystemExit("no runs to aggregate")
    order = {m: i for i, m in enumerate(common.LEARNING_METHODS)}
    runs = sorted(runs, key=lambda r: (order.get(r["method"], 99), r["method"], r["seed"]))
    first = runs[0]
    methods: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    for run in runs:
        m = run["method"]
        summary = run_summary(run, threshold, alpha)
        entry = methods.setdefault(m, {"seeds": []})
        entry["seeds"].append(run["seed"])
        for key, value in summary.items():
            entry.setdefault(key, []).append(value)
        c = curves.setdefault(m, {"seeds": [], "label": common.METHODS[m].label})
        c["seeds"].append(run["seed"])
        c.setdefault("reward", []).append(reward_curve(run))
        for name, key in (
            ("entropy", "entropy"), ("asym_before", "asym/before"), ("asym_after", "asym/after"),
            ("residual", RESIDUAL), ("clip_region", "clip_ratio/region_mean"),
            ("energy_frequent", "energy/freq_bucket_0"),
        ):
            c.setdefault(name, []).append(per_generation(run, key))
    settings = {k: v for k, v in first["settings"].items() if k not in ("threshold", "ema")}
    summary = {
        "device": first["device"], "model": first["model"], "task": "arithmetic (dfpo_trl.tasks, single-digit a + b)",
        "threshold": threshold, "generations": settings["generations"],
        "methods": methods,
        "ema_alpha": alpha,
        "generations_to_threshold_definition": "1-based index of the first rollout whose EMA of the sampled "
        "reward (e_0 = m_0, e_t = a m_t + (1 - a) e_{t-1}) is >= threshold; null if never",
        "reference": {m: common.METHODS[m].reference for m in methods},
        "settings": settings, "versions": first["versions"],
        "devices": sorted({r["device"] for r in runs}),
    }
    return summary, {"settings": settings, "threshold": threshold, "ema_alpha": alpha, "methods": curves}


def load_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Runs from ``*_runs.json`` files (lists) or single-run files; a later file replaces the same (method, seed)."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        for run in data if isinstance(data, list) else data.get("runs", [data]):
            found[(run["method"], run["seed"])] = run
    return list(found.values())


# ---------------------------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace) -> None:
    """Run every (method, seed) as a subprocess, ``--parallel`` at a time; collect and summarise."""
    methods = common.check_methods(list(args.methods))
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

    queue = [(m, s) for s in args.seeds for m in methods]
    say(
        f"{len(queue)} runs ({len(methods)} methods x seeds {args.seeds}), {args.parallel} in parallel, "
        f"{args.generations} generations each, deadline {args.deadline_s:.0f} s; work dir {work}"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    running: dict[tuple[str, int], tuple[subprocess.Popen, float]] = {}
    durations: list[float] = []
    failed: list[str] = []
    skipped: list[str] = []
    last_report = 0.0

    def run_file(m: str, s: int) -> pathlib.Path:
        return work / "runs" / f"{m}_s{s}.json"

    def collect() -> list[dict[str, Any]]:
        runs = []
        for m, s in [(m, s) for s in args.seeds for m in methods]:
            path = run_file(m, s)
            if path.exists():
                runs.append(json.loads(path.read_text()))
        return runs

    def write_outputs() -> None:
        runs = collect()
        common.write_json(out_dir / f"learning_{tag}_runs.json", runs)
        if runs:
            summary, _ = aggregate(runs, args.threshold, args.ema)
            common.write_json(out_dir / f"learning_{tag}.json", summary)

    while queue or running:
        now = time.time()
        for key, (proc, t0) in list(running.items()):
            if proc.poll() is not None:
                del running[key]
                name = f"{key[0]} seed {key[1]}"
                if proc.returncode == 0:
                    durations.append(now - t0)
                    say(f"done {name} in {now - t0:.0f} s")
                else:
                    failed.append(name)
                    tail = (work / f"{key[0]}_s{key[1]}.log").read_text(errors="replace")[-3000:]
                    say(f"FAILED {name} (exit {proc.returncode}); log tail:\n{tail}")
                write_outputs()
        left = args.deadline_s - (now - start)
        while queue and len(running) < args.parallel:
            expected = max(durations) if durations else 0.0
            if left < EVAL_MARGIN_S + 30 or (durations and left < 0.5 * expected):
                say(f"not starting {len(queue)} queued runs: {left:.0f} s left, a run takes ~{expected:.0f} s")
                skipped.extend(f"{m} seed {s}" for m, s in queue)
                queue.clear()
                break
            m, s = queue.pop(0)
            cmd = [sys.executable, __file__, "--run", "--method", m, "--seed", str(s), "--out", str(run_file(m, s)),
                   "--stop-at", str(start + args.deadline_s - EVAL_MARGIN_S), *child_flags(args)]
            log = (work / f"{m}_s{s}.log").open("w")
            running[(m, s)] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.time())
        if now - last_report >= args.report_every:
            last_report = now
            say(progress(running, queue, durations, args, start))
        if left <= 0:
            for key, (proc, _) in running.items():
                say(f"deadline: terminating {key[0]} seed {key[1]}")
                proc.send_signal(signal.SIGTERM)
            time.sleep(5)
            for proc, _ in running.values():
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
    if runs:
        summary, _ = aggregate(runs, args.threshold, args.ema)
        say("\n" + table(summary))
    log_file.close()
    if failed or not runs:
        raise SystemExit(1)


def progress(running: dict, queue: list, durations: list[float], args: argparse.Namespace, start: float) -> str:
    """One status line: generations done per running run and an ETA from their rates so far."""
    parts, etas = [], []
    for (m, s), (_, t0) in running.items():
        path = pathlib.Path(args.work_dir or "") / "runs" / f"{m}_s{s}.json" if args.work_dir else None
        done = 0
        if path is not None and path.exists():
            try:
                done = json.loads(path.read_text()).get("generations_done", 0)
            except ValueError:
                done = 0
        parts.append(f"{m}/{s}:{done}")
        if done:
            etas.append((time.time() - t0) / done * (args.generations - done) + 20)
    status = f"running {len(running)}, queued {len(queue)}, generations done: {' '.join(parts)}"
    if not etas:
        return status + "; ETA after the first generation"
    waves = -(-len(queue) // max(args.parallel, 1))
    oldest = min(t for _, t in running.values())
    per_run = statistics.fmean(durations) if durations else max(etas) + time.time() - oldest
    eta = max(etas) + waves * per_run
    end = time.time() - start + eta
    return status + f"; ETA ~{eta:.0f} s, {end:.0f} s after start (deadline {args.deadline_s:.0f} s)"


def child_flags(args: argparse.Namespace) -> list[str]:
    """The launcher's settings, passed on to every run."""
    flags = []
    for key in (
        "lr", "num_generations", "steps_per_generation", "batch_size", "max_completion_length", "temperature",
        "beta", "generations", "threshold", "ema", "heldout", "train_size", "dtype", "baseline_trainer",
        "eval_max_new_tokens", "device", "model", "random_config", "tokenizer", "sequence_loss_type",
        "energy_buckets",
    ):
        value = getattr(args, key)
        if value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    flags.append("--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing")
    flags.append("--initial-eval" if args.initial_eval else "--no-initial-eval")
    return flags


def table(summary: dict[str, Any]) -> str:
    """Short per-method table: mean over seeds (None-aware)."""

    def mean(values: list[Any]) -> str:
        v = [x for x in values if x is not None]
        return f"{statistics.fmean(v):.3f}" if v else "-"

    lines = [f"{'method':<20} {'seeds':>5} {'gen->thr':>9} {'reached':>7} {'jitter2':>8} {'acc':>6} {'entropy':>8} "
             f"{'residual':>8} {'asym':>8}"]
    for m, e in summary["methods"].items():
        reached = sum(x is not None for x in e["generations_to_threshold"])
        lines.append(
            f"{m:<20} {len(e['seeds']):>5} {mean(e['generations_to_threshold']):>9} {reached:>4}/{len(e['seeds']):<2} "
            f"{mean(e['jitter2']):>8} {mean(e['final_accuracy']):>6} {mean(e['entropy_final']):>8} "
            f"{mean(e['shared_prefix_residual']):>8} {mean(e['asym_after']):>8}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--launch", action="store_true", help="run every (method, seed) in parallel processes")
    mode.add_argument("--run", action="store_true", help="one (method, seed) run (what --launch starts)")
    mode.add_argument("--aggregate", nargs="+", metavar="RUNS_JSON", help="merge *_runs.json into --out-dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint path (GPU kit: /root/models/smollm2-135m-instruct)")
    src.add_argument("--random-config", choices=common.RANDOM_CONFIGS)
    p.add_argument("--tokenizer")
    p.add_argument("--methods", nargs="+", default=common.LEARNING_METHODS)
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
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="float32",
                   help="master weights (float32 = TRL's default; bf16 autocast on GPU either way)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="TRL's default; keeps 10 parallel runs of SmolLM2 within an 80 GB card")
    p.add_argument("--baseline-trainer", choices=["dfpo", "trl"], default="dfpo")
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument(
        "--sequence-loss-type", choices=["grpo", "dapo", "bnpo", "dr_grpo"], default=None,
        help="loss_type of the sequence-level methods (GSPO and the transforms; default: grpo, as in "
        "docs/reference-runs.md). "
        "A token-sum aggregation (dapo) makes shared tokens cancel whatever the completion lengths (NOTES.md)",
    )
    p.add_argument(
        "--energy-buckets", type=int, default=0,
        help="log eq. 24's energy/freq_bucket_* with this many frequency buckets (DFPOConfig.log_energy_buckets)",
    )
    p.add_argument("--initial-eval", action=argparse.BooleanOptionalAction, default=True)
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
    p.add_argument("--smoke", action="store_true", help="CPU: tiny random model, 2 generations, 2 methods x 1 seed")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.random_config, args.device, args.dtype = None, "tiny", "cpu", "float32"
        args.generations, args.num_generations, args.batch_size, args.steps_per_generation = 2, 4, 8, 2
        args.max_completion_length, args.eval_max_new_tokens, args.lr = 8, 8, 1e-3
        if args.launch:
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
        common.check_methods([args.method])
        run_one(args)
    elif args.launch:
        if args.work_dir is None:
            args.work_dir = tempfile.mkdtemp(prefix="dfpo-learning-")
        launch(args)
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
