"""The benchmarked methods and how a script sets up their trainers: the method table (a label and the config overrides
of each, docs/source/concepts/reference-runs.md), model and tokenizer loading, random configs, rewards, shared config.
``gspo`` and ``grpo`` run through TRL's own ``GRPOTrainer``; every other method through ``DFPOTrainer``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from dfpo_trl import DFPOConfig, DFPOTrainer
from trl import GRPOConfig, GRPOTrainer

GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4)
DAPO = dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
GRADIENT = {"cancellation_target": "gradient"}
TRL_METHODS = ("gspo", "grpo")
METHODS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (label, overrides)
    "gspo": ("GSPO", GSPO),
    "grpo": ("GRPO (DAPO loss)", DAPO),
    "min_replace": ("Min-Replace", {**GSPO, "group_transform": "min_replace"}),
    "orth_proj": ("Orth-Proj", {**GSPO, "group_transform": "orth_proj"}),
    "positive_orth_proj": ("Positive Orth-Proj", {**GSPO, "group_transform": "positive_orth_proj"}),
    "truncate_rebalance": ("Truncate-Rebalance", {**GSPO, "group_transform": "truncate_rebalance"}),
    "none_score": ("none (score form)", {**GSPO, "transform_gradient": "score"}),
    "grpo_fix": ("GRPO-fix", {**DAPO, "symmetric_clip": True}),
    "delta": ("DelTA", {**DAPO, "token_weighting": "delta"}),
    "dfpo_none": ("GSPO via DFPOTrainer", GSPO),  # no transform: group-granular batches, mechanism metrics
    # the gradient-exact cancellation (docs/source/concepts/cancellation.md)
    "min_replace_grad": ("Min-Replace (gradient)", {**GSPO, "group_transform": "min_replace", **GRADIENT}),
    "positive_orth_proj_grad": ("Positive Orth-Proj (gradient)",
                                {**GSPO, "group_transform": "positive_orth_proj", **GRADIENT}),
    "min_replace_grad_zero": ("Min-Replace (gradient, one-sided zero)",
                              {**GSPO, "group_transform": "min_replace", **GRADIENT, "cancellation_one_sided": "zero"})}
OVERHEAD_METHODS = ["gspo", "grpo", "min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance", "grpo_fix",
                    "delta"]
RANDOM_CONFIGS = ("tiny", "qwen3-1.7b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GPU_MODEL_PATH = "/root/models/smollm2-135m-instruct"


def label(method: str) -> str:
    """A method's name in tables and figures (its own name when it is not in the table)."""
    return METHODS[method][0] if method in METHODS else method


def trainer_and_config(name: str, baseline_trainer: str = "trl") -> tuple[type, type, dict[str, Any]]:
    """(trainer class, config class, overrides) of a method. ``baseline_trainer="dfpo"`` runs gspo and grpo through
    DFPOTrainer with no DFPO option (TRL's loss and gradients, tested) and group-granular batches, as ``dfpo_none``,
    so that every method logs the mechanism metrics."""
    overrides = dict(METHODS[name][1])
    if name in TRL_METHODS and baseline_trainer == "trl":
        return GRPOTrainer, GRPOConfig, overrides
    if name in (*TRL_METHODS, "dfpo_none"):
        overrides["group_granular_batches"] = True  # DFPO off keeps TRL's per-sample order unless asked
    return DFPOTrainer, DFPOConfig, overrides


def default_tokenizer_path() -> str:
    """The GPU kit's checkpoint if present, else the embedded SmolLM2 (converted once, offline)."""
    if os.path.isdir(GPU_MODEL_PATH):
        return GPU_MODEL_PATH
    from dfpo_trl.cli import embedded_model_path

    return str(embedded_model_path())


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise SystemExit(f"tokenizer at {path} has no chat template; the arithmetic task is conversational")
    return tokenizer


def random_config(name: str, tokenizer: Any) -> Any:
    """A random init's config: ``tiny``, a 2-layer Llama for CPU checks; ``qwen3-1.7b``, Qwen3-1.7B's shape with the
    tokenizer's vocabulary (about 1.5B parameters with SmolLM2's). No ``pad_token_id``: with one, the pad row of the
    embedding starts at zero, and on the H100/H200 every 1.7B-sized random init got non-finite gradients in its first
    backward (test_benchmark_helpers.py holds this)."""
    from transformers import LlamaConfig, Qwen3Config

    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=bos, vocab_size=len(tokenizer),
               tie_word_embeddings=True)
    if name == "tiny":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=512, **ids)
    if name == "qwen3-1.7b":
        return Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, **ids)
    raise SystemExit(f"unknown --random-config {name!r}; use one of {', '.join(RANDOM_CONFIGS)}")


def build_model(model_path: str | None, random_name: str | None, tokenizer: Any, dtype: torch.dtype, device: str,
                seed: int) -> torch.nn.Module:
    """A pretrained checkpoint (``model_path``) or a random init (``random_name``), on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    if model_path:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(random_config(random_name or "tiny", tokenizer), dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def id_parity(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    """For random models, whose completions never solve the task: 1 when the sum of the completion's token ids is
    odd, so about half of a group scores 1 and the advantages are not all zero."""
    return [float(sum(ids) % 2) for ids in completion_ids]


def config_kwargs(*, device: str, seed: int, max_steps: int, per_device_train_batch_size: int, num_generations: int,
                  steps_per_generation: int, max_completion_length: int, learning_rate: float,
                  fixed_length: bool = False, gradient_checkpointing: bool = True,
                  output_dir: str | None = None) -> dict[str, Any]:
    """The GRPOConfig keyword arguments every method shares (off-policy: steps_per_generation > gradient accumulation
    = 1). ``fixed_length`` makes every completion ``max_completion_length`` tokens (min_new_tokens), so every method
    trains on tensors of the same shape."""
    on_cpu = not device.startswith("cuda")
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="dfpo-bench-"), seed=seed, max_steps=max_steps,
        per_device_train_batch_size=per_device_train_batch_size, gradient_accumulation_steps=1,
        num_generations=num_generations, steps_per_generation=steps_per_generation,
        max_completion_length=max_completion_length, learning_rate=learning_rate, temperature=1.0, beta=0.0,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing, use_cpu=on_cpu, bf16=not on_cpu)
    if fixed_length:
        kwargs["generation_kwargs"] = {"min_new_tokens": max_completion_length}
    return kwargs
