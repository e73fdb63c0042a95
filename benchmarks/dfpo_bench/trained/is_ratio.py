"""TRL's vLLM importance-sampling ratio with trained weights, at the recipes' sampling settings, against length.

One ``DFPOTrainer`` with a colocated vLLM engine (TRL's own path, ``vllm_importance_sampling_correction`` on) runs
TRL's rollout (``_generate_and_score_completions``) once per sampling setting on the same prompts, so what is
measured is what TRL computes: its ``sampling_per_token_logps`` (vLLM's, ``logprobs_mode="processed_logprobs"``),
its ``old_per_token_logps`` (the trainer's forward) and its ratio. An independent meter runs beside it: one more
forward of the trainer's model with the full logits, where the top-k / top-p support vLLM sampled from is rebuilt
(vLLM's order: top-k, then top-p on what is left) and its probability mass under the untruncated tempered
distribution, log K_t, is taken per token. If vLLM renormalises its log-probs over the truncated support, the
per-token gap trainer − vLLM equals log K_t up to the numerical mismatch between the two engines.

Per row it records the length, Σ gap, Σ log K, TRL's ratio and the factor each IS mode would put on the row's loss
(``sequence_mask`` and ``sequence_truncate`` with TRL's default bounds, ``token_truncate``'s mean over the row's
tokens, the correction off, and the ratio against the truncated support). Run on the GPU machine from the
repository root::

    for s in untruncated_t1 recipe_8b_lora recipe_32b; do
        python -m dfpo_bench.trained.is_ratio --model /root/models/qwen2.5-coder-0.5b-instruct --setting $s \
            --out /tmp/is_$s.json; done
    python -m dfpo_bench.trained.is_ratio --out $OUT/is_ratio.json --merge /tmp/is_*.json

It prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from typing import Any

import torch

# name: (temperature, top_p, top_k); the recipes' own settings and the untruncated baseline
SETTINGS = {
    "untruncated_t1": (1.0, 1.0, 0),
    "recipe_8b_lora": (0.7, 0.8, 20),     # recipes/qwen3_8b_lora.yaml
    "recipe_32b": (0.6, 0.95, 20),        # recipes/qwen3_32b.yaml
}
# Prompts that invite answers from a few tokens to a few thousand (the length axis of the measurement).
PROMPTS = [
    "Compute 47 × 38 + 215. Show your work briefly, then give the final answer as: Answer: <number>",
    "What is 12 + 9? Reply with the number only.",
    "Write a complete Python module implementing a binary search tree with insert, delete, search, in-order "
    "traversal, balancing checks, full docstrings and a thorough set of unit tests. Be exhaustive.",
    "Explain in detail, step by step, how a compiler turns source code into machine code: lexing, parsing, "
    "semantic analysis, intermediate representations, optimisation passes, register allocation and code "
    "generation. Give code examples for each stage.",
    "Write a long, detailed tutorial on implementing a relational database from scratch in C, covering storage, "
    "B-trees, the query parser, the planner, transactions and recovery, with code for every part.",
    "A farmer has 3 fields of 124, 87 and 215 rows of corn, with 36 plants per row. How many plants are there? "
    "Give the final answer as: Answer: <number>",
    "Implement, in Python, a full HTTP/1.1 server from sockets, with routing, chunked transfer encoding, "
    "keep-alive, static files, a test suite and extensive comments explaining every design decision.",
    "Write a short haiku about autumn.",
]


def rebuild_support_log_mass(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """log K_t: the untruncated tempered distribution's log mass on the support vLLM samples from.

    ``logits`` (T, V) float32. vLLM's sampler scales by the temperature, keeps the top ``top_k`` logits (ties
    kept), then among those drops the smallest whose cumulative mass, in ascending order, is at most 1 − top_p
    (always keeping the largest). K_t = Σ_{kept} p_t; its log is 0 when nothing is truncated."""
    if not (top_k and top_k > 0) and top_p >= 1.0:
        return torch.zeros(logits.shape[:-1], device=logits.device)
    scaled = logits / temperature
    total = torch.logsumexp(scaled, dim=-1)
    if top_k and top_k > 0:
        values = torch.topk(scaled, min(top_k, scaled.size(-1)), dim=-1).values  # descending
    else:
        values = torch.sort(scaled, dim=-1, descending=True).values
    if top_p < 1.0:
        ascending = values.flip(-1)
        cumulative = torch.softmax(ascending, dim=-1).cumsum(-1)
        dropped = cumulative <= 1.0 - top_p
        dropped[..., -1] = False
        ascending = ascending.masked_fill(dropped, float("-inf"))
        values = ascending
    return torch.logsumexp(values, dim=-1) - total


def row_factors(gap: torch.Tensor, log_mass: torch.Tensor, mask: torch.Tensor) -> dict[str, list[float]]:
    """Per row, the factor each IS mode puts on the row's loss (TRL 1.16's formulas; C_max 3, C_min none).

    ``gap`` = old − sampling per token (TRL's), ``log_mass`` = log K_t; (B, T), ``mask`` (B, T) 0/1."""
    m = mask.double()
    lengths = m.sum(-1).clamp(min=1)
    seq = (gap.double() * m).sum(-1)
    ratio = torch.exp(seq)
    token = torch.exp(gap.double()).clamp(max=3.0)
    matched = seq - (log_mass.double() * m).sum(-1)
    return {
        "sequence_mask": torch.where(ratio > 3.0, torch.zeros_like(ratio), ratio).tolist(),
        "sequence_truncate": ratio.clamp(max=3.0).tolist(),
        "token_truncate": ((token * m).sum(-1) / lengths).tolist(),
        "off": [1.0] * gap.size(0),
        "against_truncated_support": torch.exp(matched).clamp(max=3.0).tolist(),
    }


def build_trainer(model_path: str, settings: tuple[float, float, int], max_completion: int, num_generations: int,
                  rows: int, utilization: float):
    """A DFPOTrainer (DFPO off, TRL's defaults for the IS correction) with a colocated engine sampling at
    ``settings``; the rollout size is ``rows`` completions. One trainer per setting: TRL builds its log-prob head
    with the temperature at ``__init__`` (``add_fused_lm_head``), so changing the temperature afterwards would score
    the rollout at another temperature than vLLM sampled it."""
    temperature, top_p, top_k = settings
    from datasets import Dataset
    from dfpo_trl import DFPOConfig, DFPOTrainer

    def constant_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [0.0] * len(completions)

    config = DFPOConfig(
        output_dir="/tmp/is_ratio_trainer", report_to="none", bf16=True, use_cpu=False,
        model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=utilization, vllm_max_model_length=max_completion + 512,
        num_generations=num_generations, per_device_train_batch_size=rows // 4, steps_per_generation=4,
        gradient_accumulation_steps=1, max_completion_length=max_completion, max_steps=1,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=0.0,
    )
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    return DFPOTrainer(model=model_path, args=config, reward_funcs=constant_reward, train_dataset=data)


@torch.no_grad()
def support_log_mass(trainer: Any, output: dict[str, Any], settings: tuple[float, float, int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """log K_t and the tempered log-prob of each sampled completion token, from a full-logit forward of the trainer's
    model (the second is TRL's ``old_per_token_logps`` computed independently)."""
    temperature, top_p, top_k = settings
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    width = output["completion_ids"].size(1)
    result = torch.zeros(output["completion_ids"].shape, device=ids.device)
    logps = torch.zeros(output["completion_ids"].shape, device=ids.device)
    for row in range(ids.size(0)):
        logits = model(input_ids=ids[row:row + 1], attention_mask=attention[row:row + 1],
                       logits_to_keep=width + 1).logits[0, :-1].float()
        sampled = output["completion_ids"][row]
        for start in range(0, width, 1024):
            chunk = logits[start:start + 1024]
            result[row, start:start + 1024] = rebuild_support_log_mass(chunk, temperature, top_p, top_k)
            logps[row, start:start + 1024] = torch.log_softmax(chunk / temperature, dim=-1).gather(
                -1, sampled[start:start + 1024, None])[:, 0]
    return result, logps


def measure(trainer: Any, name: str, settings: tuple[float, float, int], prompts: list[dict[str, Any]]) -> dict:
    """One TRL rollout at ``settings`` and the independent meter beside it."""
    temperature, top_p, top_k = settings
    trainer.model.train()
    started = time.perf_counter()
    output = trainer._generate_and_score_completions(prompts)
    rollout_s = time.perf_counter() - started
    mask = output["completion_mask"].float()
    gap = (output["old_per_token_logps"] - output["sampling_per_token_logps"]) * mask
    log_mass, own_logps = support_log_mass(trainer, output, settings)
    log_mass = log_mass * mask
    # the independent forward against TRL's old log-probs, and the vLLM gap measured from it
    trainer_check = (own_logps - output["old_per_token_logps"]) * mask
    own_gap = (own_logps - output["sampling_per_token_logps"]) * mask
    lengths = mask.sum(-1)
    factors = row_factors(gap, log_mass, mask)
    trl_ratio = output["importance_sampling_ratio"].reshape(-1)
    mismatch = (gap - log_mass) * mask
    n = mask.sum().clamp(min=1)
    return {
        "setting": name, "temperature": temperature, "top_p": top_p, "top_k": top_k, "rollout_s": rollout_s,
        "rows": {
            "length": lengths.tolist(),
            "sum_gap": gap.sum(-1).tolist(),
            "sum_log_mass": log_mass.sum(-1).tolist(),
            "trl_ratio": trl_ratio.tolist(),
            "group": [i // trainer.num_generations for i in range(mask.size(0))],
            "factors": factors,
        },
        "tokens": {
            "count": int(n.item()),
            "mean_gap": float(gap.sum() / n), "mean_abs_gap": float(gap.abs().sum() / n),
            "mean_log_mass": float(log_mass.sum() / n),
            "mean_mismatch": float(mismatch.sum() / n), "mean_abs_mismatch": float(mismatch.abs().sum() / n),
            "mean_own_gap": float(own_gap.sum() / n),
            "mean_abs_own_minus_trl_old": float(trainer_check.abs().sum() / n),
        },
        # TRL's ratio recomputed from its own inputs: equal to TRL's (a check of this script's reading of TRL)
        "trl_ratio_recomputed_max_abs_diff": float((torch.tensor(factors["sequence_mask"], device=trl_ratio.device,
                                                                 dtype=trl_ratio.dtype) - trl_ratio).abs().max()),
    }


def slope_per_token(lengths: list[float], factors: list[float]) -> float | None:
    """OLS slope of log(factor) on length over rows with a positive factor (nats per token)."""
    pairs = [(x, math.log(f)) for x, f in zip(lengths, factors, strict=True) if f > 0 and x > 0]
    if len(pairs) < 3:
        return None
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    return sum((x - mx) * (y - my) for x, y in pairs) / sxx if sxx > 0 else None


def summary_line(record: dict[str, Any]) -> str:
    rows, tokens = record["rows"], record["tokens"]
    ratio = rows["trl_ratio"]
    slopes = {mode: slope_per_token(rows["length"], values) for mode, values in rows["factors"].items()}
    slope_text = ", ".join(f"{mode} {value:+.4f}" if value is not None else f"{mode} n/a"
                           for mode, value in slopes.items())
    return (f"{record['setting']:>15}: rows {len(ratio)}, length mean {sum(rows['length']) / len(ratio):.0f} max "
            f"{max(rows['length']):.0f}; gap/token {tokens['mean_gap']:+.4f} (|gap| {tokens['mean_abs_gap']:.4f}), "
            f"log K/token {tokens['mean_log_mass']:+.4f}, mismatch/token {tokens['mean_mismatch']:+.4f}, "
            f"|own − TRL old| {tokens['mean_abs_own_minus_trl_old']:.4f}; "
            f"TRL ratio mean {sum(ratio) / len(ratio):.3f} min {min(ratio):.3g} max {max(ratio):.3g}; "
            f"slope of log factor per token: {slope_text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--setting", choices=list(SETTINGS), help="one per process (see build_trainer)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join one-setting results into --out")
    parser.add_argument("--max-completion", type=int, default=4096)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--utilization", type=float, default=0.4)
    args = parser.parse_args()
    if args.merge:
        parts = [json.loads(pathlib.Path(path).read_text()) for path in args.merge]
        merged = {**parts[0], "settings": [record for part in parts for record in part["settings"]]}
        pathlib.Path(args.out).write_text(json.dumps(merged))
        for record in merged["settings"]:
            print(summary_line(record))
        return
    from dfpo_bench.lib.common import card, versions
    from dfpo_bench.lib.provenance import checkout_state

    rows = len(PROMPTS) * args.num_generations
    prompts = [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS for _ in range(args.num_generations)]
    trainer = build_trainer(args.model, SETTINGS[args.setting], args.max_completion, args.num_generations, rows,
                            args.utilization)
    torch.manual_seed(0)
    record = measure(trainer, args.setting, SETTINGS[args.setting], prompts)
    result = {"card": card(), "versions": versions(), "checkout": checkout_state(pathlib.Path.cwd()),
              "model": args.model, "max_completion": args.max_completion, "num_generations": args.num_generations,
              "prompts": PROMPTS, "settings": [record]}
    pathlib.Path(args.out).write_text(json.dumps(result))
    print(summary_line(record))


if __name__ == "__main__":
    main()
