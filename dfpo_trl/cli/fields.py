"""The table of ``dfpo-train``'s fields that its fast path reads instead of TRL: built from the real parser.

``dfpo-train --help`` and the command line's first checks (recipe, field names, paths) must answer before torch,
transformers and TRL are imported (seconds). What they need from those libraries (every field's flags, a few
defaults, the help of the fields ``--help`` shows) is kept in ``field_table.json``, written by this module from the
parser the full path uses (``field_builder.build_field_table``), with the TRL and transformers versions it was built
with: under other versions the fast path is skipped (the full parse checks everything anyway)
and ``--help`` is built from the parser.
``python -m dfpo_trl.cli.fields`` rewrites it; ``--check`` exits 1 when it differs from what the installed TRL and
transformers give (tests/cli/test_cli_fast.py checks the same, so it cannot drift).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .field_builder import build_field_table, help_all_text
from .parser import make_parser
from .precheck import HELP_ALL_FILE, TABLE_FILE

__all__ = ["HELP_ALL_FILE", "TABLE_FILE", "build_field_table", "write_table"]


def table_source(table: dict[str, Any]) -> str:
    """``field_table.json``'s text for ``table`` (package data, read by :func:`.precheck.read_field_table`)."""
    return json.dumps(table, indent=1, ensure_ascii=False) + "\n"


def write_table(check: bool = False) -> int:
    """Write ``field_table.json`` and ``help_all.txt`` (``--help-all``'s text) from the parser (no plugins); with
    ``check``, only compare (1: one differs)."""
    parser = make_parser()
    texts = {TABLE_FILE: table_source(build_field_table(parser)), HELP_ALL_FILE: help_all_text(parser)}
    if check:
        stale = [path for path, text in texts.items() if not path.is_file() or path.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run python -m dfpo_trl.cli.fields", file=sys.stderr)
        return 1 if stale else 0
    for path, text in texts.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(write_table(check="--check" in sys.argv[1:]))
