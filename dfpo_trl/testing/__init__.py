"""``dfpo_trl.testing``: what a test or a benchmark of DFPO needs, offline and in seconds on a CPU
(docs/source/contributing.md).

Public and stable (this module's ``__all__``); :mod:`.measures` adds the library's own terms and meters:

- **Tiny builders.** A word-level tokenizer over :data:`WORDS`, a randomly initialised 2-layer Llama, a prompt set
  of single-digit additions, a noisy reward, a whole tiny trainer, the tiny ``dfpo-train`` recipe that runs the
  CLI end to end on that model saved as a checkpoint, and hand-made batches whose ratios are known exactly. No
  download: everything is built in the process, so a run's numbers depend only on the seed.
- **Observers.** :class:`DFPOCallback` (transformers' ``TrainerCallback`` with DFPO's ``on_pre_pass`` and
  ``on_micro_step`` events) and three helpers on top of it that record what each micro-step's objective returned.
  They read the values the trainer goes on to use; no name of the trainer or of a module is replaced, so a renamed
  internal cannot leave an observer silently watching nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..trl_hooks.callback import DFPOCallback

if TYPE_CHECKING:
    from ..groups.prepass import PrePassValues
    from ..objectives.step import StepObjective
    from ..objectives.weights import RowWeights

__all__ = [
    "WORDS",
    "DFPOCallback",
    "addition_dataset",
    "hand_batch",
    "last_digit_reward",
    "observe_micro_steps",
    "random_batch",
    "record_pre_passes",
    "record_row_weights",
    "save_tiny_chat_model",
    "tiny_config_kwargs",
    "tiny_model",
    "tiny_tokenizer",
    "tiny_trainer",
    "with_old_logps",
    "write_tiny_recipe",
]

#: The tiny vocabulary: padding, end and start tokens, digits, ``+ =`` and a few words of the addition prompts.
WORDS = ["<pad>", "<eos>", "<bos>"] + list("0123456789+=") + ["Compute", "Answer:", "is", "the", "so"]


# --------------------------------------------------------------------------------------------- tiny builders
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS` (unknown words read as padding), padding on the left so that prompts
    end where the completions start, as TRL's rollout expects."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_model(seed: int = 0, hidden: int = 32, layers: int = 2, tied: bool = False) -> LlamaForCausalLM:
    """A randomly initialised Llama over :data:`WORDS` (``torch.manual_seed(seed)`` first, so equal seeds give equal
    weights); ``tied`` ties the LM head to the input embedding."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def save_tiny_chat_model(path: str | Path, tied: bool = False) -> str | Path:
    """A tiny random Llama and the tokenizer with a chat template, saved to ``path`` as a real checkpoint is (what
    ``dfpo-train --model_name_or_path`` reads); returns ``path``."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = tiny_model(tied=tied)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def addition_dataset(n: int = 16, seed: int = 0) -> Dataset:
    """``n`` prompts ``Compute a + b =`` with single digits drawn from ``seed``, and their ``answer`` column."""
    pairs = torch.randint(0, 10, (n, 2), generator=torch.Generator().manual_seed(seed)).tolist()
    return Dataset.from_dict(
        {"prompt": [f"Compute {a} + {b} =" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )


def last_digit_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 when the completion contains the answer's last digit: noisy enough that a random model's groups have
    signal."""
    return [float(ans[-1] in comp) for comp, ans in zip(completions, answer, strict=True)]


