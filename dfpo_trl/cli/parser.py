"""Recipe and flags into (DFPOScriptArguments, DFPOConfig, ModelConfig); each bad input one line, before any load.

A bad input is a one-line RecipeError naming the field, where it was set and what it takes.

A recipe is a flat YAML mapping read by TRL's ``TrlParser``; an ``env:`` mapping sets environment variables;
command-line flags beat the recipe.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from trl import ModelConfig, TrlParser

from ..config.fields import DFPOConfig, dfpo_fields
from ..transforms import TRANSFORMS
from . import logger
from .args import DFPOScriptArguments, RecipeError
from .choices import canonical
from .field_builder import build_field_table, numeric_kind
from .local_inputs import model_path_problem
from .paths import check_output_dir, resolve_resume_checkpoint
from .plugins import as_module_list, flag_plugins, import_plugins
from .precheck import (
    check_max_steps,
    closed_options,
    normalise_choices,
    precheck,
    read_command_line,
    read_recipe,
    recipe_argv,
    split_recipe,
    stored_field_table,
    unknown_message,
    yaml_error,
)
from .precheck import field_origin as precheck_field_origin
from .resume import imply_save_strategy, resumed_settings
from .tasks import TASKS
from .values import with_origins

# One line per built-in task in `--help`; a task registered without an entry here is described by the first
# sentence of its factory's docstring.
TASK_SUMMARIES = {
    "arithmetic": "single-digit addition, reward on the last number of the completion; offline",
    "sum_sentence": "the same problems answered in one required sentence: a group's completions share a long "
    "prefix, where shared-token cancellation acts; offline",
    "math": "any `datasets` dataset graded by math-verify; set dataset, problem_column and answer_column",
    "two_forms": "the same problems answered in either of two sentences the reward treats alike, 'The sum is N.' "
    "or 'The answer is N.': the drift meter's task (drift_every); offline",
}


def docstring_summary(obj: Any) -> str:
    """A task factory's summary for ``--help``: its docstring's first paragraph (never cut inside it, as splitting
    at the first ". " cut a sentence that quoted an example), without a closing ':' or '.'."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    first = " ".join(doc.split("\n\n", 1)[0].split())
    return first.rstrip(":.").strip()


def task_help() -> str:
    """The ``task`` field's help, listing every task registered in :data:`dfpo_trl.cli.tasks.TASKS`."""

    def summary(name: str) -> str:
        if name in TASK_SUMMARIES:
            return TASK_SUMMARIES[name]
        return docstring_summary(TASKS[name]) or "registered with dfpo_trl.cli.tasks.register_task"

    listed = "; ".join(f"'{name}' ({summary(name)})" for name in TASKS)
    return (
        f"Task: {listed}; a name registered with dfpo_trl.cli.tasks.register_task; or an import path "
        "'package.module:factory' returning a dfpo_trl.cli.tasks.Task."
    )


def transform_help() -> str:
    """The ``group_transform`` field's help (it lists the built-ins), then every transform registered beyond them
    (by a plugin, docs/source/guides/custom_transform.md) with its balance condition, as the registry holds them now."""
    spec = next(f for f in dfpo_fields() if f.name == "group_transform")
    added = [f"'{name}' (balances: {entry.balance})" for name, entry in TRANSFORMS.items() if not entry.builtin]
    extra = f" Registered by plugins: {', '.join(added)}." if added else ""
    return spec.metadata["help"] + extra.replace("%", "%%")  # argparse formats help with %


def dfpo_fields_summary() -> str:
    """DFPOConfig's own fields for the parser's description, from the config (names sharing a first word and a
    ``_`` once more than one field has it, e.g. ``delta_*``)."""
    names = [spec.name for spec in dfpo_fields()]
    heads = [name.split("_")[0] for name in names]
    shown: list[str] = []
    for name, head in zip(names, heads, strict=True):
        item = f"{head}_*" if heads.count(head) > 1 else name
        if item not in shown:
            shown.append(item)
    return ", ".join(shown)


