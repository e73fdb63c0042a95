"""The benchmarks reach dfpo_trl only through its stable names (the ``__all__`` of dfpo_trl, its cli, testing and
testing.measures), read from every import (AST); nothing puts a folder on ``sys.path``; the library never imports us.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent


def imports_of(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every absolute import in ``path``; name "" for ``import module``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names]
    return found


def python_files(*folders: Path) -> list[Path]:
    files = sorted(p for folder in folders for p in folder.rglob("*.py"))
    assert files, folders
    return files


def dfpo_imports() -> dict[tuple[str, str], list[str]]:
    """Every import of dfpo_trl in dfpo_bench and its tests that is not a stable name, with where it is."""
    stable = {(module, name) for module in ("dfpo_trl", "dfpo_trl.cli", "dfpo_trl.testing", "dfpo_trl.testing.measures")
              for name in ("", *importlib.import_module(module).__all__)}
    found: dict[tuple[str, str], list[str]] = {}
    for path in python_files(BENCH / "dfpo_bench", BENCH / "tests"):
        for module, name, line in imports_of(path):
            if module.split(".")[0] == "dfpo_trl" and (module, name) not in stable:
                found.setdefault((module, name), []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def test_the_benchmarks_import_only_stable_names() -> None:
    found = dfpo_imports()
    assert not found, f"dfpo_bench imports internals of dfpo_trl (use a stable name, or add a seam): {found}"


def test_the_walk_sees_a_reach_into_the_library(tmp_path: Path) -> None:
    """The walker reads every form an import takes (from-import, dotted module import, inside a function)."""
    source = tmp_path / "job.py"
    source.write_text("import dfpo_trl.trainer as t\n\ndef f():\n    from dfpo_trl.groups.ids import group_index\n"
                      "from dfpo_trl import DFPOConfig\n")
    assert {(m, n) for m, n, _ in imports_of(source)} == {
        ("dfpo_trl.trainer", ""), ("dfpo_trl.groups.ids", "group_index"), ("dfpo_trl", "DFPOConfig")}


def test_nothing_puts_a_folder_on_sys_path() -> None:
    """The package is installed (or on PYTHONPATH), never found by a script editing ``sys.path``."""
    edits = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for path in python_files(BENCH / "dfpo_bench", BENCH / "tests")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not edits, edits


def test_the_library_and_its_tests_never_import_the_benchmarks() -> None:
    reaches = [f"{path.relative_to(ROOT)}:{line}" for path in python_files(ROOT / "dfpo_trl", ROOT / "tests")
               for module, _, line in imports_of(path)
               if module.split(".")[0] in ("dfpo_bench", "benchmarks")]
    assert not reaches, reaches


def test_no_test_module_shares_a_name_with_one_of_the_librarys() -> None:
    """Both folders are rootdir-relative test folders without packages, so pytest imports their modules by basename:
    two of one name in one session fail collection ("import file mismatch")."""
    ours = {p.name for p in (BENCH / "tests").glob("test_*.py")}
    theirs = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    assert not ours & theirs, sorted(ours & theirs)
