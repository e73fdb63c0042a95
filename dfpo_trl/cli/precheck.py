"""Checks of a command line that need no model, no data and no torch: run first, so that a mistake costs a second.

:func:`precheck` reads the recipe (it exists, it is YAML), every field name in it and on the command line, and the
values that name paths or the run's length (``output_dir``, ``resume_from_checkpoint``, ``max_steps``), against the
stored field table (:mod:`.fields`), before ``dfpo-train`` imports torch, transformers and TRL (seconds). Standard
library and YAML only. The full parse (:mod:`.parser`) then checks the values' types and each field's own rules,
with the same messages for what both check.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .args import RecipeError
from .choices import canonical, choice_problem, set_flag_value
from .local_inputs import check_local_inputs
from .paths import check_output_dir, resolve_resume_checkpoint
from .plugins import as_module_list, flag_plugins, import_plugins
from .resume import save_strategy_problem
from .values import VALUE_FIELDS, check_values, registered_names

__all__ = [
    "PRECHECKED_FIELDS", "RENAMED_FIELDS", "CommandLine", "check_max_steps", "closed_options", "field_origin",
    "given_output_dir", "library_versions", "normalise_choices", "precheck", "read_command_line", "read_field_table",
    "read_recipe", "recipe_argv", "recipe_line", "split_recipe", "stored_field_table", "stored_help_all",
    "unknown_message", "yaml_error",
]  # fmt: skip

#: The stored field table: package data (pyproject.toml), written by ``python -m dfpo_trl.cli.fields``.
TABLE_FILE = Path(__file__).with_name("field_table.json")
#: ``--help-all``'s text (argparse's help over every field), written with the table from the same parser.
HELP_ALL_FILE = Path(__file__).with_name("help_all.txt")

# The fields whose values precheck reads (their defaults are in the field table).
PRECHECKED_FIELDS = (
    "max_steps", "output_dir", "resume_from_checkpoint", *VALUE_FIELDS, "model_name_or_path", "eval_size",
    "skip_eval", "use_vllm", "num_generations_eval", "per_device_eval_batch_size", "disable_tqdm",
)  # fmt: skip

# Fields that moved in the libraries we build on: a recipe written for an older release gets the new name.
RENAMED_FIELDS = {
    "warmup_ratio": "warmup_steps (transformers 5 folded warmup_ratio into it: a float < 1 is a ratio)",
    "max_prompt_length": "max_prompt_length of the DFPO script arguments (TRL 1.16 dropped it from GRPOConfig)",
    "torch_dtype": "dtype",
    "dataset_name": "dataset",
    "dataset_train_split": "split",
    "dataset_test_split": "test_split",
}


def library_versions() -> dict[str, str]:
    """The installed TRL and transformers versions: the field table holds their fields."""
    from importlib.metadata import version

    return {name: version(name) for name in ("trl", "transformers")}


@functools.cache
def read_field_table() -> dict[str, Any]:
    """The stored field table (``field_table.json``, written by ``python -m dfpo_trl.cli.fields``), read once."""
    return json.loads(TABLE_FILE.read_text(encoding="utf-8"))


def stored_help_all() -> str | None:
    """``--help-all``'s stored text when the stored field table is the installed libraries' (both are written
    together), else None."""
    if stored_field_table() is None or not HELP_ALL_FILE.is_file():
        return None
    return HELP_ALL_FILE.read_text(encoding="utf-8")


def stored_field_table() -> dict[str, Any] | None:
    """The stored field table when it was built with the installed TRL and transformers, else None."""
    table = read_field_table()
    return table if table.get("versions") == library_versions() else None


def recipe_argv(argv: Sequence[str]) -> list[str]:
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


def split_recipe(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the recipe's path, the flags) of a command line as :func:`recipe_argv` returns it: the path after
    ``--config`` (None without one), and every item but ``--config`` and that path."""
    recipe = args[args.index("--config") + 1] if "--config" in args else None
    flags = [a for i, a in enumerate(args) if not (a == "--config" or (i > 0 and args[i - 1] == "--config"))]
    return recipe, flags


def yaml_error(recipe: str, exc: Any) -> RecipeError:
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


