"""What the vLLM scripts share: the vLLM server command as TRL 1.16 starts it, its health, stop and
log-probabilities, the recipe derived from the paper's for a server run, the weight-sync check (the server against
the saved model), one more weight push when training ends, and the timing of TRL's vLLM wrapper part by part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shlex
import signal
import subprocess
import time
import urllib.request
from typing import Any

import yaml

from dfpo_bench.lib.common import ROOT

PAPER_RECIPE = ROOT / "recipes" / "qwen3_32b.yaml"


SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # the weight-transfer and cache-reset endpoints live behind it


# The flags TRL's server mode needs (weights in over NCCL; log-probs after temperature for the IS correction).
TRL_SERVER_FLAGS = ("--weight-transfer-config", json.dumps({"backend": "nccl"}), "--logprobs-mode",
                    "processed_logprobs", "--max-logprobs", "-1")


# vLLM's module entry point, for a kit that has vLLM installed but no ``vllm`` console script (TRL starts it so too).
VLLM_MODULE = ("-m", "vllm.entrypoints.cli.main")


SCALE_OUT_VLLM = "0.30.0"  # TRL adds --enable-scale-out from this vLLM on (multimodal prompts only)


CHECK_PROMPT = [{"role": "user", "content": "Compute 3 + 5. Give the final answer as: Answer: <number>"}]


CHECK_COMPLETION = "3 + 5 = 8. Answer: 8"


def server_command(
    model: str, *, host: str = "0.0.0.0", port: int = 8000, tensor_parallel_size: int = 1,
    data_parallel_size: int = 1, gpu_memory_utilization: float = 0.9, dtype: str = "auto",
    kv_cache_dtype: str = "auto", vllm_model_impl: str = "vllm", log_level: str = "info",
    revision: str | None = None, max_model_len: int | None = None, enable_prefix_caching: bool | None = None,
    enforce_eager: bool | None = False, trust_remote_code: bool = False,
    distributed_executor_backend: str | None = None, speculative_config: str | None = None,
    scale_out: bool = False, python: str | None = None,
) -> list[str]:
    """``vllm serve`` as TRL 1.16's ``trl.scripts.vllm_serve.build_command`` writes it for the same arguments.

    The keywords are TRL's ``ScriptArguments`` fields, so that benchmarks/tests/test_bench_server_command.py can hold
    the two builders equal; ``scale_out`` stands for TRL's "vLLM >= 0.30 installed" check (pass
    :func:`vllm_has_scale_out` where vLLM runs), off by default so that a printed line works on every vLLM TRL 1.16
    supports. With ``python`` the head is ``python -m vllm.entrypoints.cli.main serve`` (a kit without the console
    script); run the command with :data:`SERVER_ENV`.
    """
    head = [python, *VLLM_MODULE, "serve"] if python else ["vllm", "serve"]
    command = [*head, model, "--host", host, "--port", str(port), "--tensor-parallel-size",
               str(tensor_parallel_size), "--data-parallel-size", str(data_parallel_size),
               "--gpu-memory-utilization", str(gpu_memory_utilization), "--dtype", dtype, "--kv-cache-dtype",
               kv_cache_dtype, "--model-impl", vllm_model_impl, "--uvicorn-log-level", log_level]
    if revision is not None:
        command += ["--revision", revision]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if enable_prefix_caching is not None:
        command += ["--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching"]
    if enforce_eager:
        command += ["--enforce-eager"]
    if trust_remote_code:
        command += ["--trust-remote-code"]
    if distributed_executor_backend is not None:
        command += ["--distributed-executor-backend", distributed_executor_backend]
    if speculative_config is not None:
        command += ["--speculative-config", speculative_config]
    if scale_out:
        command += ["--enable-scale-out"]
    return command + list(TRL_SERVER_FLAGS)


def vllm_has_scale_out() -> bool:
    """Whether the installed vLLM takes ``--enable-scale-out`` (TRL's own test: version >= 0.30.0)."""
    import importlib.metadata as md

    from packaging.version import Version

    try:
        return Version(md.version("vllm")) >= Version(SCALE_OUT_VLLM)
    except md.PackageNotFoundError:
        return False


def shell_line(command: list[str], gpus: str | None = None) -> str:
    """The command as one shell line with its environment (``CUDA_VISIBLE_DEVICES`` first when ``gpus`` is given),
    as the multi-node guide (docs/source/guides/multinode.md) and the recipe headers write it."""
    env = ({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {}) | SERVER_ENV
    return " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command)


def derived_recipe(model: str, port: int, output_dir: str, steps: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The paper recipe scaled to one GPU and a 135M model (everything else of it kept)."""
    recipe = yaml.safe_load(PAPER_RECIPE.read_text())
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
        # vLLM samples with a per-request seed, so that DFPO off and GRPOTrainer can be compared step by step
        generation_kwargs={"seed": 0},
        save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True,
    )
    recipe.update(overrides)
    return {k: v for k, v in recipe.items() if v is not None}


def wait_for_health(port: int, process: subprocess.Popen, timeout: float) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {process.returncode} before it was up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return time.time() - start
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the vLLM server was not up after {timeout} s")


def stop_server(process: subprocess.Popen) -> None:
    """Stop the server's whole process group by its id (vLLM's API server has engine children); a group already
    gone (a server that died, or was killed by a fault test) is no error."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except ProcessLookupError:
        process.poll()
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def server_logprobs(port: int, model: str, token_ids: list[int], prompt_tokens: int) -> list[float]:
    """The server's log-probabilities of ``token_ids[prompt_tokens:]`` given what precedes each (temperature 1)."""
    body = json.dumps({"model": model, "prompt": token_ids, "max_tokens": 1, "echo": True, "logprobs": 0,
                       "temperature": 1.0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        choice = json.loads(reply.read())["choices"][0]
    values = choice["logprobs"]["token_logprobs"][: len(token_ids)]
    return [float(v) for v in values[prompt_tokens:]]


def model_logprobs(path: str, token_ids: list[int], prompt_tokens: int) -> list[float]:
    """The same log-probabilities from a checkpoint with transformers on this process's GPU (bf16, as served)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([token_ids], device="cuda")
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits.float()[0, :-1], -1)
    picked = logps.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[prompt_tokens - 1 :].tolist()


def check_tokens(tokenizer_path: str) -> tuple[list[int], int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    prompt = tokenizer.apply_chat_template(CHECK_PROMPT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(CHECK_COMPLETION, add_special_tokens=False)["input_ids"]
    return prompt_ids + completion_ids, len(prompt_ids)


def weight_sync_check(
    served_initial: list[float], initial: list[float], served: list[float], trained: list[float], tolerance: float
) -> tuple[bool, dict[str, Any]]:
    """Whether the server holds the trained weights: its log-probabilities match the trained model's within what the
    server and transformers disagree by on the SAME weights (measured before training, on the initial weights: bf16
    kernels differ most on unlikely tokens, 0.2 nats at log p = -6.9 in one run), and differ from the initial model's
    by more than that. Bound = ``tolerance`` + 2 × that floor."""
    def gap(a: list[float], b: list[float]) -> tuple[float, float]:
        diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
        return max(diffs), sum(diffs) / len(diffs)

    floor, floor_mean = gap(served_initial, initial)
    bound = tolerance + 2 * floor
    to_trained, to_trained_mean = gap(served, trained)
    to_initial, to_initial_mean = gap(served, initial)
    return to_trained <= bound < to_initial, {
        "tokens": len(served), "tolerance": tolerance, "bound": bound,
        "max_abs_diff_same_weights_floor": floor, "mean_abs_diff_same_weights_floor": floor_mean,
        "max_abs_diff_server_vs_trained": to_trained, "mean_abs_diff_server_vs_trained": to_trained_mean,
        "max_abs_diff_server_vs_initial": to_initial, "mean_abs_diff_server_vs_initial": to_initial_mean,
        "max_abs_diff_trained_vs_initial": gap(trained, initial)[0],
        "server_initial": served_initial, "server": served, "trained": trained, "initial": initial,
    }


SAMPLING_KEYS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max")


class Timer:
    """Wall time of every call of a wrapped method (CUDA synchronised at the end when a GPU is present)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            import torch

            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, timed)


def instrument_vllm(timer: Timer) -> bool:
    """Time TRL's vLLM wrapper: start-up (its constructor builds the engine), generate, weight sync."""
    try:
        from trl.generation.vllm_generation import VLLMGeneration
    except ImportError:
        return False
    timer.wrap(VLLMGeneration, "__init__", "vllm_startup")
    timer.wrap(VLLMGeneration, "generate", "generation")
    timer.wrap(VLLMGeneration, "sync_weights", "weight_sync")
    return True


def per_step(log_history: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[list[float]]]:
    """[[step, value], ...] per key, as logged."""
    out: dict[str, list[list[float]]] = {k: [] for k in keys}
    for row in log_history:
        for k in keys:
            if isinstance(row.get(k), (int, float)) and "step" in row:
                out[k].append([int(row["step"]), float(row[k])])
    return out


def grpo_kwargs(recipe: pathlib.Path, extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(GRPOConfig keyword arguments, script-argument values) from the recipe's YAML and ``extra``."""
    import yaml
    from trl import GRPOConfig

    values = {**yaml.safe_load(recipe.read_text()), **extra}
    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    config = {k: v for k, v in values.items() if k in grpo_fields}
    return config, values


FINAL_SYNCS = {"count": 0}


def install() -> None:
    """Make ``GRPOTrainer.train`` (and so ``DFPOTrainer``'s) end with one ``sync_weights`` in server mode."""
    from trl import GRPOTrainer

    original = GRPOTrainer.train
    if getattr(original, "_final_sync", False):
        return

    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        if self.args.use_vllm and self.args.vllm_mode == "server":
            self.vllm_generation.sync_weights()
            FINAL_SYNCS["count"] += 1
        return output

    train._final_sync = True  # type: ignore[attr-defined]
    GRPOTrainer.train = train
