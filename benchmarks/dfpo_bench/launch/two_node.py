"""A two-node launch of the Qwen3-32B recipe, scaled down and simulated on ONE 4-GPU host: 2 nodes × 2 GPUs,
DeepSpeed ZeRO-3, the paper-shaped batch (per-device batch 1, G = number of processes).

On the GPU machine (4 GPUs; after ``bash .dev/setup.sh && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks``),
one command:

    python -m dfpo_bench.launch.two_node --out-dir $OUT

which runs, and records in ``$OUT/two_node.json`` (``commands``), exactly:

    python -m dfpo_bench.launch.recipe_smoke recipes/qwen3_32b.yaml --model /root/models/smollm2-135m-instruct \\
        --max-steps 8 --max-completion-length 48 --output-dir /tmp/dfpo-two-node/run \\
        --out $OUT/two_node_recipe.yaml --set num_generations=4 --set gradient_accumulation_steps=4 \\
        --set steps_per_generation=16 --set use_vllm=false --set attn_implementation=sdpa \\
        --set save_strategy=steps --set save_steps=8 --set save_only_model=true --set save_model=false \\
        --set plot=false --set logging_steps=1
    CUDA_VISIBLE_DEVICES=0,1 accelerate launch --config_file recipes/accelerate/zero3_2x2_rank0.yaml \\
        -m dfpo_trl $OUT/two_node_recipe.yaml > $OUT/two_node_node0.log 2>&1 &
    CUDA_VISIBLE_DEVICES=2,3 accelerate launch --config_file recipes/accelerate/zero3_2x2_rank1.yaml \\
        -m dfpo_trl $OUT/two_node_recipe.yaml > $OUT/two_node_node1.log 2>&1 &
    wait

(``accelerate launch`` is run as ``python -m accelerate.commands.launch``, the same program.) The derived recipe
keeps the 32B recipe's objective (Min-Replace, GSPO's ε, sequence level), optimizer, decoding and precision; the
model becomes the kit's SmolLM2-135M-Instruct (no hub), the task the built-in arithmetic one, vLLM is off (it
cannot be installed on the GPU machine: TRL's ``generate`` under ZeRO-3 instead), flash-attention becomes sdpa
(not installed there), and the batch is the recipe's scaled from 32 processes to 4: ``num_generations`` 32 -> 4
(= processes, so micro-step k on process p holds member p of group k in the redistributed layout),
``gradient_accumulation_steps`` 32 -> 4 (one optimizer step = as many prompts as G, as in the recipe),
``steps_per_generation`` 128 -> 16 (4 optimizer steps per rollout, as in the recipe). 8 optimizer steps = 2
rollouts. A checkpoint (model only) at the last step gives ``trainer_state.json`` with the logged losses.

``two_node.json``: ``nodes``, ``processes``, ``layout`` (from the ``DFPO group layout: ...`` line every process
logs), ``steps``, ``loss_finite`` (every logged loss of ``trainer_state.json``), ``wall_s``, ``commands``, and
the return codes, the losses and the log tails.

CPU check (no GPU): ``python -m dfpo_bench.launch.two_node --cpu --out-dir /tmp/two-node-cpu`` runs the same two
launches with both "nodes" on the CPU (``CUDA_VISIBLE_DEVICES=`` for both, ``--mixed_precision no``, a float32 recipe
with ``use_cpu: true``, 4 optimizer steps of 8-token completions, the embedded SmolLM2 when the kit's model is absent),
through accelerate + DeepSpeed (``DS_ACCELERATOR=cpu``) when DeepSpeed is importable, else through
``torchrun --nnodes 2`` without DeepSpeed. ``--dry-run`` only derives the recipe, checks both accelerate configs
and prints the commands.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from typing import Any

from dfpo_bench.lib import common
from dfpo_bench.lib.common import stop_process_group

ROOT = pathlib.Path(__file__).resolve().parents[3]

HERE = pathlib.Path(__file__).resolve()
RECIPE = ROOT / "recipes" / "qwen3_32b.yaml"
CONFIGS = [ROOT / "recipes" / "accelerate" / f"zero3_2x2_rank{rank}.yaml" for rank in (0, 1)]
GPU_MODEL = "/root/models/smollm2-135m-instruct"
NODES, PROCESSES = 2, 4
LAYOUT_LINE = re.compile(r"DFPO group layout: (\S+)")


def derive_command(args: argparse.Namespace, recipe_out: pathlib.Path) -> list[str]:
    sets = {
        "num_generations": PROCESSES, "gradient_accumulation_steps": 4, "steps_per_generation": 16,
        "use_vllm": "false", "attn_implementation": "sdpa", "save_strategy": "steps", "save_steps": args.max_steps,
        "save_only_model": "true", "save_model": "false", "plot": "false", "logging_steps": 1,
    }
    if args.cpu:
        sets.update(use_cpu="true", bf16="false", dtype="float32")
    command = [sys.executable, str(HERE.parent / "recipe_smoke.py"), str(RECIPE), "--model", args.model,
               "--max-steps", str(args.max_steps), "--max-completion-length", str(args.max_completion_length),
               "--output-dir", args.run_dir, "--out", str(recipe_out)]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    return command


def launcher_kind(args: argparse.Namespace) -> str:
    if not args.cpu or importlib.util.find_spec("deepspeed") is not None:
        return "accelerate"
    return "torchrun"


def node_commands(args: argparse.Namespace, recipe: pathlib.Path) -> list[tuple[dict[str, str], list[str]]]:
    """(environment changes, argv) of each node's launch."""
    out = []
    for rank, devices in ((0, "0,1"), (1, "2,3")):
        env = {"CUDA_VISIBLE_DEVICES": "" if args.cpu else devices}
        if launcher_kind(args) == "accelerate":
            command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS[rank])]
            if args.port:
                command += ["--main_process_port", str(args.port)]
            if args.cpu:
                env["DS_ACCELERATOR"] = "cpu"
                command += ["--mixed_precision", "no"]
            command += ["-m", "dfpo_trl", str(recipe)]
        else:  # CPU without DeepSpeed: the same rendezvous through torchrun, gloo
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node_rank",
                       str(rank), "--nproc_per_node", str(PROCESSES // NODES), "--rdzv_backend", "static",
                       "--master_addr", "127.0.0.1", "--master_port", str(args.port or 29531), "-m", "dfpo_trl",
                       str(recipe)]
        if args.cpu:
            env["OMP_NUM_THREADS"] = "1"
        out.append((env, command))
    return out


