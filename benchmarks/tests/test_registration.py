"""dfpo_bench.lib.registration: a stage starts only from a registration whose whole content hashes to the value the
script records and that is committed and clean in git; a tampered file (same recorded field, altered content), an
uncommitted one and an untracked one are refused."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

from dfpo_bench.lib import registration  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

CONTENT = {"sha256": "field-the-old-guard-read", "design": {"staleness": 4, "mde": 0.05}}


def git(root: pathlib.Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def committed_registration(root: pathlib.Path) -> tuple[pathlib.Path, str]:
    """A git repository at ``root`` with a committed registration file; (its path, its content SHA-256)."""
    path = root / "results" / "preregistered.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(CONTENT, indent=1) + "\n")
    (root / "script.py").write_text("print(1)\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "register")
    return path, registration.file_sha256(path)


def test_a_clean_committed_registration_is_admitted(tmp_path: pathlib.Path) -> None:
    path, sha = committed_registration(tmp_path)
    state = registration.check_registration(path, sha, tmp_path)
    assert state["sha256"] == sha and state["tracked"] and state["clean"]
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert state["commit"] == head and state["path"] == "results/preregistered.json"


def test_a_tampered_file_with_the_same_recorded_field_is_refused(tmp_path: pathlib.Path) -> None:
    """The old guard read the ``sha256`` field; here the field is unchanged and the design altered, committed even."""
    path, sha = committed_registration(tmp_path)
    tampered = {**CONTENT, "design": {"staleness": 4, "mde": 0.5}}
    assert tampered["sha256"] == CONTENT["sha256"]
    path.write_text(json.dumps(tampered, indent=1) + "\n")
    with pytest.raises(registration.RegistrationError, match="content SHA-256"):
        registration.check_registration(path, sha, tmp_path)
    git(tmp_path, "commit", "-qam", "tamper")  # committed and clean, but not the registered content
    assert registration.registration_state(path, tmp_path)["clean"]
    with pytest.raises(registration.RegistrationError, match="content SHA-256"):
        registration.check_registration(path, sha, tmp_path)


def test_whitespace_alone_changes_the_hash(tmp_path: pathlib.Path) -> None:
    path, sha = committed_registration(tmp_path)
    path.write_text(json.dumps(CONTENT, indent=2) + "\n")  # the same JSON value, other bytes
    assert json.loads(path.read_text()) == CONTENT
    with pytest.raises(registration.RegistrationError, match="content SHA-256"):
        registration.check_registration(path, sha, tmp_path)


def test_an_untracked_registration_is_refused(tmp_path: pathlib.Path) -> None:
    committed_registration(tmp_path)
    fresh = tmp_path / "results" / "round2.json"
    fresh.write_text("{}\n")
    with pytest.raises(registration.RegistrationError, match="not tracked"):
        registration.check_registration(fresh, registration.file_sha256(fresh), tmp_path)


def test_an_uncommitted_registration_is_refused_staged_or_not(tmp_path: pathlib.Path) -> None:
    """The right content, written after the commit (e.g. the registration was reverted to the registered bytes in
    the work tree but the commit holds others): refused until committed."""
    path, _ = committed_registration(tmp_path)
    new = json.dumps({**CONTENT, "design": {"staleness": 16}}, indent=1) + "\n"
    path.write_text(new)
    sha = registration.file_sha256(path)
    with pytest.raises(registration.RegistrationError, match="uncommitted"):
        registration.check_registration(path, sha, tmp_path)
    git(tmp_path, "add", str(path))  # staged only
    with pytest.raises(registration.RegistrationError, match="uncommitted"):
        registration.check_registration(path, sha, tmp_path)
    git(tmp_path, "commit", "-qm", "register round 2")
    assert registration.check_registration(path, sha, tmp_path)["clean"]


def test_a_missing_file_and_a_repository_without_git_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(registration.RegistrationError, match="no registration"):
        registration.check_registration(tmp_path / "absent.json", "0" * 64, tmp_path)
    path = tmp_path / "plain.json"
    path.write_text("{}\n")
    with pytest.raises(registration.RegistrationError, match="not tracked"):
        registration.check_registration(path, registration.file_sha256(path), tmp_path)


def test_run_provenance_carries_the_source_hash_and_the_admitted_registration(tmp_path: pathlib.Path) -> None:
    path, sha = committed_registration(tmp_path)
    state = registration.check_registration(path, sha, tmp_path)
    record = registration.run_provenance(tmp_path, state)
    assert record["registration"] == state
    assert record["checkout"]["dirty"] is False and len(record["checkout"]["source_sha256"]) == 64
    assert record["checkout"]["commit"] == state["commit"]