def tiny_config_kwargs(**overrides: Any) -> dict[str, Any]:
    """The tiny runs' config fields (CPU, float32, seed 0, 4 completions per prompt, no saving, no reporting), with
    ``overrides`` on top: the keyword arguments of a ``DFPOConfig``."""
    kwargs: dict[str, Any] = dict(
        output_dir="/tmp/dfpo-test-out",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return kwargs


def tiny_trainer(
    trainer_cls: type | None = None, config_cls: type | None = None, seed: int = 0, model: Any = None, **overrides: Any
) -> Any:
    """A trainer (``DFPOTrainer`` unless ``trainer_cls``; its config ``DFPOConfig`` unless ``config_cls``) of
    :func:`tiny_model` ``(seed)`` (or ``model``) on :func:`addition_dataset` with :func:`last_digit_reward`, its
    config :func:`tiny_config_kwargs` ``(**overrides)``. The model is in train mode and one micro-step makes an
    optimizer step, so that ``trainer.compute_loss`` can be called directly on a hand-made batch."""
    if trainer_cls is None or config_cls is None:
        from ..config import DFPOConfig
        from ..trainer import DFPOTrainer

        trainer_cls, config_cls = trainer_cls or DFPOTrainer, config_cls or DFPOConfig
    trainer = trainer_cls(
        model=tiny_model(seed) if model is None else model,
        reward_funcs=last_digit_reward,
        args=config_cls(**tiny_config_kwargs(**overrides)),
        train_dataset=addition_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


#: The tiny ``dfpo-train`` run of :func:`write_tiny_recipe`: one group of G = 4 per micro-batch, two micro-steps per
#: rollout, two optimizer steps of GSPO's sequence-level loss with Min-Replace, sampled hot enough that groups have
#: signal; held-out evaluation on 4 problems. Nothing saved, nothing reported, CPU, float32, seed 0.
_TINY_RECIPE: dict[str, Any] = {
    "use_cpu": True,
    "bf16": False,
    "report_to": "none",
    "disable_tqdm": True,
    "save_strategy": "no",
    "save_model": False,
    "seed": 0,
    "train_size": 16,
    "eval_size": 4,
    "eval_max_new_tokens": 4,
    "eval_batch_size": 4,
    "num_generations": 4,
    "per_device_train_batch_size": 4,
    "steps_per_generation": 2,
    "max_completion_length": 4,
    "max_steps": 2,
    "logging_steps": 1,
    "learning_rate": 1.0e-3,
    "temperature": 1.5,
    "importance_sampling_level": "sequence",
    "loss_type": "grpo",
    "epsilon": 3.0e-4,
    "epsilon_high": 4.0e-4,
    "group_transform": "min_replace",
}


def write_tiny_recipe(
    directory: str | Path, model: str | Path | None = None, output_dir: str | Path | None = None, **changes: Any
) -> list[str]:
    """The tiny ``dfpo-train`` run in seconds on a CPU (2 steps, G = 4, GSPO with Min-Replace, held-out evaluation on
    4 problems), written once so that every end-to-end test or benchmark of the CLI runs the same recipe and states
    only what it changes. Writes ``directory/recipe.yaml`` with ``changes`` on top of those fields (a change to None
    drops the field, which then keeps its default) and returns the command line that runs it: the recipe's path, then
    ``--model_name_or_path model`` (e.g. :func:`save_tiny_chat_model`'s directory) and ``--output_dir output_dir``
    for those given, as a user gives them; append flags to it, or pass it to ``dfpo_trl.cli.main.main``."""
    recipe = {**_TINY_RECIPE, **changes}
    path = Path(directory) / "recipe.yaml"
    path.write_text(yaml.safe_dump({key: value for key, value in recipe.items() if value is not None}, sort_keys=False))
    argv = [str(path)]
    if model is not None:
        argv += ["--model_name_or_path", str(model)]
    if output_dir is not None:
        argv += ["--output_dir", str(output_dir)]
    return argv


# --------------------------------------------------------------------------------------------- hand-made batches
def hand_batch(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    prompt_len: int = 3,
    group_ids: torch.Tensor | None = None,
) -> dict[str, Any]:
    """A rollout batch as TRL's `_generate_and_score_completions` returns it."""
    rows = completion_ids.size(0)
    batch: dict[str, Any] = {
        "prompt_ids": torch.full((rows, prompt_len), 13, dtype=torch.long),
        "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    if old_per_token_logps is not None:
        batch["old_per_token_logps"] = old_per_token_logps
    if group_ids is not None:
        batch["group_ids"] = group_ids
    return batch


def random_batch(
    rows: int = 8, length: int = 6, seed: int = 1, spread: float = 0.3, group_size: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random completion ids, a mask with some padding, zero-mean advantages per group of ``group_size`` rows, and
    a per-token log-ratio (a shift per row plus noise) that puts some sequences outside the clip range: the
    inputs of :func:`with_old_logps`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(WORDS), (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, 4:] = 0
    mask[5, 3:] = 0
    rewards = torch.randn(rows, generator=g).view(-1, group_size)
    adv = (rewards - rewards.mean(1, keepdim=True)).view(-1)
    row_shift = spread * torch.randn(rows, 1, generator=g)
    return ids, mask, adv, row_shift + 0.1 * torch.randn(rows, length, generator=g)


def with_old_logps(
    trainer: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    log_ratio: torch.Tensor,
    **extra: Any,
) -> dict[str, Any]:
    """:func:`hand_batch` with old log-probs that are the trainer's current ones minus ``log_ratio`` (computed with
    TRL's own forward), so every ratio ``compute_loss`` sees is known exactly; ``extra`` adds fields (``group_ids``)."""
    batch = hand_batch(ids, mask, adv, None)
    with torch.no_grad():
        cur, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], ids], 1),
            torch.cat([batch["prompt_mask"], mask], 1), ids.size(1),
        )
    batch["old_per_token_logps"] = cur - log_ratio
    batch.update(extra)
    return batch


# ------------------------------------------------------------------------------------------------- observers
class _Calling(DFPOCallback):
    """The callback behind the helpers below: hands each event's value to a plain function."""

    def __init__(
        self,
        micro_step: Callable[[StepObjective], None] | None = None,
        pre_pass: Callable[[PrePassValues], None] | None = None,
    ) -> None:
        self.micro_step, self.pre_pass = micro_step, pre_pass

    def on_pre_pass(self, args: Any, state: Any, control: Any, *, values: PrePassValues, **kwargs: Any) -> None:
        if self.pre_pass is not None:
            self.pre_pass(values)

    def on_micro_step(self, args: Any, state: Any, control: Any, *, step: StepObjective, **kwargs: Any) -> None:
        if self.micro_step is not None:
            self.micro_step(step)


def observe_micro_steps(trainer: Any, observe: Callable[[StepObjective], None]) -> DFPOCallback:
    """Call ``observe`` with the :class:`~dfpo_trl.objectives.step.StepObjective` of each loss micro-step of
    ``trainer``, as its loss uses it; returns the callback (``trainer.remove_callback`` stops it)."""
    callback = _Calling(micro_step=observe)
    trainer.add_callback(callback)
    return callback


def record_row_weights(trainer: Any) -> list[RowWeights]:
    """A list that fills, in order, with the sequence weights (s̄, s̃, U, two-sided flags) each loss micro-step of
    ``trainer`` uses: the ``weights`` of its objective's values, when it has any."""
    used: list[RowWeights] = []

    def recording(step: StepObjective) -> None:
        if step.values.weights is not None:
            used.append(step.values.weights)

    observe_micro_steps(trainer, recording)
    return used


def record_pre_passes(trainer: Any) -> list[PrePassValues]:
    """A list that fills, in order, with the :class:`~dfpo_trl.groups.prepass.PrePassValues` of each pre-pass of
    ``trainer`` (group layout ``pre_pass``)."""
    values: list[PrePassValues] = []
    trainer.add_callback(_Calling(pre_pass=values.append))
    return values
