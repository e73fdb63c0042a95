"""Where a user's own code failed, for a one-line message: their frame (file:line), not a traceback through TRL.

A reward function, task, dataset or plugin that raises ends ``dfpo-train`` in one line naming the user's own frame
and the exception (docs/source/guides/cli.md, "A failure in your own code"). Standard library only: the command line's
fast checks (plugins) use it before torch is imported.
"""

from __future__ import annotations

import functools
import inspect
import os
import sysconfig
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["UserCodeError", "defined_at", "exception_text", "user_frame", "user_frames"]


class UserCodeError(RuntimeError):
    """A user's reward, task, dataset or plugin failed: the message is one line naming their frame and the
    exception (``dfpo-train`` prints it as ``dfpo-train: error: ...``, exit code 1)."""


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """The folders whose code is not the user's: the standard library, the installed packages, dfpo_trl itself."""
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.abspath(__file__)))
    return tuple(sorted(os.path.realpath(r) for r in roots if r))


def _is_library(filename: str) -> bool:
    if filename.startswith("<") and filename != "<stdin>":
        return True
    path = os.path.realpath(filename)
    return any(path == root or path.startswith(root + os.sep) for root in _library_roots())


def _shown(filename: str) -> str:
    """A file as a message shows it: relative to the working directory when it lies below it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if relative.startswith("..") else relative


def user_frames(exc: BaseException) -> Iterator[FrameType]:
    """The frames of ``exc``'s traceback that run the user's code (not the standard library, an installed package
    or dfpo_trl), innermost first."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return (f for f in reversed(frames) if not _is_library(f.f_code.co_filename))


def user_frame(exc: BaseException) -> str | None:
    """``file:line`` where the user's code raised ``exc`` (their innermost frame in its traceback); when none is
    theirs (their module is an installed package), the innermost frame outside dfpo_trl; None without a
    traceback."""
    tb = list(traceback.walk_tb(exc.__traceback__))
    own = os.path.dirname(os.path.abspath(__file__)) + os.sep
    chosen = next(user_frames(exc), None)
    if chosen is None:
        chosen = next((f for f, _ in reversed(tb) if not os.path.abspath(f.f_code.co_filename).startswith(own)), None)
    if chosen is None:
        return None
    line = next(n for f, n in tb if f is chosen)
    return f"{_shown(chosen.f_code.co_filename)}:{line}"


def defined_at(func: Any) -> str | None:
    """``file:line`` where a function (or a callable object's class) is defined, for a failure with no traceback
    (a reward that returned the wrong thing); None when Python cannot say."""
    target = inspect.unwrap(getattr(func, "func", func)) if not inspect.isroutine(func) else inspect.unwrap(func)
    if not (inspect.isroutine(target) or inspect.isclass(target)):
        target = type(target)
    try:
        filename = inspect.getsourcefile(target)
        _, line = inspect.getsourcelines(target)
    except (OSError, TypeError):
        return None
    return f"{_shown(filename)}:{line}" if filename else None


def exception_text(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (a message's newlines folded), cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
