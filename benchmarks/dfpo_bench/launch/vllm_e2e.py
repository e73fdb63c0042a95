"""vLLM end to end: the GPU recipe with vLLM generation, timed, and DFPO off against TRL's GRPOTrainer under vLLM.

    # on the GPU machine, after the kit's setup with vLLM (benchmarks/README.md); ~6 minutes
    python -m dfpo_bench.launch.vllm_e2e --model /root/models/smollm2-135m-instruct --out $OUT/vllm_e2e.json
    # CPU check of the script (a tiny random model, transformers' generate instead of vLLM)
    python -m dfpo_bench.launch.vllm_e2e --smoke --out /tmp/vllm_e2e_smoke.json

Three runs, one after another, each in its own process (each builds its own vLLM engine):

* ``parity_trl`` and ``parity_dfpo_off``: TRL's ``GRPOTrainer`` and ``DFPOTrainer`` with every DFPO option off, built
  from the same keyword arguments (the recipe's GRPOConfig fields, ``--parity-steps`` optimizer steps, same seed);
  their per-step loss, rewards, entropy and gradient norm side by side, and where they first differ;
* ``recipe``: ``recipes/smollm2_gpu_vllm.yaml`` as ``dfpo-train`` runs it (``dfpo_trl.cli.main.run``), with TRL's vLLM
  wrapper timed from outside (start-up, every ``generate``, every weight sync), the sampled-vs-trainer log-prob gap
  and the importance-sampling ratio TRL logs per rollout, and the held-out accuracy before and after.

Writes one JSON (``--out``): versions, the card, and each run's record.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]
from dfpo_bench.lib.common import card, smoke_model, train_in_process  # noqa: E402 - the card and package versions every vLLM result records
from dfpo_bench.lib.common import installed_versions as versions  # noqa: E402
from dfpo_bench.lib.vllm_tools import SAMPLING_KEYS, Timer, grpo_kwargs, instrument_vllm, per_step  # noqa: E402

RECIPE = ROOT / "recipes" / "smollm2_gpu_vllm.yaml"
PARITY_KEYS = ("loss", "reward", "reward_std", "entropy", "grad_norm", "completions/mean_length",
               "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean")
SMOKE_FLAGS = ["--use_vllm", "false", "--use_cpu", "true", "--bf16", "false", "--eval_size", "4",
               "--eval_max_new_tokens", "4", "--eval_batch_size", "4", "--drift_size", "2", "--drift_every", "2",
               "--eval_every", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
               "--max_completion_length", "4", "--train_size", "32", "--log_energy_buckets", "2"]








# ------------------------------------------------------------------------------------------------ children
def child_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe through the CLI's own run, timed."""
    from dfpo_trl.cli import parse_recipe

    timer = Timer()
    vllm = instrument_vllm(timer)
    flags = [str(args.recipe), "--output_dir", args.work, *args.model_flags, *args.extra]
    _, training_args, _ = parse_recipe(flags)  # the resolved vLLM settings the record keeps
    start = time.perf_counter()
    summary = train_in_process(flags, args.work)
    total = time.perf_counter() - start
    heldout = summary.get("heldout") or {}
    drift = summary.get("drift") or {}
    split = summary["time_split"]
    evaluation = sum(float(heldout.get(k) or 0.0) for k in ("before_seconds", "after_seconds", "periodic_seconds"))
    inside_train = (split["training"] + split["eval_before"] + split["eval_after"])
    timed = sum(timer.seconds.get(k, 0.0) for k in ("generation", "weight_sync"))
    return {
        "flags": flags,
        "vllm_instrumented": vllm,
        "steps": summary["steps"],
        "use_vllm": training_args.use_vllm,
        "vllm_mode": training_args.vllm_mode if training_args.use_vllm else None,
        "vllm_importance_sampling_correction": training_args.vllm_importance_sampling_correction,
        "vllm_importance_sampling_mode": training_args.vllm_importance_sampling_mode,
        "vllm_gpu_memory_utilization": training_args.vllm_gpu_memory_utilization,
        "heldout": heldout,
        "drift": drift,
        "method": summary["method"],
        "task": summary["task"],
        "steps_to_threshold": summary.get("steps_to_threshold"),
        "reward_ema_first": summary.get("reward_ema_first"),
        "reward_ema_last": summary.get("reward_ema_last"),
        "sampling": per_step(summary.get("log_history") or [], SAMPLING_KEYS),
        "calls": timer.calls,
        "time_split_s": {
            "total": round(total, 1),
            "model_and_setup_without_vllm": round(split["model_conversion"] + split["setup"]
                                                  - timer.seconds.get("vllm_startup", 0.0), 1),
            "vllm_startup": round(timer.seconds.get("vllm_startup", 0.0), 1),
            "generation": round(timer.seconds.get("generation", 0.0), 1),
            "weight_sync": round(timer.seconds.get("weight_sync", 0.0), 1),
            "heldout_eval": round(evaluation, 1),
            "drift_meter": round(float(drift.get("seconds") or 0.0), 1),
            # the rest of train(): rewards, the old-log-prob forward, loss, backward, optimizer, logging
            "training": round(inside_train - evaluation - float(drift.get("seconds") or 0.0) - timed, 1),
            "save_and_plot": split["save_and_plot"],
        },
    }




