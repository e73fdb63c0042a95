"""vLLM server mode on two GPUs (NCCL refuses two ranks on one device): a check that the trained weights reach the
server, and DFPO off against TRL's ``GRPOTrainer`` step by step (commands: benchmarks/README.md).

Per run (``dfpo``: the derived recipe through dfpo-train; ``dfpo_off``: DFPOTrainer, no transform; ``trl``:
``GRPOTrainer``): a fresh server with TRL's own command, training on the other GPU in a child that counts TRL's weight
syncs and ends with one more push (TRL pushes at each rollout's start); after ``dfpo``, the server's log-probabilities
of a fixed completion against the trained model's. Writes ``vllm_server.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
import urllib.request
from typing import Any

import yaml

from dfpo_bench.lib.common import ROOT, stop_process_group, train_in_process, versions

SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # the weight-transfer and cache-reset endpoints live behind it
CHECK_PROMPT = [{"role": "user", "content": "Compute 3 + 5. Give the final answer as: Answer: <number>"}]
CHECK_COMPLETION = "3 + 5 = 8. Answer: 8"
SAMPLING_KEYS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max")
FINAL_SYNCS = {"count": 0}
RUNS = ["dfpo", "dfpo_off", "trl"]


def server_command(args: argparse.Namespace, head: tuple[str, ...] | None = None) -> list[str]:
    """TRL's ``vllm serve`` command for this run's server (a 1k context: the 135M model needs no more), with ``head``
    in place of ``python -m vllm.entrypoints.cli.main serve``; TRL adds ``--enable-scale-out`` where vLLM has it."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    command = build_command(ScriptArguments(
        model=args.model, host="127.0.0.1", port=args.port, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=1024, enforce_eager=args.enforce_eager))
    return [*head, *command[command.index("serve") + 1:]] if head else command


def shell_line(command: list[str], gpus: str) -> str:
    """The command as one shell line with its environment, as the multi-node guide writes it."""
    env = {"CUDA_VISIBLE_DEVICES": gpus, **SERVER_ENV}
    return " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command)