class DFPOParser(TrlParser):
    """``TrlParser`` whose unknown keys and flags are reported with the nearest field name, whose ``--no_*`` flags
    show the default of the field they turn off, and whose bad values raise :class:`RecipeError` (one line) instead
    of printing argparse's usage."""

    # argparse takes "-3e-5" for an option (its pattern knows only -3 and -0.5): every number is a value here.
    NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_NUMBER  # no flag of ours looks like a number
        self._keep_negated_flags()
        self.recipe: str | None = None  # the recipe being parsed (parse_args sets it), for its unknown fields' lines
        self.closed: dict[str, list[str]] = {}  # the closed options a recipe's values are read against (parse_args)
        self._align_negated_flags()
        # The dataclasses' defaults, before a recipe replaces them (set_defaults_with_config): for error messages.
        self.field_defaults = {a.dest: a.default for a in self._actions if self.primary_action(a.dest) is a}

    # Fields whose True default DFPOConfig makes None (unset: resolved in DFPOConfig.__post_init__), which takes away
    # the --no_X flag HfArgumentParser adds only for a True default: given back, as the command lines before had it.
    UNSET_BOOLS = ("dataloader_pin_memory",)

    def _keep_negated_flags(self) -> None:
        flags = {o for a in self._actions for o in a.option_strings}
        for name in self.UNSET_BOOLS:
            negated = [f"--no_{name}", f"--no-{name.replace('_', '-')}"]
            if any(a.dest == name for a in self._actions) and negated[0] not in flags:
                self.add_argument(*negated, action="store_false", dest=name, default=None,
                                  help=f"Set {name} to False (same as --{name} false).")

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
        return unknown_message(keys, self.field_names(), where, self.recipe if where == "the recipe" else None)

    def parse_args_into_dataclasses(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        """Import the plugin modules (the flag's, else the recipe's) first: the dataclasses' checks read what they
        register, e.g. DFPOConfig's group_transform the transform registry (docs/source/guides/custom_transform.md)."""
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
            if name in self.closed and isinstance(value, str):  # MIN_REPLACE: min_replace (precheck refused the rest)
                kwargs[name] = canonical(value, self.closed[name]) or value
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
        "here. DFPO's own fields: " + dfpo_fields_summary() + ". --plugins MODULE imports a module that registers "
        "transforms, tasks or rewards first.",
    )
    parser.primary_action("task").help = task_help()
    parser.primary_action("group_transform").help = transform_help()
    return parser


def field_origin(parser: DFPOParser, name: str, args: Sequence[str], recipe: str | None) -> str:
    """Where a field's value came from, for an error message: the command line, the recipe's line, or its default."""
    return precheck_field_origin(name, [o for a in parser._actions if a.dest == name for o in a.option_strings],
                                 args, recipe)


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
    elif numeric_kind(action) is not None:
        takes = f"{'a number' if numeric_kind(action) == 'float' else 'an integer'}{example}"
    elif isinstance(default, bool):
        takes = "true or false"
    else:
        takes = f"a value{example}"
    return f"{field_origin(parser, name, args, recipe)}: {exc.message.rstrip('.')}; {name} takes {takes}."


def _said_with_origins(args: Sequence[str], message: str) -> str:
    """A refusal of the dataclasses' checks as the fast value checks say it (naming where each value was set, in
    DFPO's words for TRL's whole-groups rule); when those checks find nothing (a rule they leave to the full parse,
    e.g. DFPO's own fields'), as the dataclass said it, headed by where the fields it names were set."""
    table = build_field_table(make_parser())
    try:
        precheck(args, table)
    except RecipeError as exc:
        return str(exc)
    line = read_command_line(args, table)
    return with_origins(message, table["options"], line.given, line.origin)


def read_choices(parser: DFPOParser, args: list[str]) -> list[str]:
    """``args`` with each closed option the user set read as the value it names (``MIN_REPLACE``: ``min_replace``),
    the recipe's through the parser, and a value that names none refused with the nearest one, in the fast
    checks' words (precheck.normalise_choices); the plugins are imported first (what they register is known)."""
    table = stored_field_table() or build_field_table(parser)
    line = read_command_line(args, table)
    import_plugins(as_module_list(line.value("plugins")))
    normalise_choices(line)
    parser.closed = closed_options(table)
    return line.argv()


