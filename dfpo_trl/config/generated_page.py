"""The generated reference pages' one mechanism: write a page from the code, or check that it is current.

Standard library only, so that ``dfpo_trl.cli.docs`` (which reads the stored field table, not TRL) stays as light as
the fast path; ``dfpo_trl.config.docs`` uses it too.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_or_check_page"]


def write_or_check_page(page: Path, wanted: str, argv: list[str], source: str, module: str) -> int:
    """Write a generated reference page, or with ``--check`` in ``argv`` only compare it (1: it differs from what
    ``source`` gives; the line names ``python -m module``, which rewrites it). The generated pages' one mechanism."""
    if "--check" in argv:
        if not page.is_file() or page.read_text(encoding="utf-8") != wanted:
            print(f"{page}: differs from {source}; run python -m {module}")
            return 1
        return 0
    page.write_text(wanted, encoding="utf-8")
    return 0
