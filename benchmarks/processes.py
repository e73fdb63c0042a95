"""Stopping a launched process group (stdlib only: the launchers import it before torch)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``), SIGKILL it after
    ``grace_s`` seconds, and reap ``proc``: an ``accelerate launch`` leaves one worker per GPU behind otherwise."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