def read_recipe(recipe: str) -> dict[str, Any]:
    """The recipe's fields (its ``env:`` mapping left out). One that is not YAML, is empty, or is not a mapping of
    fields is a one-line :class:`RecipeError` naming the file (and for YAML, the line) and the fix."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(recipe).read_text())
    except yaml.YAMLError as exc:
        raise yaml_error(recipe, exc) from None
    example = "one 'field: value' per line, e.g. 'max_steps: 10' (recipes/smollm2_cpu.yaml is a complete one)"
    if loaded is None:
        raise RecipeError(f"recipe {recipe!r} is empty (or only comments): a recipe is {example}.")
    if not isinstance(loaded, dict):
        raise RecipeError(f"recipe {recipe!r} is a YAML {type(loaded).__name__}, not a mapping of fields: a recipe is "
                          f"{example}.")
    return {k: v for k, v in loaded.items() if k != "env"}


def recipe_line(recipe: str, name: str) -> int | None:
    """The line of ``recipe`` that sets ``name`` (the first ``name:`` at the start of a line), or None."""
    for number, line in enumerate(Path(recipe).read_text().splitlines(), start=1):
        if ":" in line and line.split(":", 1)[0].strip() == name and not line.startswith((" ", "\t", "#")):
            return number
    return None


def unknown_message(keys: Sequence[str], names: Sequence[str], where: str, recipe: str | None = None) -> str:
    """Unknown field names, each with the nearest known ones (or where a renamed field went); with ``recipe``, the
    file and each name's line."""
    lines = []
    for key in keys:
        line = recipe_line(recipe, key) if recipe is not None else None
        head = f"{key!r}" + (f" (line {line})" if line is not None else "")
        if key in RENAMED_FIELDS:
            lines.append(f"{head}: use {RENAMED_FIELDS[key]}")
            continue
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "no similar field"
        lines.append(f"{head}: {hint}")
    where = f"recipe {recipe!r}" if recipe is not None else where
    listed = "; ".join(lines)
    end = " " if listed.endswith("?") else ". "  # "did you mean 'x'?" ends its own sentence
    return (
        f"{where} sets {len(keys)} unknown field(s): {listed}{end}Fields come from DFPOScriptArguments, DFPOConfig "
        "(GRPOConfig + DFPO) and TRL's ModelConfig; `dfpo-train --help` lists them."
    )


def field_origin(name: str, flags: Sequence[str], args: Sequence[str], recipe: str | None) -> str:
    """Where a field's value came from, for an error message: the command line (one of ``flags``), the recipe's
    line, or its default."""
    if any(arg in flags or arg.split("=", 1)[0] in flags for arg in args):
        return f"--{name} on the command line"
    line = recipe_line(recipe, name) if recipe is not None else None
    if line is not None:
        return f"{name} in {recipe}, line {line}"
    return f"{name} (its default)"


def check_max_steps(value: int, origin: str) -> None:
    """Refuse ``max_steps`` 0 and below -1. transformers reads any ``max_steps <= 0`` as "train ``num_train_epochs``
    epochs" (its default is -1), so 0 trained a whole run whose summary looked like any other, and -5 started a
    3000-step run of 3 epochs with nothing said; a user writing them meant something else (no training, or "as many
    as the data has"), and says which with -1 or a positive count."""
    if value == 0 or value < -1:
        raise RecipeError(
            f"{origin}: max_steps {value} would not stop at {value} steps: transformers reads max_steps <= 0 as 'train "
            "num_train_epochs epochs'. Set max_steps to the optimizer steps to train (>= 1), or -1 to train "
            "num_train_epochs epochs over the training prompts."
        )


def _flag_value(args: Sequence[str], flags: Sequence[str]) -> str | bool | None:
    """The value the last of ``flags`` on the command line gives (``--f value`` or ``--f=value``; a bare ``--f``
    True, a bare ``--no_f`` False), else None."""
    value: str | bool | None = None
    for i, arg in enumerate(args):
        if arg in flags and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        elif arg in flags:
            value = not arg.replace("-", "_").startswith("__no_")
        elif "=" in arg and arg.split("=", 1)[0] in flags:
            value = arg.split("=", 1)[1]
    return value


LIST_FIELDS = ("reward_funcs",)  # fields of several values (nargs "+") the value checks read


def _list_flag_value(args: Sequence[str], flags: Sequence[str]) -> list[str] | None:
    """The values the last of ``flags`` gives (``--f a b`` up to the next flag, or ``--f=a``), else None."""
    value: list[str] | None = None
    for i, arg in enumerate(args):
        if arg in flags:
            value = []
            for rest in args[i + 1:]:
                if rest.startswith("--"):
                    break
                value.append(rest)
        elif "=" in arg and arg.split("=", 1)[0] in flags:
            value = [arg.split("=", 1)[1]]
    return value


class CommandLine:
    """A command line read against a field table: each field's value as the user set it (the flag, else the
    recipe) or its default, where it was set, and whether the user set it."""

    def __init__(self, args: Sequence[str], recipe: str | None, settings: dict[str, Any], table: Mapping[str, Any]):
        self.recipe, self.settings, self.table = recipe, settings, table
        self.options: Mapping[str, list[str]] = table["options"]
        self.flags = split_recipe(args)[1]

    def flagged(self, name: str) -> str | bool | None:
        """The command line's value of ``name``; a bare flag of a numeric field is left to the full parse."""
        if name == "plugins":
            given = flag_plugins(self.flags)
        elif name in LIST_FIELDS:
            given = _list_flag_value(self.flags, self.options[name])
        else:
            given = _flag_value(self.flags, self.options[name])
        return None if isinstance(given, bool) and name in self.table.get("numeric", {}) else given

    def value(self, name: str) -> Any:
        given = self.flagged(name)
        if given is not None:
            return given
        return self.settings[name] if name in self.settings else self.table["defaults"].get(name)

    def origin(self, name: str) -> str:
        return field_origin(name, self.options[name], self.flags, self.recipe)

    def given(self, name: str) -> bool:
        return name in self.settings or self.flagged(name) is not None

    def set(self, name: str, value: str) -> None:
        """Give ``name`` the value ``value`` where the user set it (the flag, else the recipe's setting)."""
        if self.flagged(name) is not None:
            set_flag_value(self.flags, self.options[name], value)
        else:
            self.settings[name] = value

    def argv(self) -> list[str]:
        """The command line as read (``--config RECIPE`` first), with the values :meth:`set` gave."""
        return [*(["--config", self.recipe] if self.recipe is not None else []), *self.flags]


