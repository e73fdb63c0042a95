"""Step-time and memory overhead of every DFPO method against TRL's GSPO, in one process.

    python -m dfpo_bench.cost.overhead --model /root/models/smollm2-135m-instruct --out-dir $OUT
    python -m dfpo_bench.cost.overhead --random-config qwen3-1.7b --rounds 2 --steps 12 --out-dir $OUT
    python -m dfpo_bench.cost.overhead --smoke --out-dir /tmp/overhead-smoke          # CPU, tiny random model
    python -m dfpo_bench.cost.overhead --merge a.json b.json --out benchmarks/results/overhead.json

Design: the same initial weights (kept on the CPU), the same prompts and the same seed for every method. A
*phase* is one method trained from those weights for ``warmup + steps`` optimizer steps by a fresh trainer
on a fresh copy of the model; rounds run every method once, in an order rotated each round, so drift of the
machine (clocks, temperature) falls on every method alike. Off-policy: ``steps_per_generation`` >
gradient accumulation (= 1), so the transforms act. ``--fixed-length`` (default) makes every completion
``max_completion_length`` tokens long, so every method trains on tensors of the same shape.

Per timed optimizer step (callback ``on_step_begin`` → ``on_step_end``, CUDA synchronised) we record the wall
time, the time in TRL's ``_generate`` (sampling) and in ``_generate_and_score_completions`` (sampling,
rewards, old log-probs, DelTA weights). ``median_step_s`` is the median step time (with ``steps_per_generation``
≥ 3 most steps do not sample, so this is the training step); ``median_training_s`` / ``mean_training_s`` are
step time minus sampling time (the mean includes the old-log-prob forward of the rollout steps);
``median_generation_s`` the median sampling call. Peak memory is ``torch.cuda.max_memory_allocated`` of each
phase, max over the method's phases. Writes ``overhead_<tag>.json`` (the fields ``report.py`` reads, plus extra
keys) and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]

import torch  # noqa: E402
from transformers import PrinterCallback  # noqa: E402

from dfpo_bench.lib import common, trainers  # noqa: E402
from dfpo_bench.lib.timing import StepClock  # noqa: E402


def fresh_model(ctx: dict[str, Any], device: str) -> torch.nn.Module:
    """A new model object loaded from the shared initial checkpoint (a new object per phase: accelerate wraps the
    forward of every model it prepares, and wrapping one object again and again would slow later phases).

    Every phase loads with ``from_pretrained`` from ``ctx["model_path"]`` (a random init is saved there once), the
    same path for a pretrained and a random model. A forward on one prompt checks the logits before any timing,
    so a broken model stops with a message naming its non-finite weights, not with a device assert in sampling
    (what the zero pad-row NaN of ``results/NOTES.md`` first looked like).
    """
    import copy

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx["model_path"], dtype=ctx["dtype"]).to(device)
    model.generation_config = copy.deepcopy(ctx["generation_config"])
    probe = torch.tensor([ctx["probe_ids"]], device=device)
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    if not bool(torch.isfinite(logits).all()):
        bad = [name for name, param in model.named_parameters() if not bool(torch.isfinite(param).all())]
        raise SystemExit(f"the model at {ctx['model_path']} gives non-finite logits; non-finite weights: {bad}")
    return model


def run_phase(method: str, args: argparse.Namespace, ctx: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """Train ``method`` from the shared initial weights for ``warmup + steps`` steps; return its timings."""
    device = args.device
    model = fresh_model(ctx, device)
    trainer_cls, config_cls, overrides = trainers.trainer_and_config(method, "trl")
    kwargs = trainers.config_kwargs(
        device=device, seed=args.seed, max_steps=warmup + steps, per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
        max_completion_length=args.max_completion_length, learning_rate=args.lr, fixed_length=args.fixed_length,
        gradient_checkpointing=args.gradient_checkpointing, output_dir=ctx["output_dir"],
    )
    trainer = trainer_cls(
        model=model, reward_funcs=ctx["rewards"], args=config_cls(**kwargs, **overrides),
        train_dataset=ctx["dataset"], processing_class=ctx["tokenizer"],
    )
    trainer.remove_callback(PrinterCallback)
    clock = StepClock(warmup)
    trainer.add_callback(clock)
    trainer._generate = clock.timed("generate_s", trainer._generate)
    trainer._generate_and_score_completions = clock.timed("rollout_s", trainer._generate_and_score_completions)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    result = {
        "method": method,
        "records": [{"step_s": s["total_s"], "generate_s": s.get("generate_s", 0.0),
                     "rollout_s": s.get("rollout_s", 0.0)} for s in clock.steps],
        "peak_mem_gb": peak,
        "reward_mean": statistics.fmean(rewards) if rewards else None,
    }
    del trainer, model, clock
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def median_ratio_interval(values: list[float], base: list[float], resamples: int = 2000) -> list[float] | None:
    """95% bootstrap interval of median(values) / median(base), resampling steps independently."""
    if len(values) < 2 or len(base) < 2:
        return None
    import numpy as np

    rng = np.random.default_rng(0)
    v, b = np.asarray(values), np.asarray(base)
    num = np.median(rng.choice(v, (resamples, v.size)), axis=1)
    den = np.median(rng.choice(b, (resamples, b.size)), axis=1)
    low, high = np.percentile(num / den, [2.5, 97.5])
    return [float(low), float(high)]


def time_positive_orth_proj(device: str, groups: int, group_size: int) -> dict[str, float]:
    """Positive Orth-Proj alone on (groups, G) float32 inputs (bench_transforms' generator)."""
    import torch.utils.benchmark as benchmark
    from dfpo_trl import get_transform

    from dfpo_bench.lib.trainers import make_inputs

    w, adv = make_inputs(groups, group_size, device, torch.float32)
    with torch.no_grad():
        apply = get_transform("positive_orth_proj").apply
        apply(w, adv, 0.5, 1e-6)
        timer = benchmark.Timer(
            stmt="f(w, adv, 0.5, 1e-6)", globals={"f": apply, "w": w, "adv": adv}
        )
        m = timer.blocked_autorange(min_run_time=0.5)
    return {"groups": groups, "G": group_size, "median_ms": m.median * 1e3, "iqr_ms": m.iqr * 1e3}


def summarise(phases: list[dict[str, Any]], methods: list[str], args: argparse.Namespace, ctx: dict[str, Any]):
    """The result ``report.py`` reads (plus extra keys) from the phases run so far."""
    per: dict[str, dict[str, Any]] = {}
    for m in methods:
        mine = [p for p in phases if p["method"] == m]
        records = [r for p in mine for r in p["records"]]
        if not records:
            continue
        steps = [r["step_s"] for r in records]
        training = [r["step_s"] - r["generate_s"] for r in records]
        # Steps without a rollout: forward, backward and optimizer only, where the transforms' cost must not show.
        train_only = [r["step_s"] for r in records if r["rollout_s"] == 0]
        generation = [r["generate_s"] for r in records if r["generate_s"] > 0]
        rollout_extra = [r["rollout_s"] - r["generate_s"] for r in records if r["rollout_s"] > 0]
        peaks = [p["peak_mem_gb"] for p in mine if p["peak_mem_gb"] is not None]
        rewards = [p["reward_mean"] for p in mine if p["reward_mean"] is not None]
        per[m] = {
            "steps": steps, "training": training, "train_only": train_only, "n": len(steps), "phases": len(mine),
            "median_train_only_s": statistics.median(train_only) if train_only else None,
            "median_step_s": statistics.median(steps), "mean_step_s": statistics.fmean(steps),
            "median_training_s": statistics.median(training), "mean_training_s": statistics.fmean(training),
            "median_generation_s": statistics.median(generation) if generation else None,
            "median_rollout_scoring_s": statistics.median(rollout_extra) if rollout_extra else None,
            "peak_mem_gb": max(peaks) if peaks else None,
            "reward_mean": statistics.fmean(rewards) if rewards else None,
        }
    base = per.get("gspo")

    def ratio(m: str, key: str, ref: dict[str, Any] | None) -> float | None:
        return per[m][key] / ref[key] if ref and ref[key] else None

    out: dict[str, Any] = {
        "device": common.device_name(args.device),
        "model": ctx["model_name"],
        "steps": min((v["n"] for v in per.values()), default=0),
        "baseline": "gspo",
        "median_step_s": {m: v["median_step_s"] for m, v in per.items()},
        "peak_mem_gb": {m: v["peak_mem_gb"] for m, v in per.items()},
        "ratio_to_baseline": {m: ratio(m, "median_step_s", base) for m in per},
        "ratio_interval_95": {m: median_ratio_interval(per[m]["steps"], base["steps"]) if base else None for m in per},
        "median_training_s": {m: v["median_training_s"] for m, v in per.items()},
        "median_train_only_step_s": {m: v["median_train_only_s"] for m, v in per.items()},
        "ratio_train_only_to_baseline": {m: ratio(m, "median_train_only_s", base) for m in per},
        "ratio_train_only_interval_95": {
            m: median_ratio_interval(per[m]["train_only"], base["train_only"]) if base else None for m in per
        },
        "train_only_steps_per_method": {m: len(v["train_only"]) for m, v in per.items()},
        "mean_training_s": {m: v["mean_training_s"] for m, v in per.items()},
        "mean_step_s": {m: v["mean_step_s"] for m, v in per.items()},
        "median_generation_s": {m: v["median_generation_s"] for m, v in per.items()},
        "median_rollout_scoring_s": {m: v["median_rollout_scoring_s"] for m, v in per.items()},
        "ratio_mean_training_to_baseline": {m: ratio(m, "mean_training_s", base) for m in per},
        "reference": {m: trainers.METHODS[m].reference for m in per},
        "ratio_to_reference": {
            m: ratio(m, "median_step_s", per.get(trainers.METHODS[m].reference or "")) for m in per
        },
        "steps_per_method": {m: v["n"] for m, v in per.items()},
        "mean_sampled_reward": {m: v["reward_mean"] for m, v in per.items()},
        "model_params": ctx["params"],
        "dtype": str(ctx["dtype"]).replace("torch.", ""),
        "settings": {
            k: getattr(args, k)
            for k in (
                "batch_size", "num_generations", "steps_per_generation", "max_completion_length", "lr", "rounds",
                "steps", "warmup", "fixed_length", "gradient_checkpointing", "seed", "reward",
            )
        },
        "step_times_s": {m: v["steps"] for m, v in per.items()},
        "versions": common.versions(),
        "complete": all(per.get(m, {}).get("phases", 0) == args.rounds for m in methods),
    }
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['model']} on {result['device']}: {result['steps']} timed steps per method")
    print(
        f"{'method':<20} {'step s':>8} {'ratio':>6} {'95% CI':>15} {'no-rollout s':>12} {'ratio':>6} {'95% CI':>15} "
        f"{'gen s':>7} {'peak GB':>8}"
    )
    for m, step in result["median_step_s"].items():
        ci = result["ratio_interval_95"].get(m)
        ci_text = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"
        gen = result["median_generation_s"].get(m)
        peak = result["peak_mem_gb"].get(m)
        ratio = result["ratio_to_baseline"].get(m)
        train = result.get("median_train_only_step_s", {}).get(m)
        train_ratio = result.get("ratio_train_only_to_baseline", {}).get(m)
        train_ci = result.get("ratio_train_only_interval_95", {}).get(m)
        train_ci_text = f"[{train_ci[0]:.3f}, {train_ci[1]:.3f}]" if train_ci else "-"
        nan = float("nan")
        print(
            f"{m:<20} {step:8.4f} {ratio if ratio is not None else nan:6.3f} {ci_text:>15} "
            f"{train if train is not None else nan:12.4f} {train_ratio if train_ratio is not None else nan:6.3f} "
            f"{train_ci_text:>15} {gen if gen is not None else nan:7.3f} {peak if peak is not None else nan:8.2f}"
        )
    pop = result.get("positive_orth_proj_alone")
    if pop:
        print(f"positive_orth_proj alone, {pop['groups']} groups x G={pop['G']}: {pop['median_ms']:.4f} ms (median)")


