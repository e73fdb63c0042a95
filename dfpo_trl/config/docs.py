"""The README's table of DFPOConfig's DFPO fields, rendered from each field's ``metadata["help"]``.

``python -m dfpo_trl.config.docs`` writes the table into README.md; ``--check`` exits 1 when README.md holds
another one (tests/config/test_config.py checks the same).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .fields import dfpo_fields, render_default, split_help

README = Path(__file__).resolve().parents[2] / "README.md"
# The table sits between this heading and this sentence of README.md.
HEADING = "### DFPO fields of `DFPOConfig`\n\n"
AFTER = "\n\nEvery other field is TRL's `GRPOConfig`, unchanged."
_DOCS_PAGE = re.compile(r"(?<![\w/])docs/[\w./-]+\.md(?:#[\w-]+)?")


def _cell(text: str) -> str:
    """Markdown for one table cell: ``|`` escaped, docs/ pages as links."""
    return _DOCS_PAGE.sub(lambda m: f"[{m.group(0)}]({m.group(0)})", text.replace("|", "\\|"))


def readme_table() -> str:
    """One row per DFPO field: name, default, meaning and source, all from the field itself."""
    rows = ["| field | default | meaning | source |", "| --- | --- | --- | --- |"]
    for spec in dfpo_fields():
        meaning, source = split_help(spec)
        rows.append(f"| `{spec.name}` | `{render_default(spec.default)}` | {_cell(meaning)} | {_cell(source)} |")
    return "\n".join(rows)


def readme_with_table(text: str) -> str:
    """``text`` (README.md) with its DFPO field table replaced by :func:`readme_table`."""
    start = text.index(HEADING) + len(HEADING)
    end = text.index(AFTER, start)
    return text[:start] + readme_table() + text[end:]


def main(argv: list[str]) -> int:
    text = README.read_text(encoding="utf-8")
    wanted = readme_with_table(text)
    if "--check" in argv:
        if wanted != text:
            print(f"{README}: the DFPO field table differs from the fields' help; run python -m dfpo_trl.config.docs")
            return 1
        return 0
    README.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
