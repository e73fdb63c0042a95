"""vLLM server mode on two GPUs: the paper recipe's launch shape, with a check that the weights reach the server.

    # on a machine with 2 GPUs, after the kit's setup with vLLM (benchmarks/README.md); ~8 minutes
    python -m dfpo_bench.launch.vllm_server --model /root/models/smollm2-135m-instruct --out-dir $OUT
    # the server line this run starts, as `vllm serve` and as the kit runs it; no GPU needed
    python -m dfpo_bench.launch.vllm_server --print-commands

TRL 1.16 generates through vLLM's own OpenAI server (``vllm_mode="server"``) and pushes the trainer's weights into it
through vLLM's NCCL weight-transfer engine, so the server must run with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "nccl"}'``, and, for TRL's importance-sampling correction,
``--logprobs-mode processed_logprobs`` (``--max-logprobs -1`` lifts the per-token cap). NCCL refuses two ranks on one
device, so the server and the trainer need a GPU each. The script:

1. derives a small recipe from ``recipes/qwen3_32b.yaml`` (:func:`derived_recipe`: the given model, the built-in
   arithmetic task, G = 8, ``vllm_mode: server``, Min-Replace, ``steps_per_generation`` > accumulation so the
   transform acts off-policy, a few rollouts);
2. starts the server on GPU 1 (:func:`benchmark_server_command`: the flags TRL 1.16's own ``build_command`` writes
   for the same arguments, benchmarks/tests/test_bench_server_command.py; as
   ``python3 -m vllm.entrypoints.cli.main serve``, since the kit has no ``vllm`` console script), waits for
   ``/health``;
3. runs the recipe with ``dfpo_trl``'s own ``run`` on GPU 0, counting and timing TRL's weight syncs; then the same
   recipe with DFPO off and with TRL's ``GRPOTrainer`` (per-step rewards and losses side by side);
4. checks the weight transfer: each run ends with one more weight push (``vllm_tools.install``: TRL pushes at the start
   of each rollout, so the server otherwise holds the weights of the last rollout's start, not the final ones);
   then the server's log-probabilities of a fixed completion (``/v1/completions`` with ``echo``) equal the trained
   model's, computed by transformers on GPU 0 (within bf16 rounding), and differ from the initial model's; the
   server is restarted from the initial weights for each run;
5. stops the server by its process id and writes ``vllm_server.json``, with DFPO off and ``GRPOTrainer`` compared
   step by step (``dfpo_off_vs_trl``).
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

import yaml

from dfpo_bench.lib.common import installed_versions as versions  # every vLLM result records them
from dfpo_bench.lib.vllm_tools import (
    FINAL_SYNCS,
    SAMPLING_KEYS,
    SERVER_ENV,
    Timer,
    check_tokens,
    derived_recipe,
    install,
    instrument_vllm,
    model_logprobs,
    per_step,
    server_command,
    server_logprobs,
    shell_line,
    stop_server,
    vllm_has_scale_out,
    wait_for_health,
    weight_sync_check,
)

ROOT = pathlib.Path(__file__).resolve().parents[3]


def benchmark_server_command(
    args: argparse.Namespace, python: str | None = None, scale_out: bool = False
) -> list[str]:
    """This run's server: one GPU, local only, ``--gpu-memory-utilization`` of the card (half by default), a 1k
    context (the 135M model needs no more)."""
    return server_command(args.model, host="127.0.0.1", port=args.port,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          max_model_len=1024, enforce_eager=args.enforce_eager, scale_out=scale_out, python=python)


def start_server(args: argparse.Namespace, log: pathlib.Path) -> tuple[subprocess.Popen, float]:
    """The server on ``args.server_gpu``, up (``/health``), and its start-up seconds; stopped again when it does not
    come up (or the wait is interrupted), so that no server outlives a failed start."""
    command = benchmark_server_command(args, python=sys.executable, scale_out=vllm_has_scale_out())
    env = {**os.environ, **SERVER_ENV, "CUDA_VISIBLE_DEVICES": str(args.server_gpu)}
    with open(log, "w") as handle:
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process, wait_for_health(args.port, process, args.server_timeout)
    except BaseException:
        stop_server(process)
        raise










def run_training(args: argparse.Namespace, kind: str, recipe_path: pathlib.Path, out: pathlib.Path) -> dict[str, Any]:
    """One training run in its own process on the trainer's GPU (``--child``)."""
    command = [sys.executable, __file__, "--child", kind, "--recipe", str(recipe_path), "--child-out", str(out),
               "--model", args.model]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(args.trainer_gpu)}
    start = time.time()
    with open(out.with_suffix(".log"), "w") as handle:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)
    record = json.loads(out.read_text()) if code == 0 and out.exists() else {
        "log_tail": out.with_suffix(".log").read_text()[-4000:]}
    record.update(exit_code=code, wall_s=round(time.time() - start, 1))
    return record