def shell_line(env: dict[str, str], command: list[str], log: pathlib.Path | None = None) -> str:
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(command)
    return line + (f" > {shlex.quote(str(log))} 2>&1 &" if log else "")


def check_configs() -> list[dict[str, Any]]:
    """Both accelerate configs load (accelerate's own loader) and describe the same 2 × 2 ZeRO-3 job."""
    from accelerate.commands.config.config_args import load_config_from_file

    out = []
    for rank, path in enumerate(CONFIGS):
        config = load_config_from_file(str(path))
        entry = {"file": str(path.relative_to(ROOT)), "machine_rank": config.machine_rank,
                 "num_machines": config.num_machines, "num_processes": config.num_processes,
                 "main_process_ip": config.main_process_ip, "main_process_port": config.main_process_port,
                 "zero_stage": int(config.deepspeed_config["zero_stage"]),
                 "distributed_type": str(getattr(config.distributed_type, "value", config.distributed_type))}
        expected = (rank, NODES, PROCESSES, "127.0.0.1", 3, "DEEPSPEED")
        got = (entry["machine_rank"], entry["num_machines"], entry["num_processes"], entry["main_process_ip"],
               entry["zero_stage"], entry["distributed_type"])
        if got != expected:
            raise SystemExit(f"{path}: expected (machine_rank, machines, processes, ip, zero, type) = {expected}, "
                             f"got {got}")
        out.append(entry)
    if out[0]["main_process_port"] != out[1]["main_process_port"]:
        raise SystemExit("the two node configs name different main_process_port values")
    return out