def parse_args(
    argv: Sequence[str] | None = None, parser: DFPOParser | None = None
) -> tuple[DFPOScriptArguments, DFPOConfig, ModelConfig]:
    """Recipe + flags → (script arguments, DFPOConfig, ModelConfig); unknown names, values of the wrong type, a
    recipe that is not YAML, an unusable ``output_dir`` and a ``resume_from_checkpoint`` that is not a checkpoint
    raise :class:`RecipeError` (before any model loads); ``resume_from_checkpoint: true`` becomes the latest
    checkpoint's path."""
    import yaml

    parser = parser or make_parser()
    args = imply_save_strategy(parser, recipe_argv(sys.argv[1:] if argv is None else argv))
    args = read_choices(parser, args)
    recipe, flags = split_recipe(args)
    if recipe is not None:
        read_recipe(recipe)  # empty, or not a mapping: one line naming the file, as the fast path says it
    parser.recipe = recipe
    try:
        *parsed, rest = parser.parse_args_and_config(args, return_remaining_strings=True)
    except RecipeError:
        raise
    except yaml.YAMLError as exc:
        raise yaml_error(str(recipe), exc) from None
    except argparse.ArgumentError as exc:
        raise RecipeError(_value_error(parser, exc, flags, recipe)) from None
    except ValueError as exc:  # a field's own validation (DFPOConfig, GRPOConfig, TrainingArguments)
        raise RecipeError(_said_with_origins(args, str(exc))) from exc
    if rest:
        flags = [r for r in rest if r.startswith("--")]
        names = [f[2:].split("=", 1)[0].replace("-", "_") for f in flags] or list(rest)
        raise RecipeError(parser.unknown_message(names, "the command line"))
    script_args, training_args, model_args = parsed
    check_max_steps(training_args.max_steps, field_origin(parser, "max_steps", flags, recipe))
    check_output_dir(training_args.output_dir, field_origin(parser, "output_dir", flags, recipe))
    training_args.resume_from_checkpoint = resolve_resume_checkpoint(
        training_args.resume_from_checkpoint,
        training_args.output_dir,
        field_origin(parser, "resume_from_checkpoint", flags, recipe),
    )
    if training_args.resume_from_checkpoint:
        resume_like_the_checkpoint(parser, training_args, flags)
    problem = model_path_problem(model_args.model_name_or_path)  # the fast checks' words (local_inputs.py)
    if problem is not None:
        raise RecipeError(f"{field_origin(parser, 'model_name_or_path', flags, recipe)}: {problem}")
    return script_args, training_args, model_args


def resume_like_the_checkpoint(parser: DFPOParser, training_args: DFPOConfig, flags: Sequence[str]) -> None:
    """A resumed run saves (and logs, evaluates) every as many steps as the run it continues, unless the command
    line says otherwise (resume.py): the same command resumed saved no checkpoint, and transformers warned
    ``save_steps: 500 (from args) != 2 (from trainer_state.json)``. What is taken, or changed, is said in one line."""
    from transformers.trainer_utils import SaveStrategy

    def given(name: str) -> bool:
        options = {o for a in parser._actions if a.dest == name for o in a.option_strings}
        return any(flag.split("=", 1)[0] in options for flag in flags)

    taken, changed = resumed_settings(training_args, training_args.resume_from_checkpoint, given)
    for name, value in taken.items():
        setattr(training_args, name, SaveStrategy(value) if name == "save_strategy" else value)
    if taken:
        said = " and ".join(f"{name} {value!r}" for name, value in taken.items())
        logger.info("resuming with %s from the checkpoint, as the run it continues (give them on the command line "
                    "to change them)", said)
    if changed:
        logger.info("resuming with %s, as the command line says", "; ".join(changed))


def parse_recipe(argv: Sequence[str]) -> tuple[DFPOScriptArguments, DFPOConfig, ModelConfig]:
    """A recipe and its flags as ``dfpo-train`` reads them, without running anything: (the script's arguments: task,
    data, evaluation; the ``DFPOConfig``; TRL's ``ModelConfig``), every default filled in. A bad recipe raises
    :class:`RecipeError` with the line ``dfpo-train`` prints. The stable name (``dfpo_trl.cli.parse_recipe``) for
    checking a recipe in a test or reading what a run will use."""
    return parse_args(argv)
