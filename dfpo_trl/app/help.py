"""``dfpo-train --help``: DFPO's fields and the script arguments with their defaults, and the task list.

Rendered from a field table (:mod:`.fields`): the stored one (``field_table.py``), so that ``--help`` answers
without importing torch or TRL, or, when ``--plugins`` may have registered transforms or tasks, one built from the
parser after importing them. ``--help-all`` is argparse's own help over every field (TRL's GRPOConfig,
transformers' TrainingArguments, ModelConfig).
"""

from __future__ import annotations

import textwrap
from typing import Any

__all__ = ["COMMON_TRL_FIELDS", "short_help"]

# TRL / transformers fields a DFPO recipe sets most often, named in the short help (their help: --help-all).
COMMON_TRL_FIELDS = (
    "model_name_or_path", "output_dir", "learning_rate", "max_steps", "num_generations",
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
    "importance_sampling_level", "loss_type", "epsilon", "epsilon_high", "beta", "temperature",
    "max_completion_length", "use_vllm", "use_cpu", "bf16", "seed", "use_peft", "report_to",
)  # fmt: skip


def short_help(table: dict[str, Any], width: int = 100) -> str:
    """``dfpo-train --help``: usage, DFPO's fields and then the script arguments, each with its default and help;
    the thousand-odd TRL/transformers fields only by name (``--help-all`` prints them all)."""

    def entry(name: str) -> str:
        spec = table["entries"][name]
        head = f"  --{name}"
        if spec["default"] is not None:
            head += f" (default: {spec['default']}"
            head += f"; {spec['negated']} turns it off)" if spec["negated"] else ")"
        body = textwrap.fill(spec["help"], width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
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
        *(entry(name) for name in table["dfpo_fields"]),
        "",
        "script arguments (task, data, held-out evaluation, outputs):",
        *(entry(name) for name in table["script_fields"]),
        "",
        "common TRL fields (help: --help-all):",
        textwrap.fill(", ".join(COMMON_TRL_FIELDS), width=width, initial_indent="  ", subsequent_indent="  "),
    ]
    return "\n".join(lines) + "\n"
