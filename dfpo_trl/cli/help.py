"""``dfpo-train --help``: DFPO's fields and the script arguments with their defaults, and the task list.

Rendered from a field table (:mod:`.fields`): the stored one (``field_table.json``), so that ``--help`` answers
without importing torch or TRL, or, when ``--plugins`` may have registered transforms or tasks, one built from the
parser after importing them. ``--help-all`` is argparse's own help over every field (TRL's GRPOConfig,
transformers' TrainingArguments, ModelConfig).
"""

from __future__ import annotations

import textwrap
from typing import Any

__all__ = ["COMMON_TRL_FIELDS", "LEADING_FIELDS", "short_help"]

# What most runs set, first in `--help` with their defaults and help (from whichever dataclass holds them).
LEADING_FIELDS = (
    "model_name_or_path", "task", "output_dir", "max_steps", "learning_rate", "num_generations",
    "per_device_train_batch_size", "steps_per_generation", "use_cpu", "seed",
)  # fmt: skip
# What dfpo-train adds to a leading field's own help.
LEADING_NOTES = {
    "model_name_or_path": "Unset: the embedded SmolLM2-135M-Instruct, offline (converted once on first use).",
    "output_dir": "Recipes set it (e.g. outputs/smollm2_cpu); an earlier run's results there move to previous_run/ "
    "(then previous_run.1/, ...; never deleted) once the new run's first optimizer step has ended.",
    "max_steps": "dfpo-train refuses 0 and values below -1; -1 trains num_train_epochs epochs.",
}
# TRL / transformers fields a DFPO recipe sets most often, named in the short help (their help: --help-all).
COMMON_TRL_FIELDS = (
    "model_name_or_path", "output_dir", "learning_rate", "max_steps", "num_generations",
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
    "importance_sampling_level", "loss_type", "epsilon", "epsilon_high", "beta", "temperature",
    "max_completion_length", "use_vllm", "use_cpu", "bf16", "seed", "use_peft", "report_to",
)  # fmt: skip


def short_help(
    table: dict[str, Any], width: int = 100, recipe: str | None = None, settings: dict[str, Any] | None = None
) -> str:
    """``dfpo-train --help``: usage, the fields most runs set, DFPO's fields, then the other script arguments, each
    with its default and help; the other common TRL/transformers fields only by name (``--help-all``: all). With
    ``recipe`` (``dfpo-train RECIPE.yaml --help``), a field the recipe sets shows the recipe's value beside the
    default: "--seed (default: 42)" beside a recipe that sets 0 told the user the wrong seed."""
    settings = settings or {}

    def entry(name: str) -> str:
        spec = table["entries"][name]
        head = f"  --{name}"
        notes = []
        if spec["default"] is not None:
            notes.append(f"default: {spec['default']}")
            if spec["negated"]:
                notes.append(f"{spec['negated']} turns it off")
        if recipe is not None and name in settings:
            notes.append(f"{recipe} sets {settings[name]!r}")
        if notes:
            head += f" ({'; '.join(notes)})"
        text = " ".join(p for p in (spec["help"], LEADING_NOTES.get(name, "")) if p)
        body = textwrap.fill(text, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
        return f"{head}\n{body}"

    others = [name for name in COMMON_TRL_FIELDS if name not in LEADING_FIELDS]

    lines = [
        "usage: dfpo-train RECIPE.yaml [--field value ...]",
        "       dfpo-train --help-all    (every field: TRL's GRPOConfig, transformers' TrainingArguments, ModelConfig)",
        "",
        "Train with DFPO objectives (a TRL GRPOTrainer subclass) from a flat YAML recipe; any field can be set in the",
        "recipe or as a flag, and flags beat the recipe. Example: dfpo-train recipes/smollm2_cpu.yaml --max_steps 10",
        "",
        "the fields most runs set:",
        *(entry(name) for name in LEADING_FIELDS),
        "",
        "DFPO fields of DFPOConfig: the in-group transform that lets shared tokens' gradients cancel, GRPO-fix's",
        "symmetric clip, DelTA's token weights, the mechanism metrics (docs/source/concepts/: design.md, delta.md,",
        "metrics.md):",
        *(entry(name) for name in table["dfpo_fields"]),
        "",
        "the other script arguments (data, held-out evaluation, outputs):",
        *(entry(name) for name in table["script_fields"] if name not in LEADING_FIELDS),
        "",
        "other TRL fields recipes often set (help: --help-all):",
        textwrap.fill(", ".join(others), width=width, initial_indent="  ", subsequent_indent="  "),
    ]
    return "\n".join(lines) + "\n"
