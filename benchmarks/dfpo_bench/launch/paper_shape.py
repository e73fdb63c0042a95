"""The paper recipe's launch shape in miniature on 4 GPUs: a tensor-parallel vLLM server and a ZeRO-3 trainer.

    # on a machine with 4 GPUs, after the kit's setup with vLLM (benchmarks/README.md); ~5 minutes
    python -m dfpo_bench.launch.paper_shape --tokenizer /root/models/smollm2-135m-instruct --out-dir $OUT/shape

``recipes/qwen3_32b.yaml`` runs a vLLM server with ``--tensor-parallel-size 8`` on one node and the ZeRO-3 trainer on
others. Scaled to one host of 4 GPUs:

1. a random-init model of Qwen3's architecture (:func:`make_model`: 8 attention and 4 key-value heads, so tensor
   parallelism 2 divides them; SmolLM2-135M's 9 heads do not), with a tokenizer and chat template copied from
   ``--tokenizer``, saved to disk so that vLLM can load it;
2. the server on GPUs 2 and 3 (``--tensor-parallel-size 2``, the flags of ``vllm_server.server_command``, which are
   TRL 1.16's);
3. the trainer on GPUs 0 and 1: ``accelerate launch --config_file recipes/accelerate/zero3_2gpu.yaml
   dfpo_bench.launch.final_sync RECIPE`` with the recipe derived from the paper's (``vllm_server.derived_recipe``),
   ``group_transform: min_replace``, off-policy (``steps_per_generation`` > accumulation). A random model never
   answers the arithmetic task, so the reward is :func:`letter_share` (a continuous score with in-group spread) and
   the held-out evaluation is skipped; the learning rate is large enough to move a random model measurably. The
   recipe's top-k 20 / top-p 0.95 are lifted (top_k 0, top_p 1): vLLM reports log-probabilities after them
   (``processed_logprobs``) while the trainer's are after temperature only, which for a trained model's peaked
   distribution differ little, but for a random model's near-uniform one by about log(vocab / 20) nats; TRL's
   importance-sampling correction (``sequence_mask``) then masks every completion and nothing trains (seen in the
   first run: ``sampling/sampling_logp_difference/mean`` 5.4, every ratio 0, ``grad_norm`` 0). The server runs
   with ``--enforce-eager`` (no CUDA-graph capture: a shorter start-up, the same weights path);
4. the weight-sync check after ZeRO-3 gathers the partitioned parameters: ``final_sync.py`` pushes the final
   weights once more when training ends (TRL's ``sync_weights`` gathers under ZeRO-3), then the server's
   log-probabilities of a fixed token sequence equal those of the saved final model (transformers, bf16, GPU 0)
   within the bound of ``vllm_server.weight_sync_check`` (the server-vs-transformers gap on the initial weights,
   measured before training) and differ from the initial model's by more;
5. ``paper_shape.json``: the card, the commands, the weight syncs, the per-step log, the check's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
from dfpo_bench.lib import common  # noqa: E402
from dfpo_bench.lib.vllm_tools import (  # noqa: E402
    SERVER_ENV,
    check_tokens,
    model_logprobs,
    server_command,
    server_logprobs,
    shell_line,
    stop_server,
    vllm_has_scale_out,
    wait_for_health,
    weight_sync_check,
)
from dfpo_bench.lib.vllm_tools import derived_recipe as paper_derived_recipe  # noqa: E402

ZERO3_CONFIG = "recipes/accelerate/zero3_2gpu.yaml"


def letter_share(completions: list[Any], **_: Any) -> list[float]:
    """Share of a completion's characters that are ASCII letters: a score with spread inside every group of a
    random model's completions, so that advantages and gradients are not zero."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def make_model(tokenizer_path: str, out: pathlib.Path, seed: int = 0) -> dict[str, Any]:
    """A random-init Qwen3 (4 layers, hidden 512, 8 heads of 64, 4 key-value heads) with ``tokenizer_path``'s
    tokenizer, saved in bf16 for vLLM and transformers."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"architecture": "Qwen3ForCausalLM", "parameters": sum(p.numel() for p in model.parameters()),
            "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "vocab": len(tokenizer),
            "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_token_id}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="/root/models/smollm2-135m-instruct")
    p.add_argument("--out-dir", default="/tmp/paper_shape")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--steps", type=int, default=16, help="optimizer steps (2 rollouts of 8)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--group-port", type=int, default=51316, help="the NCCL weight-transfer port (TRL's 51216 + 100)")
    p.add_argument("--server-gpus", default="2,3")
    p.add_argument("--trainer-gpus", default="0,1")
    p.add_argument("--server-timeout", type=float, default=420.0)
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="per-token |log-prob| difference allowed on top of twice the same-weights floor")
    args = p.parse_args(argv)
    import torch

    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "random-qwen3"
    result: dict[str, Any] = {"cards": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                              "model": make_model(args.tokenizer, model_dir)}
    from dfpo_bench.lib.common import installed_versions as versions

    result["versions"] = versions()
    tp = len(args.server_gpus.split(","))
    server = server_command(str(model_dir), host="127.0.0.1", port=args.port, tensor_parallel_size=tp,
                            gpu_memory_utilization=0.5, max_model_len=1024, scale_out=vllm_has_scale_out(),
                            enforce_eager=True, python=sys.executable)
    recipe = paper_derived_recipe(str(model_dir), args.port, str(out / "train"), args.steps, {
        "reward_funcs": ["paper_shape:letter_share"], "skip_eval": True, "learning_rate": args.learning_rate,
        "plot": False, "top_k": 0, "top_p": 1.0, "min_p": None, "vllm_group_port": args.group_port})
    recipe_path = out / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    trainer = ["accelerate", "launch", "--config_file", ZERO3_CONFIG, "--num_processes",
               str(len(args.trainer_gpus.split(","))), "--main_process_port", "29511",
               "benchmarks/dfpo_bench/launch/final_sync.py", str(recipe_path)]
    result["commands"] = {
        "server": shell_line(server_command(str(model_dir), host="127.0.0.1", port=args.port,
                                            tensor_parallel_size=tp, gpu_memory_utilization=0.5, max_model_len=1024,
                                            enforce_eager=True, scale_out=vllm_has_scale_out()),
                          gpus=args.server_gpus),
        "trainer": f"CUDA_VISIBLE_DEVICES={args.trainer_gpus} " + shlex.join(trainer),
        "this_script": "python -m dfpo_bench.launch.paper_shape "
                       + shlex.join(argv if argv is not None else sys.argv[1:]),
    }
    token_ids, prompt_tokens = check_tokens(str(model_dir))
    initial = model_logprobs(str(model_dir), token_ids, prompt_tokens)
    env = {**os.environ, **SERVER_ENV, "CUDA_VISIBLE_DEVICES": args.server_gpus}
    with open(out / "server.log", "w") as handle:
        process = subprocess.Popen(server, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        result["server_startup_s"] = round(wait_for_health(args.port, process, args.server_timeout), 1)
        served_initial = server_logprobs(args.port, str(model_dir), token_ids, prompt_tokens)
        start = time.time()
        train_env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.trainer_gpus,
                     "PYTHONPATH": common.child_pythonpath()}
        with open(out / "train.log", "w") as handle:
            code = subprocess.call(trainer, cwd=ROOT, env=train_env, stdout=handle, stderr=subprocess.STDOUT)
        result.update(trainer_exit_code=code, train_wall_s=round(time.time() - start, 1))
        log = (out / "train.log").read_text()
        result["weight_updates_logged_by_server"] = (out / "server.log").read_text().count("finish_weight_update")
        summary_path = out / "train" / "dfpo_summary.json"
        if code == 0 and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            result["method"] = summary.get("method")
            result["steps"] = summary.get("steps")
            result["per_step"] = [{k: row[k] for k in ("step", "loss", "reward", "reward_std", "grad_norm",
                                                       "transform/phi_mean", "transform/phi_min",
                                                       "sampling/sampling_logp_difference/mean",
                                                       "sampling/importance_sampling_ratio/mean") if k in row}
                                  for row in summary.get("log_history", []) if "loss" in row]
            served = server_logprobs(args.port, str(model_dir), token_ids, prompt_tokens)
            trained = model_logprobs(str(out / "train"), token_ids, prompt_tokens)
            result["weight_sync_check"], result["weight_sync_numbers"] = weight_sync_check(
                served_initial, initial, served, trained, args.tolerance)
        else:
            result["log_tail"] = log[-4000:]
    finally:
        stop_server(process)
    (out / "paper_shape.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_step", "log_tail")}, indent=1))
    if "log_tail" in result:
        print(result["log_tail"][-2500:])


if __name__ == "__main__":
    main()