def child_parity(args: argparse.Namespace, trainer_name: str) -> dict[str, Any]:
    """GRPOTrainer or DFPOTrainer (every DFPO option off) from the same keyword arguments."""
    import torch
    from dfpo_trl import DFPOConfig, DFPOTrainer
    from dfpo_trl.cli import get_task
    from trl import GRPOConfig, GRPOTrainer

    overrides = json.loads(args.parity_overrides)
    config, values = grpo_kwargs(pathlib.Path(args.recipe), overrides)
    config.update(output_dir=args.work, max_steps=args.parity_steps, save_strategy="no", report_to="none",
                  disable_tqdm=True, model_init_kwargs={"dtype": values.get("dtype", "float32")})
    task = get_task(values.get("task", "arithmetic"))
    train = task.build_dataset("train", values.get("train_size"), config.get("seed", 0))
    rewards = list(task.reward_funcs)
    model = args.model or str(values.get("model_name_or_path") or "")
    if trainer_name == "trl":
        trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=GRPOConfig(**config), train_dataset=train)
    else:
        trainer = DFPOTrainer(model=model, reward_funcs=rewards, args=DFPOConfig(**config), train_dataset=train)
    trainer.train()
    return {
        "trainer": type(trainer).__name__,
        "steps": trainer.state.global_step,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "per_step": per_step(trainer.state.log_history, PARITY_KEYS),
    }


def compare(trl: dict[str, Any], dfpo: dict[str, Any]) -> dict[str, Any]:
    """Per key: the largest |difference| over the steps both logged, and the first step where they differ."""
    out: dict[str, Any] = {}
    for key in PARITY_KEYS:
        a, b = dict(map(tuple, trl["per_step"][key])), dict(map(tuple, dfpo["per_step"][key]))
        steps = sorted(set(a) & set(b))
        if not steps:
            continue
        diffs = [abs(a[s] - b[s]) for s in steps]
        first = next((s for s, d in zip(steps, diffs, strict=True) if d != 0.0), None)
        out[key] = {"steps": len(steps), "max_abs_diff": max(diffs), "first_differing_step": first}
    out["identical"] = all(v["max_abs_diff"] == 0.0 for v in out.values() if isinstance(v, dict))
    return out


