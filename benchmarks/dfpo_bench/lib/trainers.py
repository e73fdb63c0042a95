"""The benchmarked methods and how a script sets up their trainers: the method table (trainer, config overrides,
reference), model/tokenizer loading and random configs, the tasks and rewards, config building.

Every benchmark names methods by the keys of :data:`METHODS`. A method is a trainer class, a config class and
the config overrides that make it that method (docs/source/concepts/reference-runs.md settings: GSPO ε = 3e-4/4e-4, GRPO
= TRL's DAPO loss with ε = 0.2/0.28). Each method also names the reference it must be compared with in the same gradient
form (docs/source/concepts/design.md): a ratio-form transform with GSPO, a score-form transform with ``none_score``, the
token-level fixes with TRL's GRPO.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.testing.measures import sign_aware_post_clip
from trl import GRPOConfig, GRPOTrainer

GPU_MODEL_PATH = "/root/models/smollm2-135m-instruct"

# docs/source/concepts/reference-runs.md: GSPO with ε = 3e-4 / 4e-4 (sequence level); GRPO = TRL's DAPO loss with ε =
# 0.2 / 0.28.
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4)
DAPO = dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.2, epsilon_high=0.28)


@dataclass(frozen=True)
class Method:
    """One benchmarked objective: which trainer, which overrides, and what to compare it with."""

    name: str
    dfpo: bool  # needs DFPOTrainer / DFPOConfig (False: TRL's own GRPOTrainer, or DFPOTrainer if asked)
    overrides: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None  # the method it is compared with, in the same gradient form
    label: str = ""
    level: str = "sequence"


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("gspo", False, GSPO, None, "GSPO"),
        Method("grpo", False, DAPO, None, "GRPO (DAPO loss)", "token"),
        Method("min_replace", True, {**GSPO, "group_transform": "min_replace"}, "gspo", "Min-Replace"),
        Method("orth_proj", True, {**GSPO, "group_transform": "orth_proj"}, "gspo", "Orth-Proj"),
        Method(
            "positive_orth_proj", True, {**GSPO, "group_transform": "positive_orth_proj"}, "gspo",
            "Positive Orth-Proj",
        ),
        Method(
            "truncate_rebalance", True, {**GSPO, "group_transform": "truncate_rebalance"}, "gspo",
            "Truncate-Rebalance",
        ),
        Method("none_score", True, {**GSPO, "transform_gradient": "score"}, "gspo", "none (score form)"),
        Method(
            "min_replace_score", True, {**GSPO, "group_transform": "min_replace", "transform_gradient": "score"},
            "none_score", "Min-Replace (score form)",
        ),
        Method("grpo_fix", True, {**DAPO, "symmetric_clip": True}, "grpo", "GRPO-fix", "token"),
        Method("delta", True, {**DAPO, "token_weighting": "delta"}, "grpo", "DelTA", "token"),
        # Diagnostic: GSPO through DFPOTrainer (group-granular batches, mechanism metrics), no transform.
        Method("dfpo_none", True, dict(GSPO), "gspo", "GSPO via DFPOTrainer"),
        # Gradient-exact cancellation (docs/source/concepts/cancellation.md): the transform balances the surviving
        # gradients' shared-token coefficients, not the weights.
        Method(
            "min_replace_grad", True, {**GSPO, "group_transform": "min_replace", "cancellation_target": "gradient"},
            "gspo", "Min-Replace (gradient)",
        ),
        Method(
            "positive_orth_proj_grad", True,
            {**GSPO, "group_transform": "positive_orth_proj", "cancellation_target": "gradient"},
            "gspo", "Positive Orth-Proj (gradient)",
        ),
        Method(
            "min_replace_grad_zero", True,
            {**GSPO, "group_transform": "min_replace", "cancellation_target": "gradient",
             "cancellation_one_sided": "zero"},
            "gspo", "Min-Replace (gradient, one-sided zero)",
        ),
    ]
}

def label(method: str) -> str:
    """A method's name in tables and figures (its own name when it is not in the table)."""
    return METHODS[method].label if method in METHODS else method


def delta_available() -> bool:
    """DelTA is benchmarked only when this dfpo_trl has the ``token_weighting`` config field."""
    return "token_weighting" in DFPOConfig.__dataclass_fields__


