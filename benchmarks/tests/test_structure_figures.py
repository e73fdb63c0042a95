"""dfpo_bench.structure_figures: the line count, the tracked size and the README's length against a small git
repository whose files are known."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dfpo_bench.structure_figures import main

NOTEBOOK = {"cells": [{"cell_type": "code", "source": ["import x\n", "x.run()"], "outputs": [{"text": ["a\n"] * 50}]},
                      {"cell_type": "markdown", "source": "# Title"}], "metadata": {}, "nbformat": 4}

# Each file of the small repository and its (physical lines, non-blank lines), None when it must not count.
FILES: dict[str, tuple[str, tuple[int, int] | None]] = {
    "dfpo_trl/__init__.py": ("x = 1\n\ny = 2\n", (3, 2)),
    "dfpo_trl/core.py": ("a\nb", (2, 2)),  # no newline at the end: the last line still counts
    "dfpo_trl/table.json": ('{"a":\n1}\n', None),  # data, not a hand-written kind
    "tests/test_core.py": ("1\n2\n3\n4\n", (4, 4)),
    "benchmarks/" "run.py": ("1\n2\n3\n4\n5\n", (5, 5)),
    "benchmarks/README.md": ("one\n", (1, 1)),
    "benchmarks/results/" "out.py": ("1\n" * 100, None),  # under results/: generated
    "benchmarks/study/results/log.txt": ("1\n" * 100, None),  # a nested results/ folder too
    "benchmarks/figures/plot.png": ("\x89PNG\n" * 7, None),
    "docs/guide.md": ("# Guide\n\ntext\n", (3, 2)),
    "notebooks/demo.ipynb": (json.dumps(NOTEBOOK, indent=1), (3, 3)),  # its cells' sources only
    "README.md": ("readme\n", (1, 1)),
    "tools/run": ("#!/bin/sh\necho hi\n", (2, 2)),  # an extensionless script: other
    "tools/.gitignore": ("*.pyc\n", None)}  # extensionless, no #!


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def small_repo(tmp_path: Path) -> Path:
    """A git repository of :data:`FILES`, committed, plus a tracked symlink and an untracked file (neither counts)."""
    repo = tmp_path / "repo"
    for path, (text, _) in FILES.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "init", "-q")
    (repo / "dfpo_trl" / "link.py").symlink_to("core.py")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "files")
    (repo / "dfpo_trl" / "untracked.py").write_text("1\n" * 10)
    return repo


def test_the_figures_follow_the_definition(small_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "figures" / "structure.json"
    figures = main(["--root", str(small_repo / "docs"), "--out", str(out)])  # any folder reads the whole checkout
    assert json.loads(out.read_text()) == figures
    lines = figures["lines"]
    parts = {name: (p["lines"], p["nonblank"]) for name, p in lines["parts"].items()}
    for part in ("dfpo_trl", "tests", "benchmarks", "docs", "notebooks"):
        counted = [c for p, (_, c) in FILES.items() if c and p.split("/")[0] == part]
        assert parts[part] == (sum(c[0] for c in counted), sum(c[1] for c in counted)), part
    assert parts["recipes"] == parts["examples"] == (0, 0) and parts["other"] == (3, 3)  # README.md, tools/run
    assert lines["total"]["lines"] == 5 + 4 + 6 + 3 + 3 + 3 == 24 and lines["product_lines"] == 5
    assert lines["product_share"] == round(5 / 24, 4) and lines["python"]["tests_and_benchmarks_over_product"] == 1.8
    assert lines["parts"]["dfpo_trl"]["python_files"] == 2 and lines["parts"]["benchmarks"]["python_lines"] == 5
    assert lines["excluded_files"] == {"benchmarks results": 2, "not a hand-written kind": 3, "symlink or submodule": 1}
    assert lines["commit"] == git(small_repo, "rev-parse", "HEAD").strip() and not lines["uncommitted_changes"]
    sizes = [(small_repo / p).lstat().st_size for p in git(small_repo, "ls-files").split()]  # the link's own size
    assert figures["tracked_bytes"] == sum(sizes) and len(sizes) == len(FILES) + 1 and figures["readme_lines"] == 1
    assert figures["summary"][1] == f"git tracks 0.0 MiB ({sum(sizes)} bytes)"


def test_a_folder_outside_git_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["--root", str(tmp_path)])
    assert exit_info.value.code == 2 and "is not a git checkout" in capsys.readouterr().err
