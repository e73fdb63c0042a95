"""``dfpo-train --help``: DFPO's fields and the script arguments with their defaults, and the task list.

``--help-all`` is argparse's own help over every field (TRL's GRPOConfig, transformers' TrainingArguments,
ModelConfig); ``--help`` is this shorter one.
"""

from __future__ import annotations

import textwrap
from dataclasses import fields
from typing import TYPE_CHECKING

from trl import GRPOConfig

from ..config import DFPOConfig
from ..objectives.transforms import TRANSFORMS
from ..tasks import TASKS
from .args import DFPOScriptArguments

if TYPE_CHECKING:
    from .parser import DFPOParser

__all__ = ["dfpo_field_names", "short_help", "task_help", "transform_help"]

# One line per built-in task in `--help`; a task registered without an entry here is described by the first
# sentence of its factory's docstring.
TASK_SUMMARIES = {
    "arithmetic": "single-digit addition, reward on the last number of the completion; offline",
    "sum_sentence": "the same problems answered in one required sentence: a group's completions share a long "
    "prefix, where shared-token cancellation acts; offline",
    "math": "any `datasets` dataset graded by math-verify; set dataset, problem_column and answer_column",
}


def task_help() -> str:
    """The ``task`` field's help, listing every task registered in :data:`dfpo_trl.tasks.TASKS`."""

    def summary(name: str) -> str:
        if name in TASK_SUMMARIES:
            return TASK_SUMMARIES[name]
        doc = " ".join((getattr(TASKS[name], "__doc__", None) or "").split())
        return doc.split(". ")[0].rstrip(".") or "registered with dfpo_trl.tasks.register_task"

    listed = "; ".join(f"'{name}' ({summary(name)})" for name in TASKS)
    return (
        f"Task: {listed}; a name registered with dfpo_trl.tasks.register_task; or an import path "
        "'package.module:factory' returning a dfpo_trl.tasks.Task."
    )


def transform_help() -> str:
    """The ``group_transform`` field's help (it lists the built-ins), then every transform registered beyond them
    (by a plugin, docs/extending.md) with its balance condition, as the registry holds them now."""
    spec = next(f for f in fields(DFPOConfig) if f.name == "group_transform")
    added = [f"'{name}' (balances: {entry.balance})" for name, entry in TRANSFORMS.items() if not entry.builtin]
    extra = f" Registered by plugins: {', '.join(added)}." if added else ""
    return spec.metadata["help"] + extra.replace("%", "%%")  # argparse formats help with %


# TRL / transformers fields a DFPO recipe sets most often, named in the short help (their help: --help-all).
COMMON_TRL_FIELDS = (
    "model_name_or_path", "output_dir", "learning_rate", "max_steps", "num_generations",
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
    "importance_sampling_level", "loss_type", "epsilon", "epsilon_high", "beta", "temperature",
    "max_completion_length", "use_vllm", "use_cpu", "bf16", "seed", "use_peft", "report_to",
)  # fmt: skip


def dfpo_field_names() -> list[str]:
    """The fields DFPOConfig adds to GRPOConfig, in declaration order."""
    inherited = {f.name for f in fields(GRPOConfig)}
    return [f.name for f in fields(DFPOConfig) if f.name not in inherited]


def short_help(parser: DFPOParser, width: int = 100) -> str:
    """``dfpo-train --help``: usage, DFPO's fields and then the script arguments, each with its default and help;
    the thousand-odd TRL/transformers fields only by name (``--help-all`` prints them all)."""

    def entry(name: str) -> str:
        action = parser.primary_action(name)
        default = action.default
        head = f"  --{name}"
        if default is not None:
            head += f" (default: {default!r}"
            negated = parser.negated_flag(name)
            head += f"; {negated} turns it off)" if negated and default is True else ")"
        body = textwrap.fill(
            " ".join((action.help or "").replace("%%", "%").split()),
            width=width,
            initial_indent=" " * 6,
            subsequent_indent=" " * 6,
        )
        return f"{head}\n{body}"

    lines = [
        "usage: dfpo-train RECIPE.yaml [--field value ...]",
        "       dfpo-train --help-all    (every field: TRL's GRPOConfig, transformers' TrainingArguments, ModelConfig)",
        "",
        "Train with DFPO objectives (a TRL GRPOTrainer subclass) from a flat YAML recipe; any field can be set in the",
        "recipe or as a flag, and flags beat the recipe. Example: dfpo-train recipes/smollm2_cpu.yaml --max_steps 10",
        "",
        "DFPO fields of DFPOConfig: the in-group transform that lets shared tokens' gradients cancel, GRPO-fix's",
        "symmetric clip, DelTA's token weights, the mechanism metrics (docs/design.md, delta.md, metrics.md):",
        *(entry(name) for name in dfpo_field_names()),
        "",
        "script arguments (task, data, held-out evaluation, outputs):",
        *(entry(f.name) for f in fields(DFPOScriptArguments)),
        "",
        "common TRL fields (help: --help-all):",
        textwrap.fill(", ".join(COMMON_TRL_FIELDS), width=width, initial_indent="  ", subsequent_indent="  "),
    ]
    return "\n".join(lines) + "\n"