def missing_config_fields(name: str) -> list[str]:
    """Config fields a method sets that this dfpo_trl's DFPOConfig (or GRPOConfig) lacks."""
    fields = set(DFPOConfig.__dataclass_fields__)
    return sorted(k for k in METHODS[name].overrides if k not in fields)


def _with_delta(names: list[str]) -> list[str]:
    return [n for n in names if n != "delta" or delta_available()]


OVERHEAD_METHODS = _with_delta(
    ["gspo", "grpo", "min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance", "grpo_fix", "delta"]
)
def check_methods(names: list[str], allow_missing: bool = False) -> list[str]:
    """Refuse unknown names, and methods whose config fields this dfpo_trl lacks (DelTA, the gradient-exact
    cancellation's ``cancellation_*``), with the fix. ``allow_missing``: run the latter without those fields (smoke
    tests)."""
    for name in names:
        if name not in METHODS:
            raise SystemExit(f"unknown method {name!r}; known: {', '.join(METHODS)}")
        if name == "delta" and not delta_available():
            raise SystemExit("method 'delta' needs DFPOConfig.token_weighting, which this dfpo_trl lacks")
        missing = missing_config_fields(name)
        if missing and not allow_missing:
            raise SystemExit(
                f"method {name!r} needs DFPOConfig field(s) {', '.join(missing)}, which this dfpo_trl lacks "
                "(docs/source/concepts/cancellation.md); --allow-missing-fields runs it without them (CPU smoke only)"
            )
    return names


def trainer_and_config(
    name: str, baseline_trainer: str = "trl", allow_missing: bool = False
) -> tuple[type, type, dict[str, Any]]:
    """(trainer class, config class, overrides) of a method. ``baseline_trainer="dfpo"`` runs gspo/grpo through
    DFPOTrainer with no DFPO option (the same loss and gradients as TRL, tested), so that every method has
    group-granular batches and mechanism metrics."""
    method = METHODS[name]
    if method.dfpo or baseline_trainer == "dfpo":
        overrides = dict(method.overrides)
        if allow_missing:
            for key in missing_config_fields(name):
                overrides.pop(key)
        baseline = not method.dfpo or name == "dfpo_none"
        if baseline and "group_granular_batches" in DFPOConfig.__dataclass_fields__:
            # DFPO off keeps TRL's per-sample order unless asked: ask, for the mechanism metrics.
            overrides["group_granular_batches"] = True
        return DFPOTrainer, DFPOConfig, overrides
    return GRPOTrainer, GRPOConfig, dict(method.overrides)


# ------------------------------------------------------------------------------------------ models, data
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
    """A randomly initialised model's config. ``tiny``: a 2-layer Llama for CPU smoke tests. ``qwen3-1.7b``:
    sized like Qwen3-1.7B (hidden 2048, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, tied
    embeddings) with the tokenizer's vocabulary (SmolLM2's 49,152 instead of Qwen3's 151,936), so about 1.5B
    parameters. ``smollm2-1.7b``: SmolLM2-1.7B's architecture (Llama, hidden 2048, 24 layers, 32 heads, tied
    embeddings), 1.7B parameters."""
    from transformers import LlamaConfig, Qwen3Config

    # No pad_token_id in the config (padding uses the tokenizer's): with one, the embedding row of the pad id is
    # initialised to zero, left-padded positions carry exact-zero hidden states through every layer, and on the
    # H100/H200 every Qwen3-1.7B- or SmolLM2-1.7B-sized random init got non-finite gradients in its first
    # backward pass, the first NaN appearing in an RMSNorm's backward (results/NOTES.md). A pretrained model is
    # unaffected: its pad row is trained, not zero.
    ids = dict(
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
    )
    if name == "tiny":
        return LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
            **ids,
        )
    if name == "qwen3-1.7b":
        return Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rms_norm_eps=1e-6, tie_word_embeddings=True, **ids,
        )
    if name == "smollm2-135m":  # SmolLM2-135M's architecture (Llama, hidden 576, 30 layers, 9 heads, 3 KV heads)
        return LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True, **ids,
        )
    if name == "smollm2-1.7b":
        return LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192, rope_theta=130000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True, **ids,
        )
    raise SystemExit(f"unknown --random-config {name!r}; use one of {', '.join(RANDOM_CONFIGS)}")


