"""What ``dfpo-train``'s stored field table and ``--help-all`` text hold, built from the real parser
(:func:`.parser.make_parser`): each field's flags, a few defaults, the numeric fields' types, the closed options'
values and the help ``--help`` shows. ``fields.py`` writes them beside the package (``field_table.json``,
``help_all.txt``); the full parse builds the table itself where no stored one matches the installed libraries.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import fields
from typing import Any

from ..config.fields import dfpo_fields
from ..transforms import TRANSFORMS
from .args import DFPOScriptArguments
from .choices import TRL_STRING_OPTIONS
from .help import LEADING_FIELDS
from .precheck import PRECHECKED_FIELDS, library_versions
from .tasks import TASKS

__all__ = ["HELP_WIDTH", "build_field_table", "closed_choices", "help_all_text", "numeric_fields", "numeric_kind"]

# ``parser`` below is a :class:`.parser.DFPOParser` (not imported here: the parser imports this module).


def numeric_kind(action: argparse.Action) -> str | None:
    """``"float"`` or ``"int"`` for a field that takes one number (TRL wraps the type of an optional one to accept
    ``none``, keeping the inner type's name), else None."""
    name = getattr(action.type, "__name__", None)
    if name in ("float", "int") and action.nargs is None and not action.choices:
        return name
    return None


def _entry(parser: Any, name: str) -> dict[str, Any]:
    """What ``--help`` shows of a field: its default (as repr, None when it has none), the flag that turns a True
    default off, and its help text."""
    action = parser.primary_action(name)
    default = None if action.default is None else repr(action.default)
    negated = parser.negated_flag(name) if action.default is True else None
    return {"default": default, "negated": negated, "help": " ".join((action.help or "").replace("%%", "%").split())}


def numeric_fields(parser: Any) -> dict[str, list[Any]]:
    """Every field that takes one number: ``[type, default, optional]`` (the type as ``"float"`` or ``"int"``, the
    default as the full parse's type error shows it, whether ``none`` unsets it), so that the fast path types their
    values as the parser does."""
    numeric = {}
    for name in sorted(parser.field_defaults):
        action = parser.primary_action(name)
        kind = numeric_kind(action)
        if kind is not None:
            numeric[name] = [kind, parser.field_defaults[name], action.type not in (float, int)]
    return numeric


HELP_WIDTH = 100  # the columns --help-all is laid out in: fixed, so that the stored text is the same on every terminal


def help_all_text(parser: Any) -> str:
    """``--help-all``: argparse's help over every field (TRL's GRPOConfig, transformers' TrainingArguments,
    ModelConfig and the script arguments), laid out in :data:`HELP_WIDTH` columns. Stored as ``help_all.txt`` by
    :mod:`.fields`, so that ``--help-all`` answers without torch, as ``--help`` does."""
    formatter_class = parser.formatter_class
    parser.formatter_class = functools.partial(formatter_class, width=HELP_WIDTH)
    try:
        return parser.format_help()
    finally:
        parser.formatter_class = formatter_class


def build_field_table(parser: Any) -> dict[str, Any]:
    """Everything the fast path reads, from ``parser`` (with whatever plugins registered when it was built). Here,
    not in ``fields.py`` (which writes it to ``field_table.json``), because the full parse's refusals read it too
    (``parser.py``), and ``fields.py`` imports the parser."""
    options: dict[str, list[str]] = {}
    for action in parser._actions:
        if action.dest not in ("help", "config"):
            options.setdefault(action.dest, []).extend(action.option_strings)
    script = [f.name for f in fields(DFPOScriptArguments)]
    dfpo = [spec.name for spec in dfpo_fields()]
    shown = [*LEADING_FIELDS, *dfpo, *(n for n in script if n not in LEADING_FIELDS)]
    return {
        "versions": library_versions(),
        "options": {name: options[name] for name in sorted(options)},
        "defaults": {name: parser.primary_action(name).default for name in PRECHECKED_FIELDS},
        "numeric": numeric_fields(parser),
        "tasks": sorted(TASKS),
        "transforms": [name for name, entry in TRANSFORMS.items() if entry.builtin],  # registry order
        "dfpo_fields": dfpo,
        "script_fields": script,
        "entries": {name: _entry(parser, name) for name in shown},
        "choices": closed_choices(parser),
    }


def closed_choices(parser: Any) -> dict[str, list[str]]:
    """Each field with a closed list of values (argparse's choices: DFPO's Literal fields, transformers' Enum ones;
    and TRL's documented string options, choices.py) and that list, for the command line to read them without case
    and refuse a misspelt one with the nearest value."""
    found = {name: [str(c) for c in parser.primary_action(name).choices] for name in sorted(parser.field_defaults)
             if parser.primary_action(name).choices and parser.primary_action(name).nargs in (None, "?")}
    found.update({name: list(values) for name, values in TRL_STRING_OPTIONS.items() if name in parser.field_defaults})
    return dict(sorted(found.items()))
