"""The table of ``dfpo-train``'s fields that its fast path reads instead of TRL: built from the real parser.

``dfpo-train --help`` and the command line's first checks (recipe, field names, paths) must answer before torch,
transformers and TRL are imported (seconds). What they need from those libraries (every field's flags, a few
defaults, the help of the fields ``--help`` shows) is kept in ``field_table.py``, written by this module from the
parser the full path uses, with the TRL and transformers versions it was built with: under other versions the
fast path is skipped (the full parse checks everything anyway) and ``--help`` is built from the parser.
``python -m dfpo_trl.app.fields`` rewrites it; ``--check`` exits 1 when it differs from what the installed TRL and
transformers give (tests/test_cli_fast.py checks the same, so it cannot drift).
"""

from __future__ import annotations

import pprint
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl import GRPOConfig

from ..config import DFPOConfig
from ..objectives.transforms import TRANSFORMS
from ..tasks import TASKS
from .args import DFPOScriptArguments
from .help import LEADING_FIELDS
from .precheck import PRECHECKED_FIELDS, library_versions

if TYPE_CHECKING:
    from .parser import DFPOParser

__all__ = ["TABLE_FILE", "build_field_table", "dfpo_field_names", "task_help", "transform_help", "write_table"]

TABLE_FILE = Path(__file__).with_name("field_table.py")

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


def dfpo_field_names() -> list[str]:
    """The fields DFPOConfig adds to GRPOConfig, in declaration order."""
    inherited = {f.name for f in fields(GRPOConfig)}
    return [f.name for f in fields(DFPOConfig) if f.name not in inherited]


def _entry(parser: DFPOParser, name: str) -> dict[str, Any]:
    """What ``--help`` shows of a field: its default (as repr, None when it has none), the flag that turns a True
    default off, and its help text."""
    action = parser.primary_action(name)
    default = None if action.default is None else repr(action.default)
    negated = parser.negated_flag(name) if action.default is True else None
    return {"default": default, "negated": negated, "help": " ".join((action.help or "").replace("%%", "%").split())}


def build_field_table(parser: DFPOParser) -> dict[str, Any]:
    """Everything the fast path reads, from ``parser`` (with whatever plugins registered when it was built)."""
    options: dict[str, list[str]] = {}
    for action in parser._actions:
        if action.dest not in ("help", "config"):
            options.setdefault(action.dest, []).extend(action.option_strings)
    script = [f.name for f in fields(DFPOScriptArguments)]
    dfpo = dfpo_field_names()
    shown = [*LEADING_FIELDS, *dfpo, *(n for n in script if n not in LEADING_FIELDS)]
    return {
        "versions": library_versions(),
        "options": {name: options[name] for name in sorted(options)},
        "defaults": {name: parser.primary_action(name).default for name in PRECHECKED_FIELDS},
        "dfpo_fields": dfpo,
        "script_fields": script,
        "entries": {name: _entry(parser, name) for name in shown},
    }


def table_source(table: dict[str, Any]) -> str:
    """``field_table.py``'s text for ``table``."""
    body = pprint.pformat(table, width=116, sort_dicts=False)
    return (
        '"""Generated by ``python -m dfpo_trl.app.fields`` from the parser over DFPOScriptArguments, DFPOConfig and '
        "ModelConfig\n(dfpo_trl/app/fields.py says why); do not edit.\"\"\"\n\n"
        "# ruff: noqa: E501\n\nFIELD_TABLE = " + body + "\n"
    )


def write_table(check: bool = False) -> int:
    """Write ``field_table.py`` from the parser (no plugins); with ``check``, only compare (1: it differs)."""
    from .parser import make_parser

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
