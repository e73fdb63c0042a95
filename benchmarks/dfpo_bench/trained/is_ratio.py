"""TRL's vLLM importance-sampling ratio against the one taken over vLLM's truncated support, with trained weights, at
the recipes' sampling settings (:data:`SETTINGS`), against length; and what the truncated support costs against the
correction off. The command: benchmarks/README.md.

Per setting one ``DFPOTrainer`` (DFPO off; TRL's correction on, ``vllm_importance_sampling_support="truncated"``)
runs TRL's rollout once; a wrapper keeps vLLM's returned log-probs s, so each row has TRL's log ratio
Σ (ℓ^old − s), ours Σ (ℓ^old − log K − s) (from the sampler's log-probs handed to TRL's loss, s + log K) and the
correction off (0), beside an independent meter: a full-logit forward of the trainer's model, the support rebuilt in
vLLM's order (:func:`rebuild_support`). The cost: interleaved rounds of the three conditions in a shuffled order,
each one rollout and its loss steps, the within-round ratio to the correction off and its median over rounds with a
bootstrap interval. ``--dry-run`` runs it all on the CPU through a stand-in engine (:class:`DryEngine`) with which
the engines agree, so ours is 1 on every row (benchmarks/tests/test_trained.py)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch

from dfpo_bench.lib.common import card, versions
from dfpo_bench.lib.provenance import checkout_state
from dfpo_bench.lib.stats import bootstrap_median
from dfpo_bench.lib.timing import synchronize

# name: (temperature, top_p, top_k, min_p), the recipes that sample so
SETTINGS = {
    "untruncated_t1": (1.0, 1.0, 0, 0.0),
    "recipe_8b_lora": (0.7, 0.8, 20, 0.0),  # recipes/qwen3_8b_lora.yaml and recipes/qwen3_next_80b_a3b.yaml
    "recipe_32b": (0.6, 0.95, 20, 0.0),  # recipes/qwen3_32b.yaml
    "untruncated_t06": (0.6, 1.0, 0, 0.0),  # a control: the engines' mismatch alone at the 32B recipe's temperature
}
DEFAULT_SETTINGS = ["untruncated_t1", "recipe_8b_lora", "recipe_32b"]
RECIPES = {"untruncated_t1": [], "recipe_8b_lora": ["qwen3_8b_lora.yaml", "qwen3_next_80b_a3b.yaml"],
           "recipe_32b": ["qwen3_32b.yaml"]}
KINDS = ("trl", "truncated_support", "off")
LENGTH_BINS = (1, 100, 300, 1000, 2000)  # lower edges; the last bin is open
TARGET_SLOPE, TARGET_MEDIAN = 1e-4, (0.9, 1.1)  # for ours: |nats per token|, and the range of its medians by bin
CLIP_MAX, CLIP_MINS = 3.0, (None, 0.5)  # TRL's default C_max; C_min none (TRL's default) or 0.5
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


# ------------------------------------------------------------------------------------------- the meter
def rebuild_support(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                    min_p: float = 0.0) -> torch.Tensor:
    """The support vLLM samples from, as a (…, V) bool mask, from raw ``logits`` (float32), in vLLM's order: the
    temperature; min-p keeps p ≥ min_p · max p; top-k keeps the logits at or above the k-th largest (ties kept);
    top-p, on the distribution renormalised over what is left, sorted ascending, drops every token whose running mass
    is ≤ 1 − top_p, the largest always kept (vLLM's ``apply_top_k_top_p_pytorch`` and its min-p processor)."""
    scaled = logits / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        keep &= probs >= probs.amax(dim=-1, keepdim=True) * min_p
    if 0 < top_k < scaled.size(-1):
        kth = torch.topk(scaled.masked_fill(~keep, float("-inf")), top_k, dim=-1).values[..., -1:]
        keep &= scaled >= kth
    if top_p < 1.0:
        masked = scaled.masked_fill(~keep, float("-inf"))
        ascending, order = torch.sort(masked, dim=-1)
        running = torch.softmax(ascending, dim=-1).cumsum(-1)
        dropped = running <= 1.0 - torch.tensor(top_p, dtype=running.dtype)
        dropped[..., -1] = False
        keep &= ~torch.zeros_like(keep).scatter(-1, order, dropped)
    return keep


def rebuild_support_log_mass(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                             min_p: float = 0.0) -> torch.Tensor:
    """log K_t: the untruncated tempered distribution's log mass on :func:`rebuild_support`; 0 untruncated."""
    if not (top_k and top_k > 0) and top_p >= 1.0 and min_p <= 0:
        return torch.zeros(logits.shape[:-1], device=logits.device)
    scaled, keep = logits / temperature, rebuild_support(logits, temperature, top_p, top_k, min_p)
    return torch.logsumexp(scaled.masked_fill(~keep, float("-inf")), dim=-1) - torch.logsumexp(scaled, dim=-1)


@torch.no_grad()
def meter_log_mass(trainer: Any, output: dict[str, Any], setting: tuple[float, float, int, float]) -> torch.Tensor:
    """log K_t of each completion token from a full-logit forward of the trainer's model (transformers' own head,
    not TRL's fused one), one row at a time, 1024 positions per rebuild."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    width = output["completion_ids"].size(1)
    result = torch.zeros(output["completion_ids"].shape, device=ids.device)
    for row in range(ids.size(0)):
        logits = model(input_ids=ids[row:row + 1], attention_mask=attention[row:row + 1],
                       logits_to_keep=width + 1).logits[0, :-1].float()
        for start in range(0, width, 1024):
            result[row, start:start + 1024] = rebuild_support_log_mass(logits[start:start + 1024], *setting)
    return result * output["completion_mask"]


# ------------------------------------------------------------------------------------------ the engines
def share_one_engine() -> None:
    """Every ``vllm.LLM`` TRL builds in this process after the first is the first (same model, same engine settings;
    each request carries its own sampling settings, and each trainer pushes its weights before its first rollout)."""
    import trl.generation.vllm_generation as generation

    first: dict[str, Any] = {}
    build = generation.LLM

    def shared(*args: Any, **kwargs: Any) -> Any:
        if "engine" not in first:
            first["engine"] = build(*args, **kwargs)
        return first["engine"]

    generation.LLM = shared


class DryEngine:
    """``vllm.LLM`` as TRL's colocated path drives it, on the CPU: the checkpoint in float32 (so it agrees with the
    trainer once synced), sampling from :func:`rebuild_support` and returning log-probs renormalised over it
    (``processed_logprobs``). For ``--dry-run`` only."""

    def __init__(self, model: str, **settings: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            model_runner=runner)))
        self.rng = torch.Generator().manual_seed(0)

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    def reset_prefix_cache(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[dict[str, list[int]]], sampling_params: Any, use_tqdm: bool = False) -> list:
        p, eos, outputs = sampling_params, self.model.config.eos_token_id, []
        for prompt in prompts:
            ids, tokens, logprobs = list(prompt["prompt_token_ids"]), [], []
            for _ in range(p.max_tokens):
                logits = self.model(torch.tensor([ids + tokens])).logits[0, -1].float()
                keep = rebuild_support(logits, p.temperature, p.top_p, p.top_k, p.min_p)
                log_probs = (logits / p.temperature).masked_fill(~keep, float("-inf")).log_softmax(-1)
                token = int(torch.multinomial(log_probs.exp(), 1, generator=self.rng))
                tokens.append(token)
                logprobs.append({token: SimpleNamespace(logprob=float(log_probs[token]), rank=1)})
                if token == eos:
                    break
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[SimpleNamespace(
                token_ids=tokens, logprobs=logprobs)]))
        return outputs


def use_dry_engine() -> None:
    """TRL's vLLM module told vLLM is there, with :class:`DryEngine` as its engine."""
    import trl.generation.vllm_generation as generation

    generation.is_vllm_available = lambda *args, **kwargs: True
    generation.SamplingParams = SimpleNamespace
    generation.LLM = DryEngine


