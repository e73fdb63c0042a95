"""The table of ``dfpo-train``'s fields that its fast path reads instead of TRL: built from the real parser.

``dfpo-train --help`` and the command line's first checks (recipe, field names, paths) must answer before torch,
transformers and TRL are imported (seconds). What they need from those libraries (every field's flags, a few
defaults, the help of the fields ``--help`` shows) is kept in ``field_table.json``, written by this module from the
parser the full path uses, with the TRL and transformers versions it was built with: under other versions the
fast path is skipped (the full parse checks everything anyway) and ``--help`` is built from the parser.
``python -m dfpo_trl.app.fields`` rewrites it; ``--check`` exits 1 when it differs from what the installed TRL and
transformers give (tests/app/test_cli_fast.py checks the same, so it cannot drift).
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from typing import Any

from ..config.fields import dfpo_fields
from ..tasks import TASKS
from ..transforms import TRANSFORMS
from .args import DFPOScriptArguments
from .help import LEADING_FIELDS
from .parser import DFPOParser, make_parser, numeric_kind
from .precheck import PRECHECKED_FIELDS, TABLE_FILE, library_versions

__all__ = ["TABLE_FILE", "build_field_table", "write_table"]


def _entry(parser: DFPOParser, name: str) -> dict[str, Any]:
    """What ``--help`` shows of a field: its default (as repr, None when it has none), the flag that turns a True
    default off, and its help text."""
    action = parser.primary_action(name)
    default = None if action.default is None else repr(action.default)
    negated = parser.negated_flag(name) if action.default is True else None
    return {"default": default, "negated": negated, "help": " ".join((action.help or "").replace("%%", "%").split())}


def numeric_fields(parser: DFPOParser) -> dict[str, list[Any]]:
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


def build_field_table(parser: DFPOParser) -> dict[str, Any]:
    """Everything the fast path reads, from ``parser`` (with whatever plugins registered when it was built)."""
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
    }


def table_source(table: dict[str, Any]) -> str:
    """``field_table.json``'s text for ``table`` (package data, read by :func:`.precheck.read_field_table`)."""
    return json.dumps(table, indent=1, ensure_ascii=False) + "\n"


def write_table(check: bool = False) -> int:
    """Write ``field_table.json`` from the parser (no plugins); with ``check``, only compare (1: it differs)."""
    text = table_source(build_field_table(make_parser()))
    if check:
        same = TABLE_FILE.is_file() and TABLE_FILE.read_text() == text
        if not same:
            print(f"{TABLE_FILE} is out of date: run python -m dfpo_trl.app.fields", file=sys.stderr)
        return 0 if same else 1
    TABLE_FILE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(write_table(check="--check" in sys.argv[1:]))
