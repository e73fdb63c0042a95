"""SIGTERM handled like Ctrl-C: how schedulers (Slurm, Kubernetes, ``timeout``) stop a job, and what they send first.

Python turns SIGINT into :class:`KeyboardInterrupt`, which ``dfpo-train`` catches to write a partial summary; SIGTERM's
default action kills the process with nothing written. While ``dfpo-train`` runs, SIGTERM raises
:class:`Terminated`, a KeyboardInterrupt, so it takes the same path; the exit code is 128 + the signal's number.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Terminated", "exit_code", "signal_name", "sigterm_interrupts"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is when it arrives (as Python raises KeyboardInterrupt for SIGINT)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signal.Signals(signum).name)


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated`; the previous handler is restored after it. Only the
    main thread can set handlers: elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def signal_name(exc: KeyboardInterrupt) -> str:
    """The signal an interrupt stands for: SIGTERM for :class:`Terminated`, else SIGINT (Ctrl-C)."""
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


def exit_code(name: str) -> int:
    """128 + the signal's number, the shell's convention: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signal.Signals[name])