def derived_recipe(model: str, port: int, output_dir: str, steps: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The paper recipe scaled to one GPU and a 135M model (everything else of it kept)."""
    recipe = yaml.safe_load((ROOT / "recipes" / "qwen3_32b.yaml").read_text())
    for key in ("dataset", "dataset_config", "split", "problem_column", "answer_column", "instruction",
                "attn_implementation", "max_prompt_length", "vllm_max_model_length", "activation_checkpointing"):
        recipe.pop(key, None)
    recipe.update(
        model_name_or_path=model, output_dir=output_dir, task="arithmetic", train_size=2000, eval_size=50,
        eval_max_new_tokens=32, skip_eval=False, num_generations=8, per_device_train_batch_size=16,
        gradient_accumulation_steps=2, steps_per_generation=8, max_completion_length=64, max_steps=steps,
        learning_rate=3e-5, lr_scheduler_type="constant", warmup_steps=0, lr_scheduler_kwargs=None,
        gradient_checkpointing=False, dtype="float32", bf16=True, use_vllm=True, vllm_mode="server",
        vllm_server_host="127.0.0.1", vllm_server_port=port, group_transform="min_replace", save_model=True,
        generation_kwargs={"seed": 0},  # so that DFPO off and GRPOTrainer can be compared step by step
        save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True, **overrides,
    )
    return {k: v for k, v in recipe.items() if v is not None}


def start_server(args: argparse.Namespace, log: pathlib.Path) -> tuple[subprocess.Popen, float]:
    """The server on ``args.server_gpu``, up (``/health``), and its start-up seconds; stopped again when it does not
    come up, so that no server outlives a failed start."""
    env = {**os.environ, **SERVER_ENV, "CUDA_VISIBLE_DEVICES": str(args.server_gpu)}
    with open(log, "w") as handle:
        process = subprocess.Popen(server_command(args), env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    start = time.time()
    try:
        while time.time() - start < args.server_timeout:
            if process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {process.returncode} before it was up")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health",
                                                                      timeout=2) as reply:
                if reply.status == 200:
                    return process, time.time() - start
            time.sleep(2)
        raise TimeoutError(f"the vLLM server was not up after {args.server_timeout} s")
    except BaseException:
        stop_process_group(process, grace_s=60)
        raise


def check_tokens(tokenizer_path: str) -> tuple[list[int], int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    prompt = tokenizer.apply_chat_template(CHECK_PROMPT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return prompt_ids + tokenizer(CHECK_COMPLETION, add_special_tokens=False)["input_ids"], len(prompt_ids)


def server_logprobs(port: int, model: str, token_ids: list[int], prompt_tokens: int) -> list[float]:
    """The server's log-probabilities of ``token_ids[prompt_tokens:]`` given what precedes each (temperature 1)."""
    body = json.dumps({"model": model, "prompt": token_ids, "max_tokens": 1, "echo": True, "logprobs": 0,
                       "temperature": 1.0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        values = json.loads(reply.read())["choices"][0]["logprobs"]["token_logprobs"][: len(token_ids)]
    return [float(v) for v in values[prompt_tokens:]]


def model_logprobs(path: str, token_ids: list[int], prompt_tokens: int) -> list[float]:
    """The same log-probabilities from a checkpoint with transformers on this process's GPU (bf16, as served)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([token_ids], device="cuda")
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits.float()[0, :-1], -1)
    return logps.gather(-1, ids[0, 1:, None])[:, 0][prompt_tokens - 1 :].tolist()


def weight_sync_check(
    served_initial: list[float], initial: list[float], served: list[float], trained: list[float], tolerance: float
) -> tuple[bool, dict[str, Any]]:
    """Whether the server holds the trained weights: its log-probabilities match the trained model's within what the
    server and transformers disagree by on the SAME weights (measured before training: bf16 kernels differ most on
    unlikely tokens), and differ from the initial model's by more. Bound = ``tolerance`` + 2 × that floor."""
    def gap(a: list[float], b: list[float]) -> tuple[float, float]:
        diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
        return max(diffs), sum(diffs) / len(diffs)

    (floor, floor_mean), (to_trained, to_trained_mean) = gap(served_initial, initial), gap(served, trained)
    to_initial, to_initial_mean = gap(served, initial)
    bound = tolerance + 2 * floor
    return to_trained <= bound < to_initial, {
        "tokens": len(served), "tolerance": tolerance, "bound": bound,
        "max_abs_diff_same_weights_floor": floor, "mean_abs_diff_same_weights_floor": floor_mean,
        "max_abs_diff_server_vs_trained": to_trained, "mean_abs_diff_server_vs_trained": to_trained_mean,
        "max_abs_diff_server_vs_initial": to_initial, "mean_abs_diff_server_vs_initial": to_initial_mean,
        "max_abs_diff_trained_vs_initial": gap(trained, initial)[0],
        "server_initial": served_initial, "server": served, "trained": trained, "initial": initial,
    }


def install() -> None:
    """Make ``GRPOTrainer.train`` (and so ``DFPOTrainer``'s) end with one ``sync_weights`` in server mode."""
    from trl import GRPOTrainer

    original = GRPOTrainer.train

    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        if self.args.use_vllm and self.args.vllm_mode == "server":
            self.vllm_generation.sync_weights()
            FINAL_SYNCS["count"] += 1
        return output

    GRPOTrainer.train = train


def per_step(log_history: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[list[float]]]:
    """[[step, value], ...] per key, as logged."""
    return {k: [[int(row["step"]), float(row[k])] for row in log_history
                if isinstance(row.get(k), (int, float)) and "step" in row] for k in keys}


def child(args: argparse.Namespace) -> None:
    """Train once (``--child`` KIND on the trainer's GPU), counting and timing TRL's vLLM calls."""
    from trl.generation.vllm_generation import VLLMGeneration

    from dfpo_bench.lib.timing import synchronize

    install()
    calls: dict[str, list[float]] = {}
    for name in ("generate", "sync_weights"):
        original = getattr(VLLMGeneration, name)

        def timed(*a: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                synchronize()
                calls.setdefault(_name, []).append(time.perf_counter() - start)

        setattr(VLLMGeneration, name, timed)
    keys = ("loss", "reward", "reward_std", "entropy", "grad_norm", "step_time", *SAMPLING_KEYS)
    values = yaml.safe_load(pathlib.Path(args.recipe).read_text())
    if args.child == "dfpo":
        summary = train_in_process([args.recipe], values["output_dir"])
        record = {"steps": summary["steps"], "heldout": summary.get("heldout"), "method": summary["method"],
                  "per_step": per_step(summary["log_history"], keys)}
    else:
        from dfpo_trl import DFPOConfig, DFPOTrainer
        from dfpo_trl.cli import get_task
        from trl import GRPOConfig, GRPOTrainer

        config = {k: v for k, v in values.items() if k in GRPOConfig.__dataclass_fields__
                  and GRPOConfig.__dataclass_fields__[k].init}
        config.update(output_dir=values["output_dir"] + f"_{args.child}", model_init_kwargs={"dtype": "float32"})
        task = get_task("arithmetic")
        cls, cfg = (GRPOTrainer, GRPOConfig) if args.child == "trl" else (DFPOTrainer, DFPOConfig)
        trainer = cls(model=args.model, reward_funcs=list(task.reward_funcs), args=cfg(**config),
                      train_dataset=task.build_dataset("train", values.get("train_size"), config.get("seed", 0)))
        trainer.train()
        record = {"steps": trainer.state.global_step, "trainer": cls.__name__,
                  "per_step": per_step(trainer.state.log_history, keys)}
    syncs = calls.get("sync_weights", [])
    record.update(weight_syncs=len(syncs), final_syncs=FINAL_SYNCS["count"], weight_sync_s=round(sum(syncs), 2),
                  generations=len(calls.get("generate", [])))
    pathlib.Path(args.child_out).write_text(json.dumps(record) + "\n")


def step_by_step(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Per logged key, the steps both runs logged and the largest |difference|; ``identical`` when all are equal."""
    out: dict[str, Any] = {}
    for key in sorted(set(ours.get("per_step", {})) & set(theirs.get("per_step", {}))):
        a, b = dict(map(tuple, ours["per_step"][key])), dict(map(tuple, theirs["per_step"][key]))
        if steps := sorted(set(a) & set(b)):
            out[key] = {"steps": len(steps), "max_abs_diff": max(abs(a[s] - b[s]) for s in steps),
                        "first_step_differing": next((s for s in steps if a[s] != b[s]), None)}
    out["identical"] = bool(out) and all(v["max_abs_diff"] == 0 for v in out.values() if isinstance(v, dict))
    return out


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
    p.add_argument("--enforce-eager", action="store_true", help="serve without CUDA-graph capture")
    p.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    p.add_argument("--print-commands", action="store_true",
                   help="print this run's server command line (`vllm serve` and the kit's module form) and exit")
    for name, choices in (("--child", RUNS), ("--recipe", None), ("--child-out", None)):
        p.add_argument(name, choices=choices, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    gpus = str(args.server_gpu)
    if args.print_commands:
        for head in (("vllm", "serve"), ("python3", "-m", "vllm.entrypoints.cli.main", "serve")):
            print(shell_line(server_command(args, head), gpus))
        return
    import torch

    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "cards": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "server_command": shell_line(server_command(args, ("vllm", "serve")), gpus),
        "server_argv": server_command(args), "runs": {}, "versions": versions(),
    }
    token_ids, prompt_tokens = check_tokens(args.model)
    initial = model_logprobs(args.model, token_ids, prompt_tokens)
    for kind in args.runs:
        recipe_path = out / f"recipe_{kind}.yaml"
        recipe_path.write_text(yaml.safe_dump(derived_recipe(args.model, args.port, str(out / f"train_{kind}"),
                                                             args.steps, {} if kind == "dfpo" else
                                                             {"group_transform": "none"}), sort_keys=False))
        server, up_s = start_server(args, out / f"server_{kind}.log")
        try:
            served_initial = server_logprobs(args.port, args.model, token_ids, prompt_tokens)
            run_out, started = out / f"run_{kind}.json", time.time()
            with open(run_out.with_suffix(".log"), "w") as log:
                code = subprocess.call([sys.executable, __file__, "--child", kind, "--recipe", str(recipe_path),
                                        "--child-out", str(run_out), "--model", args.model], cwd=ROOT, stdout=log,
                                       stderr=subprocess.STDOUT,
                                       env={**os.environ, "CUDA_VISIBLE_DEVICES": str(args.trainer_gpu)})
            record = json.loads(run_out.read_text()) if code == 0 and run_out.exists() else {
                "log_tail": run_out.with_suffix(".log").read_text()[-4000:]}
            record.update(exit_code=code, wall_s=round(time.time() - started, 1), server_startup_s=round(up_s, 1))
            if kind == "dfpo" and code == 0:
                served = server_logprobs(args.port, args.model, token_ids, prompt_tokens)
                trained = model_logprobs(str(out / "train_dfpo"), token_ids, prompt_tokens)
                result["weight_sync_check"], result["weight_sync_numbers"] = weight_sync_check(
                    served_initial, initial, served, trained, args.tolerance)
        finally:
            stop_process_group(server, grace_s=60)
        result["runs"][kind] = record
        (out / "vllm_server.json").write_text(json.dumps(result, indent=1) + "\n")
    if {"dfpo_off", "trl"} <= set(args.runs):
        result["dfpo_off_vs_trl"] = step_by_step(result["runs"]["dfpo_off"], result["runs"]["trl"])
    (out / "vllm_server.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)[:3000])


if __name__ == "__main__":
    main()
