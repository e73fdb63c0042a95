"""Recipe and flags into (DFPOScriptArguments, DFPOConfig, ModelConfig); each bad input one line, before any load.

A bad input is a one-line RecipeError naming the field, where it was set and what it takes.

A recipe is a flat YAML mapping read by TRL's ``TrlParser``; an ``env:`` mapping sets environment variables;
command-line flags beat the recipe.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trl import ModelConfig, TrlParser

from ..config import DFPOConfig
from .args import DFPOScriptArguments, RecipeError
from .help import task_help, transform_help
from .plugins import as_module_list, flag_plugins, import_plugins
from .resume import imply_save_strategy

# Fields that moved in the libraries we build on: a recipe written for an older release gets the new name.
RENAMED_FIELDS = {
    "warmup_ratio": "warmup_steps (transformers 5 folded warmup_ratio into it: a float < 1 is a ratio)",
    "max_prompt_length": "max_prompt_length of the DFPO script arguments (TRL 1.16 dropped it from GRPOConfig)",
    "torch_dtype": "dtype",
    "dataset_name": "dataset",
    "dataset_train_split": "split",
    "dataset_test_split": "test_split",
}


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

    def parse_args_into_dataclasses(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        """Import the plugin modules (the flag's, else the recipe's) first: the dataclasses' checks read what they
        register, e.g. DFPOConfig's group_transform the transform registry (docs/extending.md)."""
        flagged = flag_plugins(sys.argv[1:] if args is None else args)
        import_plugins(flagged if flagged is not None else as_module_list(self.primary_action("plugins").default))
        return super().parse_args_into_dataclasses(args, *rest, **kwargs)

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
        "log_energy_buckets, token_weighting, delta_*. --plugins MODULE imports a module that registers "
        "transforms, tasks or rewards first.",
    )
    parser.primary_action("task").help = task_help()
    parser.primary_action("group_transform").help = transform_help()
    return parser


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
    args = imply_save_strategy(parser, _recipe_argv(sys.argv[1:] if argv is None else argv))
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