def closed_options(table: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each field with a closed list of values and that list (the table's, and the transforms registered now)."""
    options = {name: list(values) for name, values in table.get("choices", {}).items()}
    options["group_transform"] = registered_names("dfpo_trl.transforms", "TRANSFORMS", table["transforms"])
    return options


def normalise_choices(line: CommandLine) -> None:
    """Read each closed option the user set (flag or recipe) as the one value it names without regard to case, ``-``
    or ``_`` (``MIN_REPLACE``: ``min_replace``), in place; one that names none is refused with the nearest value
    (``group_transform`` by the value checks, which also say how to register a transform)."""
    for name, options in closed_options(line.table).items():
        if name not in line.options or not line.given(name):
            continue
        value = line.flagged(name)
        value = line.settings.get(name) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            continue  # a bare flag, a list, YAML's true/false: the full parse says what the field takes
        match = canonical(value, options)
        if match is None and name != "group_transform":
            raise RecipeError(f"{line.origin(name)}: {choice_problem(name, value, options)}")
        if match is not None and match != str(value):
            line.set(name, match)


def read_command_line(argv: Sequence[str], table: Mapping[str, Any]) -> CommandLine:
    """``argv`` read against ``table``: the recipe (it exists, it is a YAML mapping) and every field name in it and
    on the command line known, else a one-line :class:`RecipeError`."""
    options: Mapping[str, list[str]] = table["options"]
    args = recipe_argv(argv)
    recipe = split_recipe(args)[0]
    settings: dict[str, Any] = {}
    if recipe is not None:
        settings = read_recipe(recipe)
        unknown = [str(k) for k in settings if k not in options]
        if unknown:
            raise RecipeError(unknown_message(unknown, sorted(options), "the recipe", recipe))
    line = CommandLine(args, recipe, settings, table)
    known_flags = {flag for names in options.values() for flag in names}
    unknown = [a.split("=", 1)[0] for a in line.flags if a.startswith("--") and a.split("=", 1)[0] not in known_flags]
    if unknown:
        names = [f[2:].replace("-", "_") for f in unknown]
        raise RecipeError(unknown_message(names, sorted(options), "the command line"))
    return line


def given_output_dir(argv: Sequence[str]) -> str | None:
    """The ``output_dir`` the command line sets (its flag, else the recipe's key), read without a field table: what
    the folder cleanup of :func:`.files.removed_if_left_empty` needs when the stored table is for other library
    versions. None when it is not set or the recipe does not read (the full parse then says why)."""
    try:
        args = recipe_argv(argv)
        flagged = _flag_value(args, ("--output_dir", "--output-dir"))
        if isinstance(flagged, str):
            return flagged
        recipe = split_recipe(args)[0]
        value = read_recipe(recipe).get("output_dir") if recipe else None
    except RecipeError:
        return None
    return str(value) if value is not None else None


def precheck(argv: Sequence[str], table: Mapping[str, Any] | None = None) -> CommandLine | None:
    """Check the recipe, the field names, the paths and the values of ``argv`` against ``table`` (default: the
    stored field table; without one for the installed libraries, only what needs no field list), importing the
    plugins first; a problem is a one-line :class:`RecipeError`, as the full parse would give it. Returns the
    command line as read (None without a table)."""
    table = table if table is not None else stored_field_table()
    if table is None:
        recipe_argv(argv)
        return None
    line = read_command_line(argv, table)
    value, origin = line.value, line.origin
    steps, strategy = line.flagged("save_steps"), line.flagged("save_strategy")
    if isinstance(steps, str) and isinstance(strategy, str) and (problem := save_strategy_problem(steps, strategy)):
        raise RecipeError(problem)
    try:
        max_steps = int(value("max_steps"))
    except (TypeError, ValueError):  # not an integer: the full parse says what the field takes
        max_steps = None
    if max_steps is not None:
        check_max_steps(max_steps, origin("max_steps"))
    output_dir = value("output_dir")
    if output_dir is not None:
        check_output_dir(str(output_dir), origin("output_dir"))
    resume = value("resume_from_checkpoint")
    if resume is not None and (output_dir is not None or str(resume).strip().lower() != "true"):
        # (`true` without an output_dir reads transformers' default folder: left to the full parse)
        resolve_resume_checkpoint(str(resume), output_dir, origin("resume_from_checkpoint"))
    import_plugins(as_module_list(value("plugins")), origin("plugins"))  # what they register is checked next
    normalise_choices(line)
    check_values(value, origin, line.given, table)
    check_local_inputs(value, origin)  # the model's, reward models' and dataset's paths, the avg@k eval batch
    return line
