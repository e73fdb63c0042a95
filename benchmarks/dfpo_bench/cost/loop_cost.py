"""Whole-loop cost with vLLM colocated: each DFPO transform's optimizer-step time against TRL's GRPOTrainer.

One worker per GPU builds ONE vLLM engine and reuses it for every run (:func:`share_one_engine`; each run pushes its
own initial weights first). A run's time is the mean step after the first rollout; a round runs every method once in
a shuffled order, and the within-round ratio to ``GRPOTrainer`` is bootstrapped over all rounds of all workers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
from typing import Any

import yaml

from dfpo_bench.lib.common import ROOT, versions
from dfpo_bench.lib.stats import bootstrap_median

RECIPE = ROOT / "recipes" / "smollm2_gpu_vllm.yaml"
METHODS = {  # name -> DFPOConfig fields on top of the recipe (None: TRL's GRPOTrainer)
    "trl": None,
    "dfpo_off": {"group_transform": "none"},
    "min_replace": {"group_transform": "min_replace"},
    "orth_proj": {"group_transform": "orth_proj"},
    "positive_orth_proj": {"group_transform": "positive_orth_proj"},
    "truncate_rebalance": {"group_transform": "truncate_rebalance"},
    "min_replace_gradient": {"group_transform": "min_replace", "cancellation_target": "gradient"}}


def share_one_engine() -> None:
    """Every ``vllm.LLM`` TRL builds in this process after the first is the first (same model, same settings)."""
    import trl.generation.vllm_generation as generation

    first: dict[str, Any] = {}
    build = generation.LLM

    def shared(*args: Any, **kwargs: Any) -> Any:
        if "engine" not in first:
            first["engine"] = build(*args, **kwargs)
        return first["engine"]

    generation.LLM = shared


def one_run(method: str, model: str, steps: int, seed: int) -> dict[str, Any]:
    import torch
    from dfpo_trl import DFPOConfig, DFPOTrainer
    from dfpo_trl.cli import get_task
    from trl import GRPOConfig, GRPOTrainer

    from dfpo_bench.lib.timing import StepClock

    extra = METHODS[method]
    fields = {f for f, spec in GRPOConfig.__dataclass_fields__.items() if spec.init}
    config = {k: v for k, v in yaml.safe_load(RECIPE.read_text()).items() if k in fields}
    config.update(output_dir=f"/tmp/loop_cost/{method}", max_steps=steps, save_strategy="no", report_to="none",
                  disable_tqdm=True, logging_steps=1, seed=seed, model_init_kwargs={"dtype": "float32"})
    task = get_task("arithmetic")
    train = task.build_dataset("train", 2000, seed)
    rewards = list(task.reward_funcs)
    clock = StepClock()
    trainer_cls, config_cls = (GRPOTrainer, GRPOConfig) if extra is None else (DFPOTrainer, DFPOConfig)
    trainer = trainer_cls(model=model, reward_funcs=rewards, args=config_cls(**config, **(extra or {})),
                          train_dataset=train, callbacks=[clock])
    trainer.vllm_generation.sync_weights()  # the shared engine holds the last run's weights: load this run's
    trainer.train()
    times = [s["total_s"] for s in clock.steps]
    measured = times[config["steps_per_generation"]:]  # after the first rollout
    phi = [h["transform/phi_mean"] for h in trainer.state.log_history if "transform/phi_mean" in h]
    record = {"method": method, "trainer": type(trainer).__name__, "step_s": times,
              "mean_step_s": statistics.fmean(measured), "phi_mean": statistics.fmean(phi) if phi else None}
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return record


def worker(args: argparse.Namespace) -> None:
    share_one_engine()
    rng = random.Random(args.seed)
    rounds = []
    for r in range(args.rounds):
        order = list(args.methods)
        rng.shuffle(order)
        runs = {m: one_run(m, args.model, args.steps, seed=r) for m in order}
        rounds.append({"order": order, "runs": runs})
        pathlib.Path(args.worker_out).write_text(json.dumps(rounds) + "\n")
        print(f"round {r}: " + ", ".join(f"{m} {runs[m]['mean_step_s']:.3f}s" for m in order), flush=True)


def summarise(rounds: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method in methods:
        if method == "trl":
            continue
        ratios = [r["runs"][method]["mean_step_s"] / r["runs"]["trl"]["mean_step_s"] for r in rounds]
        out[method] = {"rounds": len(ratios), "median_ratio_to_trl": statistics.median(ratios),
                       "interval_95": bootstrap_median(ratios), "ratios": ratios}
    out["trl_median_step_s"] = statistics.median(r["runs"]["trl"]["mean_step_s"] for r in rounds)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/root/models/smollm2-135m-instruct")
    p.add_argument("--gpus", nargs="+", default=["0"])
    for name, default in (("rounds", 4), ("steps", 12), ("seed", 0)):  # --steps: per run, the first rollout untimed
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", default="/tmp/loop_cost.json")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    if "trl" not in args.methods:
        p.error("--methods must include trl, the baseline of every ratio")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    children = []
    for i, gpu in enumerate(args.gpus):
        part = out.with_name(f"{out.stem}_gpu{gpu}.json")
        command = [sys.executable, __file__, "--worker-out", str(part), "--model", args.model, "--rounds",
                   str(args.rounds), "--steps", str(args.steps), "--seed", str(args.seed + i), "--methods",
                   *args.methods]
        log = open(out.with_name(f"{out.stem}_gpu{gpu}.log"), "w")  # noqa: SIM115 - closed with the child
        children.append((gpu, part, log, subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                          env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})))
    rounds, cards = [], {}
    for gpu, part, log, child in children:
        child.wait()
        log.close()
        if part.exists():
            rounds += json.loads(part.read_text())
        cards[gpu] = subprocess.run(["nvidia-smi", "-i", gpu, "--query-gpu=name", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
    result = {"cards": cards, "versions": versions(), "recipe": RECIPE.name, "model": args.model,
              "steps_per_run": args.steps, "methods": args.methods, "rounds": rounds,
              "command": "python -m dfpo_bench.cost.loop_cost " + " ".join(argv if argv is not None else sys.argv[1:])}
    complete = [r for r in rounds if set(r["runs"]) == set(args.methods)]
    if complete:
        result["summary"] = summarise(complete, args.methods)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("summary", {}), indent=1))


if __name__ == "__main__":
    main()
