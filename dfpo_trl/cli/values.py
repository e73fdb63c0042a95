"""The checks of a command line's values that need no model and no torch: types, the rules of TRL's fields that DFPO
relies on, the objective's options against TRL's loss settings, whole groups per rollout, and the task's name.

Run by :func:`.precheck.precheck` from the stored field table, before ``dfpo-train`` imports torch, transformers
and TRL, so that ``--epsilon -0.1`` costs a second, not ten; and by :func:`.parser.parse_args` when the full parse
refuses a value, so that both say the same thing. Every message names where each value it blames was set: the flag,
or the recipe's file and line. Standard library only (plus :mod:`dfpo_trl.config.rules`,
:mod:`dfpo_trl.config.trl_field_rules`, :mod:`dfpo_trl.config.method` and :mod:`dfpo_trl.config.combinations`, none
of which imports torch).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..config.combinations import check_sequence_options
from ..config.rules import missing_column, transform_fix, unknown_name
from ..config.trl_field_rules import TRL_FIELD_RULES, launched_processes, whole_groups_problem
from .args import RecipeError
from .choices import did_you_mean

__all__ = [
    "VALUE_FIELDS", "check_values", "coerce", "launched_processes", "registered_names", "whole_groups_problem",
    "with_origins",
]  # fmt: skip

# The fields whose defaults the value checks read (kept in the field table; see .fields).
SEQUENCE_FIELDS = (
    "group_transform", "transform_gradient", "transform_stop_gradient", "symmetric_clip", "importance_sampling_level",
    "loss_type", "token_weighting", "log_energy_buckets",
)  # fmt: skip
BATCH_FIELDS = (
    "per_device_train_batch_size", "steps_per_generation", "gradient_accumulation_steps", "generation_batch_size",
    "num_generations",
)  # fmt: skip
DATA_FIELDS = ("reward_funcs", "dataset", "dataset_config", "split", "problem_column", "answer_column")
VALUE_FIELDS = (*SEQUENCE_FIELDS, *BATCH_FIELDS, "task", "plugins", *DATA_FIELDS)

Value = Callable[[str], Any]  # a field's value as the user set it (flag, recipe) or its default
Origin = Callable[[str], str]  # where a field's value came from, for a message
Given = Callable[[str], bool]  # whether the user set the field (flag or recipe)

_TRUE, _FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")  # transformers' string_to_bool


def coerce(value: Any, kind: str, optional: bool = False) -> Any:
    """A recipe's or flag's value as the parser types it (``"float"``, ``"int"``, ``"bool"``; ``optional``: ``none``
    and ``null`` unset it, as TRL's parser reads them): YAML scalars go through the flag's type as text, as
    :meth:`.parser.DFPOParser.set_defaults_with_config` makes them. Raises ValueError with argparse's words when the
    text is not of that type, TypeError for a list or a mapping."""
    if value is None or (optional and str(value).lower() in ("none", "null")):
        return None
    if isinstance(value, (list, tuple, dict)):
        raise TypeError(type(value).__name__)
    if kind == "bool":
        text = str(value).lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(f"invalid bool value: {str(value)!r}")
    try:
        return float(str(value)) if kind == "float" else int(str(value))
    except ValueError:
        raise ValueError(f"invalid {kind} value: {str(value)!r}") from None


def _takes(name: str, kind: str, table: Mapping[str, Any]) -> str:
    """What a numeric field takes, as the full parse's type error says it (with its default as the example)."""
    default = table["numeric"][name][1]
    example = "" if default is None else f", e.g. {default!r} (its default)"
    return f"{'a number' if kind == 'float' else 'an integer'}{example}"


def _typed(name: str, value: Value, origin: Origin, table: Mapping[str, Any]) -> Any:
    """The value of a numeric field, typed; a value that is not a number is refused naming where it was set."""
    kind, _, optional = table["numeric"][name]
    try:
        return coerce(value(name), kind, optional)
    except TypeError as exc:
        raise RecipeError(
            f"{origin(name)}: {name} is a {exc} ({value(name)!r}); {name} takes {_takes(name, kind, table)}."
        ) from None
    except ValueError as exc:
        raise RecipeError(f"{origin(name)}: {exc}; {name} takes {_takes(name, kind, table)}.") from None


def _named(message: str, names: Iterable[str]) -> list[str]:
    """The field names ``message`` mentions as whole words, in the order it mentions them."""
    found = {n: m.start() for n in names if (m := re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message))}
    return sorted(found, key=found.get)


