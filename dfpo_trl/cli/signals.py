"""SIGTERM handled like Ctrl-C: how schedulers (Slurm, Kubernetes, ``timeout``) stop a job, and what they send first.

Python turns SIGINT into :class:`KeyboardInterrupt`, which ``dfpo-train`` catches to write a partial summary; SIGTERM's
default action kills the process with nothing written. While ``dfpo-train`` runs, SIGTERM raises
:class:`Terminated`, a KeyboardInterrupt, so it takes the same path; the exit code is 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = [
    "Terminated", "exit_code", "further_interrupts_wait", "quiet_exit_on_interrupt", "signal_name",
    "sigterm_interrupts",
]


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


@contextmanager
def further_interrupts_wait() -> Iterator[None]:
    """After a Ctrl-C, while ``dfpo-train`` writes the partial results and ends (seconds): a second Ctrl-C (people
    press it twice) says so in one line instead of breaking off the writing with a traceback, and a third quits at
    once, writing nothing more (a summary is written whole or not at all: outputs.py). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    presses = 0

    def _pressed(signum: int, frame: FrameType | None) -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            _exit_now(signum, frame)
        print("dfpo-train: stopping (a few seconds); Ctrl-C again to quit at once", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, _pressed)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def quiet_exit_on_interrupt() -> None:
    """Once the console program's work is done: a Ctrl-C while the interpreter shuts down ends it at once with the
    shell's 130 (what it has printed flushed first), instead of a traceback from a library's clean-up."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_now)


def _exit_now(signum: int, frame: FrameType | None) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exit_code(signal.Signals(signum).name))
