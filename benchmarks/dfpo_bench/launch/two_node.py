"""A two-node launch of the Qwen3-32B recipe, simulated on ONE 4-GPU host: 2 nodes x 2 GPUs, DeepSpeed ZeRO-3.

The recipe is derived with ``dfpo_bench.launch.recipe_smoke`` (:func:`derive_command`: the kit's SmolLM2, the
arithmetic task, no vLLM, the batch scaled from 32 processes to 4 with G = processes, 4 optimizer steps per rollout,
8 steps), then one ``accelerate launch`` per "node" with ``recipes/accelerate/zero3_2x2_rank{0,1}.yaml``. The
record ``two_node.json`` is ``ok`` when both nodes exit 0 after ``max_steps`` with finite losses and every process
logged its group layout.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

from dfpo_bench.lib import common

ROOT = common.ROOT
RECIPE = ROOT / "recipes" / "qwen3_32b.yaml"
CONFIGS = [ROOT / "recipes" / "accelerate" / f"zero3_2x2_rank{rank}.yaml" for rank in (0, 1)]
NODES, PROCESSES = 2, 4
LAYOUT_LINE = re.compile(r"DFPO group layout: (\S+)")


def derive_command(args: argparse.Namespace, recipe_out: pathlib.Path) -> list[str]:
    sets = {"num_generations": PROCESSES, "gradient_accumulation_steps": 4, "steps_per_generation": 16,
            "use_vllm": "false", "attn_implementation": "sdpa", "save_strategy": "steps", "save_steps": args.max_steps,
            "save_only_model": "true", "save_model": "false", "plot": "false", "logging_steps": 1}
    return [sys.executable, "-m", "dfpo_bench.launch.recipe_smoke", str(RECIPE), "--model", args.model,
            "--max-steps", str(args.max_steps), "--max-completion-length", str(args.max_completion_length),
            "--output-dir", args.run_dir, "--out", str(recipe_out),
            *[part for key, value in sets.items() for part in ("--set", f"{key}={value}")]]


def node_commands(args: argparse.Namespace, recipe: pathlib.Path) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of each node's launch."""
    port = ["--main_process_port", str(args.port)] if args.port else []
    return [({"CUDA_VISIBLE_DEVICES": devices}, [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                                 str(CONFIGS[rank]), *port, "-m", "dfpo_trl", str(recipe)])
            for rank, devices in ((0, "0,1"), (1, "2,3"))]


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
        checked = ("machine_rank", "num_machines", "num_processes", "main_process_ip", "zero_stage", "distributed_type")
        if (got := tuple(entry[k] for k in checked)) != expected:
            raise SystemExit(f"{path}: expected (machine_rank, machines, processes, ip, zero, type) = {expected}, "
                             f"got {got}")
        out.append(entry)
    if out[0]["main_process_port"] != out[1]["main_process_port"]:
        raise SystemExit("the two node configs name different main_process_port values")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "two_node_recipe.yaml"
    env_base = {**os.environ, "PYTHONPATH": common.child_pythonpath()}
    result: dict[str, Any] = {"nodes": NODES, "processes": PROCESSES, "processes_per_node": PROCESSES // NODES,
                              "simulated_on_one_host": True, "accelerate_configs": check_configs()}
    derive = derive_command(args, recipe)
    subprocess.run(derive, check=True, cwd=ROOT, env=env_base)
    nodes, logs = node_commands(args, recipe), [out / f"two_node_node{rank}.log" for rank in range(NODES)]
    launches = [" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + f" {shlex.join(cmd)} > "
                f"{shlex.quote(str(log))} 2>&1 &" for (env, cmd), log in zip(nodes, logs, strict=True)]
    result["commands"] = [shlex.join(derive), *launches, "wait"]
    print("\n".join(result["commands"]), flush=True)
    if args.dry_run:
        common.write_json(out / "two_node.json", result)
        return result
    shutil.rmtree(args.run_dir, ignore_errors=True)
    start = time.time()
    handles = [log.open("w") for log in logs]
    procs = [subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env={**env_base, **env},
                              start_new_session=True) for (env, command), handle in zip(nodes, handles, strict=True)]
    deadline = start + args.timeout_s
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(2)
        if any(p.poll() not in (None, 0) for p in procs):  # one node failed: the other would wait for it forever
            deadline = min(deadline, time.time() + 30)
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            common.stop_process_group(proc)
            result.setdefault("killed", []).append(i)
        handles[i].close()
    codes = [None if i in result.get("killed", []) else proc.returncode for i, proc in enumerate(procs)]
    result["wall_s"] = round(time.time() - start, 1)
    result["returncodes"] = {f"node{rank}": code for rank, code in enumerate(codes)}
    texts = [log.read_text(errors="replace") for log in logs]
    layouts = [m for text in texts for m in LAYOUT_LINE.findall(text)]
    result["layout_lines"] = len(layouts)
    result["layout"] = layouts[0] if layouts and len(set(layouts)) == 1 else (sorted(set(layouts)) or None)
    states = sorted(pathlib.Path(args.run_dir).glob("checkpoint-*/trainer_state.json"),
                    key=lambda p: int(p.parent.name.split("-")[1]))
    state = json.loads(states[-1].read_text()) if states else {}
    losses = [float(h["loss"]) for h in state.get("log_history", []) if "loss" in h]
    summary = common.load_json(pathlib.Path(args.run_dir) / common.SUMMARY_FILE) or {}
    result.update(steps=state.get("global_step", summary.get("steps")), max_steps=args.max_steps, losses=losses,
                  loss_finite=bool(losses) and all(abs(v) < float("inf") for v in losses),
                  trainer_state=str(states[-1]) if states else None,
                  summary={k: summary.get(k) for k in ("steps", "reward_first", "reward_last", "time_split")})
    result["ok"] = (all(c == 0 for c in codes) and result["steps"] == args.max_steps and result["loss_finite"]
                    and result["layout_lines"] == PROCESSES)
    if not result["ok"]:
        result["log_tails"] = {f"node{rank}": text.splitlines()[-30:] for rank, text in enumerate(texts)}
    common.write_json(out / "two_node.json", result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("log_tails", "accelerate_configs")}, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "/tmp/dfpo-two-node-out")
    p.add_argument("--run-dir", default="/tmp/dfpo-two-node/run", help="the recipe's output_dir")
    p.add_argument("--model", default="/root/models/smollm2-135m-instruct")
    p.add_argument("--max-steps", type=int, default=8, help="2 rollouts")
    p.add_argument("--max-completion-length", type=int, default=48)
    p.add_argument("--port", type=int, default=None, help="override the configs' main_process_port")
    p.add_argument("--timeout-s", type=float, default=480.0)
    p.add_argument("--dry-run", action="store_true", help="derive, check the configs, print the commands")
    args = p.parse_args(argv)
    result = run(args)
    return 0 if args.dry_run or result.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