# ------------------------------------------------------------------------------------------------ parent
def run_child(args: argparse.Namespace, kind: str, out: pathlib.Path, extra_env: dict[str, str]) -> dict[str, Any]:
    launcher = [sys.executable, __file__]
    if args.via_accelerate:
        launcher = ["accelerate", "launch", "--num_processes", "1", __file__]
    command = [*launcher, "--child", kind, "--child-out", str(out), "--recipe", str(args.recipe),
               "--work", str(out.parent / f"work_{kind}"), "--parity-steps", str(args.parity_steps),
               "--parity-overrides", args.parity_overrides]
    if args.model:
        command += ["--model", args.model]
    command += ["--", *args.extra]
    start = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        code = subprocess.call(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                               env={**os.environ, **extra_env})
    record = json.loads(out.read_text()) if code == 0 and out.exists() else {"log_tail": log.read_text()[-4000:]}
    record.update(exit_code=code, wall_s=round(time.perf_counter() - start, 1))
    print(f"{kind}: exit {code} in {record['wall_s']} s", flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model_name_or_path (default: the recipe's, the embedded model)")
    p.add_argument("--recipe", default=str(RECIPE))
    p.add_argument("--out", default="/tmp/vllm_e2e.json")
    p.add_argument("--parity-steps", type=int, default=16)
    p.add_argument("--parity-overrides", default="{}",
                   help="JSON of GRPOConfig fields for both parity runs, on top of the recipe's")
    p.add_argument("--runs", nargs="+", default=["parity_trl", "parity_dfpo_off", "recipe"])
    p.add_argument("--deterministic", action="store_true",
                   help="also run the parity pair with CUBLAS_WORKSPACE_CONFIG and torch's deterministic algorithms")
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny model, no vLLM")
    p.add_argument("--via-accelerate", action="store_true", help="start each run with `accelerate launch`")
    p.add_argument("--child", choices=["recipe", "trl", "dfpo_off"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/vllm_e2e_work", help=argparse.SUPPRESS)
    p.add_argument("extra", nargs="*", help="further dfpo-train flags after --, for the recipe run")
    args = p.parse_args(argv)
    args.model_flags = ["--model_name_or_path", args.model] if args.model else []
    if args.child:
        if os.environ.get("DFPO_E2E_DETERMINISTIC"):
            import torch

            torch.use_deterministic_algorithms(True)
        record = child_recipe(args) if args.child == "recipe" else child_parity(args, args.child)
        pathlib.Path(args.child_out).write_text(json.dumps(record) + "\n")
        return
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.model = args.model or smoke_model(out.parent)  # writes out.parent/tiny_model
        args.parity_steps = 4
        args.parity_overrides = json.dumps({**json.loads(args.parity_overrides), **SMOKE_PARITY})
        args.extra = [*SMOKE_FLAGS, "--max_steps", "4", *args.extra]
    result: dict[str, Any] = {"card": card(), "versions": versions(), "recipe": str(pathlib.Path(args.recipe).name),
                              "model": args.model, "runs": {}}
    kinds = {"parity_trl": "trl", "parity_dfpo_off": "dfpo_off", "recipe": "recipe"}
    for name in args.runs:
        result["runs"][name] = run_child(args, kinds[name], out.parent / f"{out.stem}_{name}.json", {})
    if args.deterministic:
        env = {"DFPO_E2E_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        for name in ("parity_trl", "parity_dfpo_off"):
            result["runs"][f"{name}_deterministic"] = run_child(
                args, kinds[name], out.parent / f"{out.stem}_{name}_deterministic.json", env
            )
    for suffix in ("", "_deterministic"):
        a, b = result["runs"].get(f"parity_trl{suffix}"), result["runs"].get(f"parity_dfpo_off{suffix}")
        if a and b and "per_step" in a and "per_step" in b:
            result[f"parity{suffix}"] = compare(a, b)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith("parity")}, indent=1))


SMOKE_PARITY = {"use_vllm": False, "use_cpu": True, "bf16": False, "per_device_train_batch_size": 8,
                "num_generations": 4, "max_completion_length": 4, "train_size": 32}


if __name__ == "__main__":
    main()
