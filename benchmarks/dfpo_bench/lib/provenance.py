"""What code a benchmark run ran: the checkout's commit, whether it had uncommitted changes, and a hash of the
package's and the benchmarks' sources (``git rev-parse HEAD`` alone can name a commit older than the code that ran).
"""

from __future__ import annotations

import hashlib
import pathlib
import subprocess
from typing import Any

SOURCE_GLOBS = ("dfpo_trl/**/*.py", "dfpo_trl/**/*.json", "benchmarks/**/*.py", "benchmarks/**/*.sh", "recipes/*.yaml")


def git(root: pathlib.Path, *args: str) -> str | None:
    """``git -C root args`` stdout, or None when git is missing or fails (no repository there)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def source_sha256(root: pathlib.Path) -> str:
    """SHA-256 over the sources that decide a run (path and bytes of each, sorted): equal hashes, equal code, with or
    without git."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in SOURCE_GLOBS for p in root.glob(pattern) if p.is_file()}):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def checkout_state(root: pathlib.Path) -> dict[str, Any]:
    """{commit, dirty, diff_sha256, source_sha256} of the checkout at ``root`` now. ``dirty``: tracked files differ
    from the commit or untracked, unignored files exist; ``diff_sha256`` hashes ``git diff HEAD`` (equal for equal
    uncommitted changes); commit, dirty and diff are None without git."""
    head = git(root, "rev-parse", "HEAD")
    status = git(root, "status", "--porcelain") if head is not None else None
    diff = git(root, "diff", "HEAD") if head is not None else None
    return {"commit": head.strip() if head else None,
            "dirty": bool(status.strip()) if status is not None else None,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
            "source_sha256": source_sha256(root)}