def _blamed(message: str, names: Iterable[str], given: Given, origin: Origin) -> str:
    """The origins of the fields a message names that the user set ("--x on the command line and y in r.yaml,
    line 3"), or of all it names when the user set none of them."""
    named = _named(message, names)
    chosen = [n for n in named if given(n)] or named
    return " and ".join(origin(n) for n in chosen)


def with_origins(message: str, names: Iterable[str], given: Given, origin: Origin) -> str:
    """``message`` (a dataclass's refusal, which knows fields but not where they were set) headed by the origins of
    the fields it names that the user set, in the order it names them; as it is when it names none of them."""
    chosen = [n for n in _named(message, names) if given(n)]
    return f"{' and '.join(origin(n) for n in chosen)}: {message}" if chosen else message


def registered_names(module: str, registry: str, stored: list[str]) -> list[str]:
    """The registered names, in the registry's order: the live registry when a plugin already imported it, else the
    stored table's."""
    if module in sys.modules:
        return list(getattr(sys.modules[module], registry))
    return list(stored)


def import_problem(path: str) -> str | None:
    """Why the module of an import path (``package.module:name``) cannot be imported, found with
    ``importlib.util.find_spec`` (which runs no module's code but its parent packages'), in the words the registry's
    import gives after torch; None when it can be found (whether it has the name is left to the import)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        return None
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as the registry's import_object does
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError as exc:  # a parent package is missing
        return f"cannot import {module!r} for {path!r}: {exc}"
    except Exception:  # noqa: BLE001 - a parent package raised: the import after torch says how
        return None
    return None if found is not None else f"cannot import {module!r} for {path!r}: No module named {module!r}"


def _is_import_path(name: Any) -> bool:
    """A ``task`` or ``reward_funcs`` entry written as an import path, not a name, a folder or a hub id."""
    return (isinstance(name, str) and (":" in name or "." in name) and "/" not in name
            and not name.startswith(("~", ".")) and not os.path.isdir(name))


DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def _file_columns(path: Path) -> list[str] | None:
    """The columns of one data file, from its first row or header (parquet: its schema); None when unreadable."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet  # no torch; datasets reads parquet with it too

            return list(pyarrow.parquet.read_schema(path).names)
        with path.open(encoding="utf-8") as handle:
            if path.suffix == ".csv":
                return next(csv.reader(handle), None)
            if path.suffix == ".jsonl":
                first = next((line for line in handle if line.strip()), None)
                row = json.loads(first) if first is not None else None
            else:
                data = json.load(handle)
                row = data[0] if isinstance(data, list) and data else None
    except (OSError, ValueError, ImportError, UnicodeDecodeError):
        return None
    return list(row) if isinstance(row, dict) else None


