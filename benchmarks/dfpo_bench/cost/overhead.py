"""Step time and memory of every DFPO method against TRL's GSPO, in one process, in interleaved rounds.

A phase is one method trained from the same weights, prompts and seed by a fresh trainer on a fresh model; a round
runs every method once, in an order rotated each round, so the machine's drift falls on all alike. The goals are
judged on ``median_train_only_step_s`` (steps without a rollout). Writes ``overhead_<tag>.json`` after every round.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import pathlib
import statistics
import tempfile
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PrinterCallback

from dfpo_bench.lib import common, trainers
from dfpo_bench.lib.stats import fmt
from dfpo_bench.lib.timing import StepClock


def run_phase(method: str, args: argparse.Namespace, ctx: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """Train ``method`` from the shared initial weights for ``warmup + steps`` steps; its timed steps and peak. A new
    model per phase (accelerate wraps every model it prepares: rewrapping one would slow later phases), checked on one
    prompt first, so that non-finite weights stop with their names, not a device assert in sampling."""
    model = AutoModelForCausalLM.from_pretrained(ctx["model_path"], dtype=ctx["dtype"]).to(args.device)
    model.generation_config = copy.deepcopy(ctx["generation_config"])
    with torch.no_grad():
        probe = torch.tensor([ctx["probe_ids"]], device=args.device)
        finite = bool(torch.isfinite(model(input_ids=probe).logits).all())
    if not finite:
        bad = [name for name, param in model.named_parameters() if not bool(torch.isfinite(param).all())]
        raise SystemExit(f"the model at {ctx['model_path']} gives non-finite logits; non-finite weights: {bad}")
    trainer_cls, config_cls, overrides = trainers.trainer_and_config(method)
    config = config_cls(**trainers.config_kwargs(
        device=args.device, seed=args.seed, max_steps=warmup + steps, per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
        max_completion_length=args.max_completion_length, learning_rate=args.lr, fixed_length=args.fixed_length,
        gradient_checkpointing=args.gradient_checkpointing, output_dir=ctx["output_dir"]), **overrides)
    trainer = trainer_cls(model=model, reward_funcs=ctx["rewards"], args=config, train_dataset=ctx["dataset"],
                          processing_class=ctx["tokenizer"])
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(clock := StepClock(warmup))
    trainer._generate = clock.timed("generate_s", trainer._generate)
    trainer._generate_and_score_completions = clock.timed("rollout_s", trainer._generate_and_score_completions)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result = {"method": method, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "records": [{"step_s": s["total_s"], "generate_s": s.get("generate_s", 0.0),
                           "rollout_s": s.get("rollout_s", 0.0)} for s in clock.steps]}
    del trainer, model, clock
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def median_ratio_interval(values: list[float], base: list[float], resamples: int = 2000) -> list[float] | None:
    """95% bootstrap interval of median(values) / median(base), resampling the steps of each independently."""
    if len(values) < 2 or len(base) < 2:
        return None
    import numpy as np

    rng = np.random.default_rng(0)
    num = np.median(rng.choice(np.asarray(values), (resamples, len(values))), axis=1)
    den = np.median(rng.choice(np.asarray(base), (resamples, len(base))), axis=1)
    return [float(x) for x in np.percentile(num / den, [2.5, 97.5])]


def summarise(phases: list[dict[str, Any]], methods: list[str], args: argparse.Namespace, ctx: dict[str, Any]):
    """The result file from the phases run so far."""
    per: dict[str, dict[str, Any]] = {}
    for m in methods:
        mine = [p for p in phases if p["method"] == m]
        records = [r for p in mine for r in p["records"]]
        if records:
            peaks = [p["peak_mem_gb"] for p in mine if p["peak_mem_gb"] is not None]
            generation = [r["generate_s"] for r in records if r["generate_s"] > 0]
            per[m] = {"steps": [r["step_s"] for r in records], "phases": len(mine),
                      "training": [r["step_s"] - r["generate_s"] for r in records],
                      "train_only": [r["step_s"] for r in records if r["rollout_s"] == 0],
                      "generation": statistics.median(generation) if generation else None,
                      "peak": max(peaks) if peaks else None}
    base = per.get("gspo")

    def median(m: str, key: str) -> float | None:
        return statistics.median(per[m][key]) if per[m][key] else None

    def ratio(m: str, key: str, of: Any = median) -> float | None:
        return of(m, key) / of("gspo", key) if base and of(m, key) and of("gspo", key) else None

    def interval(m: str, key: str) -> list[float] | None:
        return median_ratio_interval(per[m][key], base[key]) if base else None

    return {
        "device": common.device_name(args.device), "model": ctx["model_name"], "model_params": ctx["params"],
        "dtype": args.dtype, "baseline": "gspo", "steps": min((len(v["steps"]) for v in per.values()), default=0),
        "median_step_s": {m: median(m, "steps") for m in per},
        "ratio_to_baseline": {m: ratio(m, "steps") for m in per},
        "ratio_interval_95": {m: interval(m, "steps") for m in per},
        "median_train_only_step_s": {m: median(m, "train_only") for m in per},
        "ratio_train_only_to_baseline": {m: ratio(m, "train_only") for m in per},
        "ratio_train_only_interval_95": {m: interval(m, "train_only") for m in per},
        "train_only_steps_per_method": {m: len(v["train_only"]) for m, v in per.items()},
        "median_training_s": {m: median(m, "training") for m in per},
        "ratio_mean_training_to_baseline": {m: ratio(m, "training", lambda m, k: statistics.fmean(per[m][k]))
                                            for m in per},
        "median_generation_s": {m: v["generation"] for m, v in per.items()},
        "peak_mem_gb": {m: v["peak"] for m, v in per.items()},
        "settings": {k: getattr(args, k) for k in ("batch_size", "num_generations", "steps_per_generation",
                     "max_completion_length", "lr", "rounds", "steps", "warmup", "fixed_length",
                     "gradient_checkpointing", "seed", "reward")},
        "step_times_s": {m: v["steps"] for m, v in per.items()},
        "versions": common.versions(),
        "complete": all(per.get(m, {}).get("phases", 0) == args.rounds for m in methods)}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['model']} on {result['device']}: {result['steps']} timed steps per method")
    for m, step in result["median_step_s"].items():
        low, high = result["ratio_train_only_interval_95"].get(m) or (None, None)
        print(f"{m:<20} step {fmt(step, 4)} s, x GSPO {fmt(result['ratio_to_baseline'][m])}; no-rollout "
              f"{fmt(result['median_train_only_step_s'][m], 4)} s, x GSPO "
              f"{fmt(result['ratio_train_only_to_baseline'][m])} [{fmt(low)}, {fmt(high)}]; peak "
              f"{fmt(result['peak_mem_gb'][m], 2)} GB")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint path (GPU kit: /root/models/smollm2-135m-instruct)")
    src.add_argument("--random-config", choices=trainers.RANDOM_CONFIGS, help="random init of this size")
    p.add_argument("--tokenizer", help="tokenizer path (default: --model, else the SmolLM2 checkpoint)")
    p.add_argument("--dtype", choices=sorted(trainers.DTYPES), default="bfloat16", help="weights dtype")
    p.add_argument("--methods", nargs="+", default=trainers.OVERHEAD_METHODS, choices=list(trainers.METHODS))
    # --steps: timed optimizer steps per method per round; --batch-size: per_device_train_batch_size
    for name, default in (("rounds", 3), ("steps", 8), ("batch-size", 32), ("num-generations", 16),
                          ("steps-per-generation", 4), ("max-completion-length", 64), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per phase (default: steps/generation)")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--reward", choices=["arithmetic", "id_parity"], help="default: arithmetic for --model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--deadline-s", type=float, default=480.0, help="start no phase that would end after this")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--tag", help="file name tag (default: from the model)")
    p.add_argument("--smoke", action="store_true", help="tiny random model on CPU, 2 timed steps")
    p.add_argument("--merge", nargs="+", help="merge these result files (one object keyed by model) into --out")
    p.add_argument("--out", default="benchmarks/results/overhead.json", help="--merge output")
    args = p.parse_args(argv)
    if args.smoke:
        args.random_config, args.model, args.device, args.dtype = "tiny", None, "cpu", "float32"
        args.rounds, args.steps, args.warmup = 1, 2, 1
        args.batch_size, args.num_generations, args.steps_per_generation, args.max_completion_length = 4, 2, 2, 4
    if not args.model and not args.random_config and not args.merge:
        p.error("give --model PATH or --random-config NAME (or --smoke)")
    if args.steps_per_generation <= 1:
        p.error("--steps-per-generation must be > 1 (off-policy, so the transforms act)")
    args.warmup = args.steps_per_generation if args.warmup is None else args.warmup
    args.reward = args.reward or ("arithmetic" if args.model else "id_parity")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        entries = [json.loads(pathlib.Path(path).read_text()) for path in args.merge]
        merged = {e["model"]: e for data in entries for e in ([data] if "median_step_s" in data else data.values())}
        common.write_json(args.out, merged)
        return print(f"wrote {args.out}: {', '.join(merged)}")
    common.quiet()
    if args.smoke:
        torch.set_num_threads(1)  # a shared CPU: OpenMP spin-waiting under oversubscription is 10-20x slower
    from dfpo_trl.cli import get_task

    methods = ["gspo", *[m for m in args.methods if m != "gspo"]]
    start = time.perf_counter()
    tokenizer = trainers.load_tokenizer(args.tokenizer or args.model or trainers.default_tokenizer_path())
    dtype = trainers.DTYPES[args.dtype]
    scratch = tempfile.mkdtemp(prefix="dfpo-overhead-")  # trainer scratch and the random init, never under --out-dir
    model = trainers.build_model(args.model, args.random_config, tokenizer, dtype, "cpu", args.seed)
    model_path = args.model or str(pathlib.Path(scratch) / "init")
    if not args.model:
        model.save_pretrained(model_path)
    task = get_task("arithmetic")
    ctx: dict[str, Any] = {
        "tokenizer": tokenizer, "dtype": dtype, "model_path": model_path, "output_dir": scratch,
        "generation_config": model.generation_config, "probe_ids": tokenizer("What is 2 + 3?")["input_ids"],
        "params": sum(p.numel() for p in model.parameters()),
        "model_name": pathlib.Path(args.model).name if args.model else f"random-{args.random_config}",
        "rewards": [trainers.id_parity] if args.reward == "id_parity" else list(task.reward_funcs),
        "dataset": task.build_dataset("train", 512, args.seed)}  # the same prompts, in the same order, per phase
    del model
    out = pathlib.Path(args.out_dir) / f"overhead_{args.tag or ctx['model_name']}.json"
    print(f"overhead: {ctx['model_name']} ({ctx['params'] / 1e6:.0f}M params, {args.dtype}) on "
          f"{common.device_name(args.device)}; {', '.join(methods)}; {args.rounds} rounds x {args.steps} timed steps "
          f"after {args.warmup} warm-up steps per phase", flush=True)
    run_phase("gspo", args, ctx, steps=0, warmup=args.warmup)  # untimed: CUDA context, cuBLAS and Triton kernels
    phases: list[dict[str, Any]] = []
    phase_s: list[float] = []
    result: dict[str, Any] = {}
    for r in range(args.rounds):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        # a round starts only if it can end before the deadline, so every method keeps the same number of steps
        if phase_s and time.perf_counter() - start + 1.1 * len(methods) * max(phase_s) > args.deadline_s:
            print(f"deadline: stopping after {r} rounds", flush=True)
            break
        for m in order:
            t0 = time.perf_counter()
            phases.append(run_phase(m, args, ctx, steps=args.steps, warmup=args.warmup))
            phase_s.append(time.perf_counter() - t0)
            print(f"round {r + 1}/{args.rounds} {m:<20} {phase_s[-1]:6.1f} s", flush=True)
        result = summarise(phases, methods, args, ctx)
        common.write_json(out, result)
    result["wall_s"] = time.perf_counter() - start
    common.write_json(out, result)
    print(f"wrote {out}")
    print_table(result)


if __name__ == "__main__":
    main()
