"""A pre-registration that guards something: a stage refuses to start unless the registration file's whole content
hashes to the SHA-256 the script records and the file is tracked, committed and clean in git.

Study v3's guard compared only the ``sha256`` field written inside the file, so a file with altered content and the
same field passed, and nothing checked that the file was committed before the runs (RESULTS §13). Here the
hash is over the file's bytes, the script holds the expected value as a constant (so changing the registration means
changing the script, in a commit), and git must say the file is tracked with no uncommitted change (staged, unstaged
or untracked). :func:`run_provenance` is what every run record of such a stage carries.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from .provenance import checkout_state, file_sha256, git

__all__ = ["RegistrationError", "check_registration", "file_sha256", "registration_state", "registration_text",
           "run_provenance", "write_registration"]


class RegistrationError(SystemExit):
    """A stage refused to start: the registration is missing, altered or not committed. A SystemExit, so a CLI
    stops with the message and a test can catch it."""


def registration_text(design: dict[str, Any]) -> str:
    """The registration file's text for ``design``: one serialisation for every study, since the guard hashes the
    bytes (indent 1, non-ASCII kept, a final newline)."""
    return json.dumps(design, indent=1, ensure_ascii=False) + "\n"


def write_registration(path: pathlib.Path, design: dict[str, Any]) -> str:
    """Write ``design``'s registration to ``path`` (``--preregister``); returns the SHA-256 the script must record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(registration_text(design), encoding="utf-8")
    return file_sha256(path)


def registration_state(path: pathlib.Path, root: pathlib.Path) -> dict[str, Any]:
    """{path, sha256, tracked, clean, commit}: the file's content hash; whether git tracks it; whether it has no
    staged, unstaged or untracked change (``git status --porcelain -- path`` empty and ``git diff --quiet HEAD --
    path``); the last commit that touched it. Without git (or outside the repository) tracked and clean are False."""
    path, root = pathlib.Path(path).resolve(), pathlib.Path(root).resolve()
    try:
        relative = str(path.relative_to(root))
    except ValueError:
        relative = None
    sha = file_sha256(path) if path.is_file() else None
    tracked = relative is not None and git(root, "ls-files", "--error-unmatch", "--", relative) is not None
    status = git(root, "status", "--porcelain", "--", relative) if tracked else None
    same_as_head = tracked and git(root, "diff", "--quiet", "HEAD", "--", relative) is not None
    last = git(root, "log", "-1", "--format=%H", "--", relative) if tracked else None
    return {"path": relative or str(path), "sha256": sha, "tracked": bool(tracked),
            "clean": bool(tracked and status is not None and not status.strip() and same_as_head),
            "commit": last.strip() if last and last.strip() else None}


def check_registration(path: pathlib.Path, expected_sha256: str, root: pathlib.Path) -> dict[str, Any]:
    """The registration's state (:func:`registration_state`) when its whole-content SHA-256 is ``expected_sha256``
    and it is tracked and clean in the git checkout at ``root``; else :class:`RegistrationError` saying which
    condition failed. Call it before a stage launches anything."""
    state = registration_state(path, root)
    if state["sha256"] is None:
        raise RegistrationError(f"{path}: no registration file; write it, commit it, then launch")
    if state["sha256"] != expected_sha256:
        raise RegistrationError(f"{path}: content SHA-256 {state['sha256']} is not the registered {expected_sha256} "
                                "(the file was altered, or the script's recorded hash was not updated in a commit)")
    if not state["tracked"]:
        raise RegistrationError(f"{path}: not tracked by git; commit the registration before any run of its stage")
    if not state["clean"]:
        raise RegistrationError(f"{path}: has uncommitted changes; commit the registration before any run")
    return state


def run_provenance(root: pathlib.Path, registration: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a run record carries: the checkout (commit, dirty, diff hash, source hash of dfpo_trl/ and benchmarks/,
    :func:`~dfpo_bench.lib.provenance.checkout_state`) and the registration state the stage was admitted with."""
    return {"checkout": checkout_state(pathlib.Path(root)), "registration": registration}