RANDOM_CONFIGS = ("tiny", "qwen3-1.7b", "smollm2-1.7b", "smollm2-135m")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(
    model_path: str | None, random_name: str | None, tokenizer: Any, dtype: torch.dtype, device: str, seed: int
) -> torch.nn.Module:
    """A pretrained checkpoint (``model_path``) or a random init (``random_name``), on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    if model_path:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        return model.to(device)
    config = random_config(random_name or "tiny", tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


class IdParityReward:
    """Reward for random models, whose completions never solve the task: 1 when the sum of the completion's
    token ids is odd. About half the group scores 1, so advantages are non-zero and every transform works on
    realistic inputs (arithmetic would give all-zero rewards, hence all-zero advantages)."""

    __name__ = "id_parity"

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any):
        return [float(sum(ids) % 2) for ids in completion_ids]


def keep_per_sample_order(trainer: Any) -> None:
    """In the pre-pass layout, keep TRL's per-sample order of each rollout (the layout before DFPO laid groups in
    consecutive rows): the regrouping is replaced by the whole-group marking alone. For measuring what the order
    saves; the pre-pass stays exact either way."""
    layout = trainer.layout

    def per_sample(buffered: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        layout._mark_whole_groups(buffered)
        return buffered

    layout.regroup = per_sample


BENCHMARK_TASKS = ("arithmetic", "sum_sentence")  # tasks of dfpo_trl.cli.tasks the learning benchmark runs on


def task_and_rewards(reward: str, task_name: str = "arithmetic") -> tuple[Any, list[Any]]:
    """A task of ``dfpo_trl.cli.tasks`` (``arithmetic`` or ``sum_sentence``) and the reward functions to train with:
    the task's own (``reward="task"``, or ``"arithmetic"`` for backward compatibility) or ``id_parity``."""
    from dfpo_trl.cli import get_task

    if task_name not in BENCHMARK_TASKS:
        raise SystemExit(f"unknown task {task_name!r}; use one of {', '.join(BENCHMARK_TASKS)}")
    task = get_task(task_name)
    if reward in ("task", "arithmetic"):
        return task, list(task.reward_funcs)
    if reward == "id_parity":
        return task, [IdParityReward()]
    raise SystemExit(f"unknown reward {reward!r}; use 'task' or 'id_parity'")


def config_kwargs(
    *,
    device: str,
    seed: int,
    max_steps: int,
    per_device_train_batch_size: int,
    num_generations: int,
    steps_per_generation: int,
    max_completion_length: int,
    learning_rate: float,
    temperature: float = 1.0,
    beta: float = 0.0,
    fixed_length: bool = False,
    gradient_checkpointing: bool = True,
    output_dir: str | None = None,
) -> dict[str, Any]:
    """The GRPOConfig keyword arguments shared by every method (off-policy: steps_per_generation >
    gradient_accumulation_steps = 1). ``fixed_length`` forces every completion to ``max_completion_length``
    tokens (min_new_tokens), so every method trains on tensors of the same shape (timing runs)."""
    on_cpu = not device.startswith("cuda")
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="dfpo-bench-"),
        seed=seed, max_steps=max_steps, per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=1, num_generations=num_generations, steps_per_generation=steps_per_generation,
        max_completion_length=max_completion_length, learning_rate=learning_rate, temperature=temperature,
        beta=beta, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing, use_cpu=on_cpu, bf16=not on_cpu,
    )
    if fixed_length:
        kwargs["generation_kwargs"] = {"min_new_tokens": max_completion_length}
    return kwargs


def make_inputs(
    groups: int, group_size: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Realistic inputs: post-clip ratios around 1 and GRPO advantages of 0/1 rewards (many ties)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    s = torch.exp(0.3 * torch.randn(groups, group_size, generator=gen))
    rewards = (torch.rand(groups, group_size, generator=gen) < 0.4).float()
    adv = rewards - rewards.mean(dim=-1, keepdim=True)
    adv = adv / (adv.std(dim=-1, keepdim=True) + 1e-4)
    s_bar = sign_aware_post_clip(s, adv, 0.2, 0.28)
    return s_bar.to(device=device, dtype=dtype), adv.to(device=device, dtype=dtype)