def child(args: argparse.Namespace) -> None:
    """Train once: ``dfpo`` (the derived recipe as dfpo-train runs it), ``dfpo_off`` or ``trl`` (GRPOTrainer)."""
    install()
    timer = Timer()
    instrument_vllm(timer)
    keys = ("loss", "reward", "reward_std", "entropy", "grad_norm", "step_time", *SAMPLING_KEYS)
    if args.child == "dfpo":
        from dfpo_bench.lib.common import train_in_process

        summary = train_in_process([args.recipe], yaml.safe_load(pathlib.Path(args.recipe).read_text())["output_dir"])
        record = {"steps": summary["steps"], "heldout": summary.get("heldout"), "method": summary["method"],
                  "per_step": per_step(summary["log_history"], keys)}
    else:
        from dfpo_trl import DFPOConfig, DFPOTrainer
        from dfpo_trl.cli import get_task
        from trl import GRPOConfig, GRPOTrainer

        values = yaml.safe_load(pathlib.Path(args.recipe).read_text())
        fields = {f for f in GRPOConfig.__dataclass_fields__ if GRPOConfig.__dataclass_fields__[f].init}
        config = {k: v for k, v in values.items() if k in fields}
        config.update(output_dir=values["output_dir"] + f"_{args.child}", model_init_kwargs={"dtype": "float32"})
        task = get_task("arithmetic")
        rewards = list(task.reward_funcs)
        train = task.build_dataset("train", values.get("train_size"), config.get("seed", 0))
        cls, cfg = (GRPOTrainer, GRPOConfig) if args.child == "trl" else (DFPOTrainer, DFPOConfig)
        trainer = cls(model=args.model, reward_funcs=rewards, args=cfg(**config), train_dataset=train)
        trainer.train()
        record = {"steps": trainer.state.global_step, "trainer": cls.__name__,
                  "per_step": per_step(trainer.state.log_history, keys)}
    record.update(weight_syncs=timer.calls.get("weight_sync", 0), final_syncs=FINAL_SYNCS["count"],
                  weight_sync_s=round(timer.seconds.get("weight_sync", 0.0), 2),
                  generations=timer.calls.get("generation", 0))
    pathlib.Path(args.child_out).write_text(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/root/models/smollm2-135m-instruct")
    p.add_argument("--out-dir", default="/tmp/vllm_server")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--steps", type=int, default=32, help="optimizer steps (4 rollouts of 8 steps by default)")
    p.add_argument("--server-gpu", type=int, default=1)
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="the server's share of its GPU")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="per-token |log-prob| difference allowed on top of twice the same-weights floor")
    p.add_argument("--enforce-eager", action="store_true",
                   help="serve without CUDA-graph capture (a shorter start-up; the weight path is the same)")
    p.add_argument("--runs", nargs="+", default=["dfpo", "dfpo_off", "trl"], choices=["dfpo", "dfpo_off", "trl"])
    p.add_argument("--print-commands", action="store_true",
                   help="print this run's server command line (`vllm serve` and the kit's module form) and exit")
    p.add_argument("--child", choices=["dfpo", "dfpo_off", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return
    if args.print_commands:
        print(shell_line(benchmark_server_command(args), gpus=str(args.server_gpu)))
        print(shell_line(benchmark_server_command(args, python="python3"), gpus=str(args.server_gpu)))
        return
    import torch

    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "cards": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "server_command": shell_line(benchmark_server_command(args, scale_out=vllm_has_scale_out()),
                                     gpus=str(args.server_gpu)),
        "server_argv": benchmark_server_command(args, python=sys.executable, scale_out=vllm_has_scale_out()),
        "runs": {},
    }
    result["versions"] = versions()
    token_ids, prompt_tokens = check_tokens(args.model)
    initial = model_logprobs(args.model, token_ids, prompt_tokens)
    for kind in args.runs:
        recipe = derived_recipe(args.model, args.port, str(out / f"train_{kind}"), args.steps,
                                {} if kind == "dfpo" else {"group_transform": "none"})
        recipe_path = out / f"recipe_{kind}.yaml"
        recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        server, up_s = start_server(args, out / f"server_{kind}.log")
        try:
            served_initial = server_logprobs(args.port, args.model, token_ids, prompt_tokens)
            record = run_training(args, kind, recipe_path, out / f"run_{kind}.json")
            record["server_startup_s"] = round(up_s, 1)
            if kind == "dfpo" and record["exit_code"] == 0:
                served = server_logprobs(args.port, args.model, token_ids, prompt_tokens)
                trained = model_logprobs(str(out / "train_dfpo"), token_ids, prompt_tokens)
                result["weight_sync_check"], result["weight_sync_numbers"] = weight_sync_check(
                    served_initial, initial, served, trained, args.tolerance)
        finally:
            stop_server(server)
        result["runs"][kind] = record
        (out / "vllm_server.json").write_text(json.dumps(result, indent=1) + "\n")
    if {"dfpo_off", "trl"} <= set(args.runs):
        result["dfpo_off_vs_trl"] = step_by_step(result["runs"]["dfpo_off"], result["runs"]["trl"])
    (out / "vllm_server.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)[:3000])




def step_by_step(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Per logged key, the steps both runs logged and the largest |difference| between them; ``identical`` when every
    value is equal."""
    keys = sorted(set(ours.get("per_step", {})) & set(theirs.get("per_step", {})))
    out: dict[str, Any] = {}
    for key in keys:
        a, b = dict(map(tuple, ours["per_step"][key])), dict(map(tuple, theirs["per_step"][key]))
        steps = sorted(set(a) & set(b))
        if steps:
            out[key] = {"steps": len(steps), "max_abs_diff": max(abs(a[s] - b[s]) for s in steps),
                        "first_step_differing": next((s for s in steps if a[s] != b[s]), None)}
    out["identical"] = bool(out) and all(v["max_abs_diff"] == 0 for v in out.values() if isinstance(v, dict))
    return out


if __name__ == "__main__":
    main()
