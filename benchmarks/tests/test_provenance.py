"""dfpo_bench.lib.provenance: a run's record names the code that ran (commit, dirty flag, source hash), read from the
checkout the run starts in, and the launcher (common.finish) puts it in every record."""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess

import pytest

from dfpo_bench.lib import common, provenance  # noqa: E402

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


def test_every_launcher_record_carries_the_checkout_read_at_start(tmp_path: pathlib.Path) -> None:
    run = common.Run("two_forms", "gspo", 3, ["--seed", "3"])
    run.log = tmp_path / "run.log"
    run.log.write_text("Traceback: CUDA out of memory\n")
    run.checkout = provenance.checkout_state(common.ROOT)
    run.started = 0.0
    args = argparse.Namespace(out_dir=str(tmp_path), card="cpu", versions={}, recipe=str(common.RECIPE), steps=2,
                              extra=[])
    record = common.finish(run, args, 1)
    assert record["checkout"] == run.checkout and record["checkout"]["source_sha256"]
    assert record["complete"] is False and "out of memory" in record["log_tail"]