def dataset_columns(folder: str, split: str) -> list[str] | None:
    """A local dataset folder's columns for ``split``, read from its own files without ``datasets``: a folder
    written by ``save_to_disk`` (its ``dataset_info.json``; a DatasetDict's split subfolder), or a folder of data
    files (the first file named after the split, or the only data file); None when they cannot be told this way
    (the load after torch then decides)."""
    root = Path(folder)
    for info in (root / split / "dataset_info.json", root / "dataset_info.json"):
        if info.is_file() and (info.parent == root / split or not (root / "dataset_dict.json").is_file()):
            try:
                features = json.loads(info.read_text(encoding="utf-8")).get("features")
            except (OSError, ValueError):
                return None
            return list(features) if isinstance(features, dict) else None
    if (root / "README.md").is_file() and "configs:" in (root / "README.md").read_text(errors="replace"):
        return None  # the card chooses the data files: only datasets reads that
    files = sorted(p for p in root.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    named = [p for p in files if p.name.startswith(split) or p.parent.name == split]
    chosen = named or (files if len(files) == 1 and split == "train" else [])
    return _file_columns(chosen[0]) if chosen else None


def _check_data(value: Value, origin: Origin) -> None:
    """The import paths of ``task`` and ``reward_funcs`` (by find_spec), and a local ``math`` dataset's columns (from
    its own files): refused as the run would refuse them after torch, headed by where each field was set."""
    task = value("task")
    if _is_import_path(task) and (problem := import_problem(task)) is not None:
        raise RecipeError(f"{origin('task')}: {problem}")
    rewards = value("reward_funcs")
    for name in [rewards] if isinstance(rewards, str) else rewards if isinstance(rewards, list) else []:
        if _is_import_path(name) and (problem := import_problem(name)) is not None:
            raise RecipeError(f"{origin('reward_funcs')}: {problem}")
    dataset, split = value("dataset"), value("split")
    if task != "math" or value("dataset_config") is not None or not isinstance(dataset, str) or not isinstance(
            split, str) or not os.path.isdir(dataset):
        return
    columns = dataset_columns(dataset, split)
    if columns is None:
        return
    for field in ("problem_column", "answer_column"):
        column = value(field)
        if isinstance(column, str) and column not in columns:
            raise RecipeError(f"{origin(field)}: {missing_column(column, field, columns)}")


def check_values(value: Value, origin: Origin, given: Given, table: Mapping[str, Any]) -> None:
    """Every value check that needs no model, in the full parse's order: the types of the numeric fields the user
    set, the rules of TRL's fields, the objective's options, whole groups per rollout, the task's name. The first
    problem raises a one-line :class:`RecipeError` naming the fields and where they were set."""
    numeric = {name: _typed(name, value, origin, table) for name in table["numeric"] if given(name)}
    found = [f"{origin(rule.field)}: {problem}" for rule in TRL_FIELD_RULES
             if rule.field in numeric and (problem := rule.problem(SimpleNamespace(**numeric))) is not None]
    if found:
        raise RecipeError("invalid value(s): " + " | ".join(found) + ".")

    def typed(name: str) -> Any:
        if name in numeric:
            return numeric[name]
        if isinstance(table["defaults"][name], bool):
            return coerce(value(name), "bool")
        return value(name) if name not in table["numeric"] else coerce(value(name), *table["numeric"][name][::2])

    try:
        options = SimpleNamespace(**{name: typed(name) for name in SEQUENCE_FIELDS})
        batch = {name: typed(name) for name in BATCH_FIELDS}
    except (TypeError, ValueError):  # a value of the wrong type: the full parse says what the field takes
        return
    transforms = registered_names("dfpo_trl.transforms", "TRANSFORMS", table["transforms"])
    if isinstance(options.group_transform, str) and options.group_transform not in transforms:
        raise RecipeError(
            f"invalid value(s): {origin('group_transform')}: group_transform={options.group_transform!r} is not a "
            f"DFPO transform; {transform_fix(transforms)}.{did_you_mean(options.group_transform, transforms)}"
        )
    if options.group_transform in transforms:
        try:
            check_sequence_options(options)
        except ValueError as exc:
            raise RecipeError(f"{_blamed(str(exc), SEQUENCE_FIELDS, given, origin)}: {exc}") from None
    processes = launched_processes()
    problem = None if processes is None else whole_groups_problem(batch, processes)
    if problem is not None:
        raise RecipeError(f"{_blamed(problem, BATCH_FIELDS, given, origin)}: {problem}.")
    task = value("task")
    tasks = registered_names("dfpo_trl.cli.tasks", "TASKS", table["tasks"])
    if isinstance(task, str) and task not in tasks and ":" not in task and "." not in task:
        raise RecipeError(f"{origin('task')}: " + unknown_name(f"unknown task {task!r}; known tasks", task, tasks,
                                                               "module:factory"))
    _check_data(value, origin)