def losses_of(run_dir: pathlib.Path, logs: list[str]) -> tuple[list[float], str | None, int | None]:
    """The logged losses from the last checkpoint's trainer_state.json (else from rank 0's printed logs)."""
    states = sorted(run_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if states:
        state = json.loads(states[-1].read_text())
        losses = [float(h["loss"]) for h in state.get("log_history", []) if "loss" in h]
        return losses, str(states[-1]), state.get("global_step")
    printed = [float(v) for v in re.findall(r"'loss': '?(-?[0-9.e+-]+|nan|inf)'?", logs[0])]
    return printed, None, None


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "two_node_recipe.yaml"
    env_base = {**os.environ, "PYTHONPATH": common.child_pythonpath()}
    result: dict[str, Any] = {"nodes": NODES, "processes": PROCESSES, "processes_per_node": PROCESSES // NODES,
                              "simulated_on_one_host": True, "cpu": args.cpu, "launcher": launcher_kind(args)}
    result["accelerate_configs"] = check_configs()
    derive = derive_command(args, recipe)
    subprocess.run(derive, check=True, cwd=ROOT, env=env_base)
    result["derived_recipe"] = str(recipe)
    nodes = node_commands(args, recipe)
    logs = [out / f"two_node_node{rank}.log" for rank in range(NODES)]
    launches = [shell_line(env, cmd, log) for (env, cmd), log in zip(nodes, logs, strict=True)]
    result["commands"] = [shlex.join(derive), *launches, "wait"]
    print("\n".join(result["commands"]), flush=True)
    if args.dry_run:
        common_write(out / "two_node.json", result)
        return result
    import shutil

    shutil.rmtree(args.run_dir, ignore_errors=True)
    start = time.time()
    procs = []
    for (env, command), log in zip(nodes, logs, strict=True):
        handle = log.open("w")
        procs.append((subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
                                       env={**env_base, **env}, start_new_session=True), handle))
    codes: list[int | None] = [None] * NODES
    deadline = start + args.timeout_s
    while time.time() < deadline and any(c is None for c in codes):
        time.sleep(2)
        codes = [proc.poll() for proc, _ in procs]
        if any(c not in (None, 0) for c in codes):  # one node failed: the other would wait for it forever
            deadline = min(deadline, time.time() + 30)
    for i, (proc, handle) in enumerate(procs):
        if proc.poll() is None:
            stop_process_group(proc)
            codes[i] = None
            result.setdefault("killed", []).append(i)
        else:
            codes[i] = proc.returncode
        handle.close()
    result["wall_s"] = round(time.time() - start, 1)
    result["returncodes"] = {f"node{rank}": code for rank, code in enumerate(codes)}
    texts = [log.read_text(errors="replace") for log in logs]
    layouts = [m for text in texts for m in LAYOUT_LINE.findall(text)]
    result["layout_lines"] = len(layouts)
    result["layout"] = layouts[0] if layouts and len(set(layouts)) == 1 else (sorted(set(layouts)) or None)
    losses, state_path, global_step = losses_of(pathlib.Path(args.run_dir), texts)
    summary_path = pathlib.Path(args.run_dir) / "dfpo_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result["steps"] = global_step if global_step is not None else summary.get("steps")
    result["max_steps"] = args.max_steps
    result["losses"] = losses
    result["loss_finite"] = bool(losses) and all(v == v and abs(v) != float("inf") for v in losses)
    result["trainer_state"] = state_path
    kept = ("steps", "reward_first", "reward_last", "time_split")
    result["summary"] = {k: summary.get(k) for k in kept} if summary else None
    result["ok"] = (all(c == 0 for c in codes) and result["steps"] == args.max_steps and result["loss_finite"]
                    and result["layout_lines"] == PROCESSES)
    if not result["ok"]:
        result["log_tails"] = {f"node{rank}": text.splitlines()[-30:] for rank, text in enumerate(texts)}
    common_write(out / "two_node.json", result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("log_tails", "accelerate_configs")}, indent=1))
    return result


def common_write(path: pathlib.Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "/tmp/dfpo-two-node-out")
    p.add_argument("--run-dir", default="/tmp/dfpo-two-node/run", help="the recipe's output_dir")
    p.add_argument("--model", default=None, help=f"default: {GPU_MODEL}, or on --cpu the embedded SmolLM2 if absent")
    p.add_argument("--max-steps", type=int, default=None, help="default 8 (2 rollouts); 4 with --cpu")
    p.add_argument("--max-completion-length", type=int, default=None, help="default 48; 8 with --cpu")
    p.add_argument("--port", type=int, default=None, help="override the configs' main_process_port")
    p.add_argument("--timeout-s", type=float, default=480.0)
    p.add_argument("--cpu", action="store_true", help="both nodes on the CPU (pipeline check)")
    p.add_argument("--dry-run", action="store_true", help="derive, check the configs, print the commands")
    args = p.parse_args(argv)
    if args.model is None:
        args.model = GPU_MODEL
        if args.cpu and not os.path.isdir(GPU_MODEL):
            from dfpo_trl.cli import embedded_model_path

            args.model = str(embedded_model_path())
    args.max_steps = args.max_steps or (4 if args.cpu else 8)
    args.max_completion_length = args.max_completion_length or (8 if args.cpu else 48)
    result = run(args)
    return 0 if args.dry_run or result.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