class SampledLogprobs:
    """Keeps what vLLM returned for the sampled tokens at each call of TRL's ``VLLMGeneration.generate``."""

    def __init__(self, generation: Any) -> None:
        self.last: list[list[float]] = []
        original = generation.generate

        def generate(*args: Any, **kwargs: Any) -> tuple:
            result = original(*args, **kwargs)
            self.last = [[token[0] for token in row] for row in result[2]]
            return result

        generation.generate = generate

    def padded(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        out = torch.zeros(shape, device=device)
        for row, values in enumerate(self.last):
            out[row, :len(values)] = torch.tensor([math.nan if v is None else v for v in values], device=device)
        return out


def build_trainer(model_path: str, setting: tuple[float, float, int, float], max_completion: int,
                  num_generations: int, rows: int, utilization: float, dry: bool) -> Any:
    """A DFPOTrainer (DFPO off; TRL's correction on, ``sequence_mask``, against the truncated support) sampling at
    ``setting``, its rollout ``rows`` completions. One trainer per temperature: TRL builds its fused log-prob head
    with the temperature at ``__init__``."""
    from datasets import Dataset
    from dfpo_trl import DFPOConfig, DFPOTrainer

    temperature, top_p, top_k, min_p = setting

    def constant_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [0.0] * len(completions)

    device = dict(use_cpu=True, bf16=False) if dry else dict(
        bf16=True, use_cpu=False, model_init_kwargs={"dtype": "bfloat16"}, vllm_gpu_memory_utilization=utilization)
    config = DFPOConfig(
        output_dir=tempfile.mkdtemp(prefix="is_ratio_"), report_to="none", disable_tqdm=True, **device,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=max_completion + 512,
        num_generations=num_generations, per_device_train_batch_size=max(1, rows // 4), steps_per_generation=4,
        gradient_accumulation_steps=1, max_completion_length=max_completion, max_steps=1,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_support="truncated",
    )
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = DFPOTrainer(model=model_path, args=config, reward_funcs=constant_reward, train_dataset=data)
    trainer.sampled = SampledLogprobs(trainer.vllm_generation)
    return trainer


# -------------------------------------------------------------------------------------------- measuring
def measure(trainer: Any, name: str, setting: tuple[float, float, int, float], prompts: list[dict[str, Any]],
            num_generations: int) -> dict[str, Any]:
    """One TRL rollout at ``setting`` with the product's truncated support, vLLM's own log-probs kept, the meter
    beside it; per row and per token what each kind puts on the loss."""
    trainer.model.train()
    synchronize()
    started = time.perf_counter()
    output = trainer._generate_and_score_completions(prompts)
    synchronize()
    rollout_s = time.perf_counter() - started
    mask = output["completion_mask"].float()
    old = output["old_per_token_logps"].float()
    raw = trainer.sampled.padded(mask.shape, mask.device)
    shifted = output["sampling_per_token_logps"].float()
    trl_token = torch.nan_to_num((old - raw) * mask, nan=0.0)  # TRL's per-token log ratio (support "full")
    ours_token = torch.nan_to_num((old - shifted) * mask, nan=0.0)  # against the truncated support
    per_token = {"trl": trl_token, "truncated_support": ours_token}
    product_log_mass = torch.nan_to_num((shifted - raw) * mask, nan=0.0)
    meter = meter_log_mass(trainer, output, setting)
    tokens = mask.bool()
    count = tokens.sum().clamp(min=1)
    return {
        "setting": name, "temperature": setting[0], "top_p": setting[1], "top_k": setting[2], "min_p": setting[3],
        "recipes": RECIPES.get(name, []), "rollout_s": rollout_s,
        "rows": {
            "length": mask.sum(-1).tolist(), "group": [i // num_generations for i in range(mask.size(0))],
            "log_ratio": {"trl": trl_token.sum(-1).tolist(), "truncated_support": ours_token.sum(-1).tolist(),
                          "off": [0.0] * mask.size(0)},
            "sum_log_mass_product": product_log_mass.sum(-1).tolist(), "sum_log_mass_meter": meter.sum(-1).tolist(),
            "applied_ratio": output["importance_sampling_ratio"].reshape(-1).double().tolist(),
            "token_mask_dropped": {kind: ((values.exp() > CLIP_MAX) & tokens).sum(-1).tolist()
                                   for kind, values in per_token.items()},
            # token_truncate's factor: the row's mean of its per-token ratios capped at C_max
            "token_truncate_factor": {
                kind: ((values.exp().clamp(max=CLIP_MAX) * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
                for kind, values in per_token.items()},
        },
        "tokens": {
            "count": int(tokens.sum()), "mean_log_mass_product": float(product_log_mass.sum() / count),
            "mean_log_mass_meter": float(meter.sum() / count),
            "max_abs_product_minus_meter": float(((product_log_mass - meter) * mask).abs().max()),
            "mean_trl_log_ratio": float(trl_token.sum() / count),
            "mean_truncated_support_log_ratio": float(ours_token.sum() / count),
        },
    }


def ols_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x; None below 2 points or when x does not vary."""
    if len(points) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return None if sxx == 0 else sum((x - mx) * (y - my) for x, y in points) / sxx


def cluster_bootstrap_slope(clusters: dict[int, list[tuple[float, float]]], draws: int = 2000, seed: int = 0
                            ) -> tuple[float | None, list[float] | None]:
    """:func:`ols_slope` over every point, and a 95% percentile interval from ``draws`` resamplings of whole
    clusters (the completions of one prompt are not independent); no interval below 2 clusters."""
    keys = sorted(clusters)
    point = ols_slope([p for k in keys for p in clusters[k]])
    if point is None or len(keys) < 2:
        return point, None
    rng = random.Random(seed)
    boot = sorted(v for _ in range(draws)
                  if (v := ols_slope([p for k in rng.choices(keys, k=len(keys)) for p in clusters[k]])) is not None)
    return point, [boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]] if boot else None


def slope_per_token(lengths: list[float], factors: list[float]) -> float | None:
    """OLS slope of log(factor) on length over rows with a positive factor (nats per token)."""
    return ols_slope([(x, math.log(f)) for x, f in zip(lengths, factors, strict=True) if f > 0 and x > 0])


def row_factors(log_ratio: list[float], token_means: list[float] | None = None) -> dict[str, list[float]]:
    """Per row the factor each of TRL's modes puts on the row's loss for a sequence log ratio (TRL 1.16's formulas,
    C_max 3, C_min none); ``token_truncate``'s is the row's mean of its clipped per-token ratios (``token_means``)."""
    ratio = [math.exp(min(v, 700.0)) for v in log_ratio]
    token = {} if token_means is None else {"token_truncate": token_means}
    return {"sequence_mask": [0.0 if r > CLIP_MAX else r for r in ratio],
            "sequence_truncate": [min(r, CLIP_MAX) for r in ratio], **token}


def length_bins(lengths: list[float], ratios: list[float]) -> list[dict[str, Any]]:
    """The median ratio of the rows in each length bin (:data:`LENGTH_BINS`), with its row count."""
    edges = zip(LENGTH_BINS, (*LENGTH_BINS[1:], math.inf), strict=True)
    binned = {(low, high): [r for x, r in zip(lengths, ratios, strict=True) if low <= x < high] for low, high in edges}
    return [{"from": low, "to": None if math.isinf(high) else high, "rows": len(values),
             "median": statistics.median(values) if values else None} for (low, high), values in binned.items()]


def analyse(record: dict[str, Any]) -> dict[str, Any]:
    """A setting's summary: each kind's slope (bootstrap over prompts), medians by bin, dropped rows, ours' targets."""
    rows = record["rows"]
    lengths, groups = rows["length"], rows["group"]
    slopes, intervals, bins, dropped, mode_slopes = {}, {}, {}, {}, {}
    for kind in KINDS:
        values = rows["log_ratio"][kind]
        clusters: dict[int, list[tuple[float, float]]] = {}
        for x, y, g in zip(lengths, values, groups, strict=True):
            if x > 0:
                clusters.setdefault(g, []).append((x, y))
        slopes[kind], intervals[kind] = cluster_bootstrap_slope(clusters)
        ratios = [math.exp(min(v, 700.0)) for v in values]
        bins[kind] = length_bins(lengths, ratios)
        if kind != "off":
            dropped[kind] = {
                f"sequence_mask_clip_min_{c_min}": statistics.fmean(
                    float(r > CLIP_MAX or (c_min is not None and r < c_min)) for r in ratios) for c_min in CLIP_MINS}
            dropped[kind]["token_mask_rows_with_a_dropped_token"] = statistics.fmean(
                float(n > 0) for n in rows["token_mask_dropped"][kind])
            factors = row_factors(values, rows.get("token_truncate_factor", {}).get(kind))
            mode_slopes[kind] = {mode: slope_per_token(lengths, factor) for mode, factor in factors.items()}
    ours = slopes["truncated_support"]
    medians = [b["median"] for b in bins["truncated_support"] if b["median"] is not None]
    return {
        "slope_per_token": slopes, "slope_interval_95": intervals, "median_ratio_by_length": bins,
        "dropped_rows": dropped, "mode_factor_slope_per_token": mode_slopes,
        "longest": max(lengths), "rows": len(lengths),
        "targets": {"slope_abs_max": TARGET_SLOPE, "median_within": list(TARGET_MEDIAN),
                    "slope_met": ours is not None and abs(ours) <= TARGET_SLOPE,
                    "median_met": bool(medians) and all(TARGET_MEDIAN[0] <= m <= TARGET_MEDIAN[1] for m in medians)},
    }


# ------------------------------------------------------------------------------------------------ cost
CONDITIONS = {"off": (False, "full"), "trl": (True, "full"), "truncated_support": (True, "truncated")}


def set_condition(trainer: Any, name: str) -> None:
    """TRL reads its correction switch from the trainer at each rollout and loss; DFPO reads the support from args."""
    correction, support = CONDITIONS[name]
    trainer.vllm_importance_sampling_correction = correction
    trainer.args.vllm_importance_sampling_support = support


def one_round_part(trainer: Any, prompts: list[dict[str, Any]]) -> dict[str, float]:
    """One rollout and its loss steps (forward and backward of each micro-batch, gradients dropped): seconds each."""
    from trl.trainer.utils import split_tensor_dict

    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    synchronize()
    start = time.perf_counter()
    output = trainer._generate_and_score_completions(prompts)
    synchronize()
    rollout = time.perf_counter() - start
    start = time.perf_counter()
    for micro in split_tensor_dict(output, trainer.args.steps_per_generation):
        loss = trainer.compute_loss(trainer.model, micro)
        loss.backward()
        trainer.model.zero_grad(set_to_none=True)
    synchronize()
    loss_steps = time.perf_counter() - start
    return {"rollout_s": rollout, "loss_steps_s": loss_steps, "loop_s": rollout + loss_steps}


def cost(trainer: Any, prompts: list[dict[str, Any]], rounds: int, budget_s: float, seed: int = 0) -> dict[str, Any]:
    """Interleaved rounds of the three conditions (shuffled order); each condition's ratio to the correction off
    within a round, its median over rounds and a bootstrap interval. A warm-up round is run first and not kept;
    rounds stop when ``budget_s`` is spent."""
    rng = random.Random(seed)
    for name in CONDITIONS:  # warm-up: compiled kernels, allocator
        set_condition(trainer, name)
        one_round_part(trainer, prompts)
    kept, started = [], time.monotonic()
    for _ in range(rounds):
        if kept and time.monotonic() - started > budget_s:
            break
        order = list(CONDITIONS)
        rng.shuffle(order)
        parts = {}
        for name in order:
            set_condition(trainer, name)
            parts[name] = one_round_part(trainer, prompts)
        kept.append({"order": order, "parts": parts})
        print("cost round: " + ", ".join(f"{n} loop {p['loop_s']:.2f}s loss {p['loss_steps_s']:.2f}s"
                                         for n, p in parts.items()), flush=True)
    set_condition(trainer, "truncated_support")
    summary: dict[str, Any] = {"rounds": len(kept), "per_round": kept, "trl": {}, "truncated_support": {}}
    for name in ("trl", "truncated_support"):
        for part in ("loss_steps_s", "loop_s", "rollout_s"):
            ratios = [r["parts"][name][part] / r["parts"]["off"][part] for r in kept]
            summary[name][part.removesuffix("_s")] = {
                "median_ratio_to_off": statistics.median(ratios),
                "interval_95": bootstrap_median(ratios) if len(ratios) > 1 else None, "ratios": ratios}
    return summary


# ------------------------------------------------------------------------------------------------- main
def summary_line(name: str, summary: dict[str, Any], record: dict[str, Any]) -> str:
    slopes = ", ".join(f"{k} {v:+.5f}" if v is not None else f"{k} n/a" for k, v in summary["slope_per_token"].items())
    bins = " ".join(f"{b['median']:.3g}" if b["median"] is not None else "-"
                    for b in summary["median_ratio_by_length"]["truncated_support"])
    tokens = record["tokens"]
    return (f"{name:>15}: rows {summary['rows']}, longest {summary['longest']:.0f}; slope/token {slopes}; ours' "
            f"median by bin {bins}; log K/token {tokens['mean_log_mass_product']:+.4f} (meter "
            f"{tokens['mean_log_mass_meter']:+.4f}, max |diff| {tokens['max_abs_product_minus_meter']:.1e}); "
            f"targets met: slope {summary['targets']['slope_met']}, median {summary['targets']['median_met']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/root/models/qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--out", required=True)
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--max-completion", type=int, default=2560)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--utilization", type=float, default=0.3)
    parser.add_argument("--cost-setting", default="recipe_8b_lora", choices=list(SETTINGS))
    parser.add_argument("--cost-rounds", type=int, default=6)
    parser.add_argument("--cost-max-completion", type=int, default=384)
    parser.add_argument("--cost-budget-s", type=float, default=120.0, help="no cost round starts after this")
    parser.add_argument("--dry-run", action="store_true", help="CPU: a tiny model and a stand-in engine")
    args = parser.parse_args(argv)
    started = time.monotonic()
    model = args.model
    if args.dry_run:
        use_dry_engine()
        from dfpo_trl.testing import save_tiny_chat_model

        model = str(save_tiny_chat_model(pathlib.Path(tempfile.mkdtemp(prefix="is_ratio_model_"))))
    share_one_engine()
    prompts = [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS for _ in range(args.num_generations)]
    result: dict[str, Any] = {
        "card": card(), "versions": versions(), "checkout": checkout_state(pathlib.Path.cwd()), "model": model,
        "dry_run": args.dry_run, "max_completion": args.max_completion, "num_generations": args.num_generations,
        "prompts": PROMPTS, "settings": {}, "slope_per_token": {}}
    lines, cost_trainer = [], None
    for name in args.settings:
        trainer = build_trainer(model, SETTINGS[name], args.max_completion, args.num_generations, len(prompts),
                                args.utilization, args.dry_run)
        torch.manual_seed(0)
        record = measure(trainer, name, SETTINGS[name], prompts, args.num_generations)
        summary = analyse(record)
        result["settings"][name] = {**summary, "record": record}
        result["slope_per_token"][name] = summary["slope_per_token"]
        lines.append(summary_line(name, summary, record))
        print(lines[-1], flush=True)
        pathlib.Path(args.out).write_text(json.dumps(result))  # what is done so far survives a time limit
        if name == args.cost_setting:
            cost_trainer = trainer
        del trainer  # the cost setting's is kept in cost_trainer
        torch.cuda.empty_cache()  # a no-op when CUDA is not initialised
    if cost_trainer is not None and args.cost_rounds > 0:
        cost_trainer.vllm_generation.max_completion_length = args.cost_max_completion
        result["cost"] = {"setting": args.cost_setting, "max_completion": args.cost_max_completion,
                          **cost(cost_trainer, prompts, args.cost_rounds, args.cost_budget_s)}
        for kind in ("trl", "truncated_support"):
            parts = result["cost"][kind]
            lines.append(f"cost {kind:>17} / off: loss steps {parts['loss_steps']['median_ratio_to_off']:.3f} "
                         f"{parts['loss_steps']['interval_95']}, whole loop {parts['loop']['median_ratio_to_off']:.3f} "
                         f"{parts['loop']['interval_95']} ({result['cost']['rounds']} rounds)")
    result["wall_s"] = time.monotonic() - started
    pathlib.Path(args.out).write_text(json.dumps(result))
    print("\n".join(lines))  # never empty: --settings takes one or more
    return result


if __name__ == "__main__":
    main()