def merge(paths: list[str], out: str) -> None:
    """Combine per-model result files into one JSON object keyed by model (each value as one model's result)."""
    import json

    merged: dict[str, Any] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        entries = [data] if "median_step_s" in data else list(data.values())
        for entry in entries:
            merged[entry["model"]] = entry
    common.write_json(out, merged)
    print(f"wrote {out}: {', '.join(merged)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint path (GPU kit: /root/models/smollm2-135m-instruct)")
    src.add_argument("--random-config", choices=trainers.RANDOM_CONFIGS, help="random init of this size")
    p.add_argument("--tokenizer", help="tokenizer path (default: --model, else the SmolLM2 checkpoint)")
    p.add_argument("--dtype", choices=sorted(trainers.DTYPES), default="bfloat16", help="weights dtype")
    p.add_argument("--methods", nargs="+", default=trainers.OVERHEAD_METHODS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per method per round")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per phase (default: steps/generation)")
    p.add_argument("--batch-size", type=int, default=32, help="per_device_train_batch_size (completions)")
    p.add_argument("--num-generations", type=int, default=16)
    p.add_argument("--steps-per-generation", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--reward", choices=["arithmetic", "id_parity"], help="default: arithmetic for --model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pop-groups", type=int, default=10_000, help="Positive Orth-Proj alone: groups")
    p.add_argument("--pop-G", type=int, default=32, dest="pop_group_size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--deadline-s", type=float, default=480.0, help="start no phase that would end after this")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--tag", help="file name tag (default: from the model)")
    p.add_argument("--smoke", action="store_true", help="tiny random model on CPU, 2 timed steps")
    p.add_argument("--merge", nargs="+", help="merge these result files into --out and exit")
    p.add_argument("--out", default="benchmarks/results/overhead.json", help="--merge output")
    args = p.parse_args(argv)
    if args.smoke:
        args.random_config, args.model, args.device, args.dtype = "tiny", None, "cpu", "float32"
        args.rounds, args.steps, args.warmup = 1, 2, 1
        args.batch_size, args.num_generations, args.steps_per_generation = 4, 2, 2
        args.max_completion_length, args.pop_groups = 4, 1000
    if not args.model and not args.random_config and not args.merge:
        p.error("give --model PATH or --random-config NAME (or --smoke)")
    args.warmup = args.steps_per_generation if args.warmup is None else args.warmup
    args.reward = args.reward or ("arithmetic" if args.model else "id_parity")
    if args.steps_per_generation <= 1:
        p.error("--steps-per-generation must be > 1 (off-policy, so the transforms act)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return
    common.quiet()
    if args.smoke:
        torch.set_num_threads(1)  # a shared CPU: OpenMP spin-waiting under oversubscription is 10-20x slower
    methods = trainers.check_methods(list(args.methods))
    if "gspo" not in methods:
        methods.insert(0, "gspo")
    start = time.perf_counter()
    tokenizer = trainers.load_tokenizer(args.tokenizer or args.model or trainers.default_tokenizer_path())
    dtype = trainers.DTYPES[args.dtype]
    scratch = tempfile.mkdtemp(prefix="dfpo-overhead-")  # trainer scratch and the random init, never under --out-dir
    # A random init is built once (on the CPU, seeded) and saved, so every phase loads the same checkpoint.
    model = trainers.build_model(args.model, args.random_config, tokenizer, dtype, "cpu", args.seed)
    model_path = args.model
    if not model_path:
        model_path = str(pathlib.Path(scratch) / "init")
        model.save_pretrained(model_path)
    ctx: dict[str, Any] = {
        "tokenizer": tokenizer, "dtype": dtype, "model_path": model_path,
        "generation_config": model.generation_config,
        "probe_ids": tokenizer("What is 2 + 3?")["input_ids"],
        "params": sum(p.numel() for p in model.parameters()),
        "model_name": pathlib.Path(args.model).name if args.model else f"random-{args.random_config}",
        "output_dir": scratch,
    }
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    task, ctx["rewards"] = trainers.task_and_rewards(args.reward)
    ctx["dataset"] = task.build_dataset("train", 512, args.seed)  # the same prompts, in the same order, per phase
    tag = args.tag or ctx["model_name"]
    out = pathlib.Path(args.out_dir) / f"overhead_{tag}.json"
    print(
        f"overhead: {ctx['model_name']} ({ctx['params'] / 1e6:.0f}M params, {args.dtype}) on "
        f"{common.device_name(args.device)}; methods {', '.join(methods)}; {args.rounds} rounds x {args.steps} "
        f"timed steps after {args.warmup} warm-up steps per phase",
        flush=True,
    )

    # One untimed phase first: CUDA context, cuBLAS and Triton kernels compile outside every measurement.
    t0 = time.perf_counter()
    run_phase("gspo", args, ctx, steps=0, warmup=args.warmup)
    print(f"warm-up phase: {time.perf_counter() - t0:.1f} s", flush=True)
    phases: list[dict[str, Any]] = []
    phase_times: list[float] = []
    result: dict[str, Any] = {}
    stopped = False
    round_times: list[float] = []
    for r in range(args.rounds):
        elapsed = time.perf_counter() - start
        if round_times and elapsed + 1.1 * max(round_times) > args.deadline_s:
            # Stop at a round boundary, so every method keeps the same number of timed steps.
            print(f"deadline: {elapsed:.0f} s elapsed, a round takes ~{max(round_times):.0f} s; stopping after "
                  f"{r} rounds", flush=True)
            break
        round_start = time.perf_counter()
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for m in order:
            elapsed = time.perf_counter() - start
            estimate = max(phase_times) if phase_times else 0.0
            if elapsed + 1.2 * estimate > args.deadline_s:
                print(f"deadline: stopping before {m} in round {r + 1} ({elapsed:.0f} s elapsed)", flush=True)
                stopped = True
                break
            t0 = time.perf_counter()
            phases.append(run_phase(m, args, ctx, steps=args.steps, warmup=args.warmup))
            phase_times.append(time.perf_counter() - t0)
            left = (args.rounds * len(methods) - len(phases)) * statistics.fmean(phase_times)
            print(
                f"round {r + 1}/{args.rounds} {m:<20} {phase_times[-1]:6.1f} s   "
                f"median step {statistics.median(x['step_s'] for x in phases[-1]['records']):.4f} s   "
                f"ETA {left:5.0f} s",
                flush=True,
            )
        round_times.append(time.perf_counter() - round_start)
        result = summarise(phases, methods, args, ctx)
        common.write_json(out, result)
        if stopped:
            break
    result["positive_orth_proj_alone"] = time_positive_orth_proj(args.device, args.pop_groups, args.pop_group_size)
    result["wall_s"] = time.perf_counter() - start
    common.write_json(out, result)
    print(f"wrote {out}")
    print_table(result)


if __name__ == "__main__":
    main()
