"""docs/source/reference/cli.md is what ``python -m dfpo_trl.cli.docs`` writes from the program's stored field table:
every field ``--help`` shows, with its default and help; a stale page fails here until it is written again."""

from __future__ import annotations

from pathlib import Path

from dfpo_trl.cli import docs as cli_docs
from dfpo_trl.cli.help import LEADING_FIELDS
from dfpo_trl.cli.precheck import read_field_table


def test_cli_reference_page_is_the_field_table() -> None:
    table = read_field_table()
    page = cli_docs.PAGE.read_text(encoding="utf-8")
    assert page == cli_docs.cli_page(table)
    for name in [*LEADING_FIELDS, *table["script_fields"]]:
        assert page.count(f"| `{name}` |") == 1, name
        assert " ".join(table["entries"][name]["help"].split()).replace("|", "\\|")[:25] in page, name
    for name in table["dfpo_fields"]:
        assert f"`{name}`" in page, name  # named, with a link to the DFPOConfig reference
    assert cli_docs.main(["--check"]) == 0


def test_cli_reference_check_fails_on_a_stale_page(tmp_path: Path, monkeypatch) -> None:
    stale = tmp_path / "cli.md"
    stale.write_text(cli_docs.cli_page(read_field_table()).replace("| `eval_size` |", "| `eval_sise` |"))
    monkeypatch.setattr(cli_docs, "PAGE", stale)
    assert cli_docs.main(["--check"]) == 1
    assert cli_docs.main([]) == 0 and cli_docs.main(["--check"]) == 0
