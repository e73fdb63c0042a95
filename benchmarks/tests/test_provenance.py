"""dfpo_bench.lib.provenance: a run's record names the code that ran (commit, dirty flag, source hash), read from the
checkout the run starts in (the trained-weights jobs record it)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from dfpo_bench.lib import provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def make_repo(root: pathlib.Path) -> str:
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "job.py").write_text("print(1)\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        subprocess.run(["git", "-C", str(root), *args], check=True)
    return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_checkout_state_reads_the_commit_and_a_dirty_flag(tmp_path: pathlib.Path) -> None:
    head = make_repo(tmp_path)
    clean = provenance.checkout_state(tmp_path)
    assert clean["commit"] == head and clean["dirty"] is False and clean["diff_sha256"] is None
    (tmp_path / "benchmarks" / "job.py").write_text("print(2)\n")  # the code that runs is not the commit's
    dirty = provenance.checkout_state(tmp_path)
    assert dirty["commit"] == head and dirty["dirty"] is True and dirty["diff_sha256"] is not None
    assert dirty["source_sha256"] != clean["source_sha256"]
    (tmp_path / "benchmarks" / "job.py").write_text("print(1)\n")
    assert provenance.checkout_state(tmp_path) == clean  # back to the commit: the same state


def test_without_git_the_commit_is_unknown_but_the_sources_are_hashed(tmp_path: pathlib.Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "job.py").write_text("print(1)\n")
    state = provenance.checkout_state(tmp_path)
    assert state["commit"] is None and state["dirty"] is None and len(state["source_sha256"]) == 64
