"""A collective that failed because another process of the run is gone, as one line (docs/source/guides/cli.md, "Several
nodes").

When a process of a multi-process run dies (killed, out of host memory), the others learn it in their next
collective: gloo raises "Connection reset/closed by peer" at once when the dead process's sockets close; a peer that
hangs, or a node that is gone without closing them, leaves them waiting until the process group's timeout
(``ddp_timeout``), then gloo raises "Timed out waiting ...". Either came out as a traceback of some 60 lines per
process, the cause on its last line. :func:`lost_peer_as_one_line` turns it into :class:`PeerLost`, which :mod:`.main`
prints as one line: what happened, the ``ddp_timeout`` in force, and the checkpoint a resume restarts from. Nothing is
written on the way out. NCCL's watchdog ends a process on its own (it aborts it past ``ddp_timeout``, no Python
error); its errors raised in Python (``DistBackendError``) take the same path.
This module imports torch only inside its functions, so :mod:`.main` can name :class:`PeerLost`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .paths import latest_whole_checkpoint

__all__ = ["PeerLost", "lost_peer_as_one_line", "lost_peer_cause", "lost_peer_message"]

# gloo's messages: "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9619: Connection reset by peer. This is
# typically caused by ...", "[.../unbound_buffer.cc:129] Timed out waiting 20000ms for send operation to complete"
_GLOO = re.compile(r"^\[[^\]]*gloo[^\]]*\]\s*(?P<cause>[^\n]*?)(?:\. This is typically.*)?$", re.DOTALL)


class PeerLost(RuntimeError):
    """A collective that failed on a lost or hung peer; the message is the whole report (one line)."""


def lost_peer_cause(exc: BaseException) -> str | None:
    """The cause of ``exc`` in a few words when it is a collective failing on a lost or hung peer (a gloo
    transport error, or torch's distributed errors), else None."""
    import torch.distributed as dist

    text = str(exc).strip()
    match = _GLOO.match(text) if isinstance(exc, RuntimeError) else None
    if match is None and not isinstance(exc, dist.DistError):
        return None
    cause = match.group("cause") if match else text.splitlines()[0] if text else type(exc).__name__
    return cause.rstrip(".")


def lost_peer_message(cause: str, args: Any, step: int | None) -> str:
    """The one line: which process, where, why, the ``ddp_timeout`` in force and the checkpoint to resume from."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    where = f" after step {step}" if step is not None else ""
    if "timed out" in cause.lower() or "timeout" in cause.lower():
        what = (f"waited ddp_timeout ({args.ddp_timeout:g} s) for another process in a collective{where} ({cause}): "
                "another process of the run hangs or died, or its node is gone; its launcher's log names it")
    else:
        what = (f"lost its connection to another process in a collective{where} ({cause}): another process of the "
                "run died; its launcher's log names it (a hung process or a node that is gone is waited for "
                f"ddp_timeout, {args.ddp_timeout:g} s)")
    checkpoint = latest_whole_checkpoint(args.output_dir) if args.output_dir else None
    resume = (f"the last whole checkpoint, {checkpoint}, is where --resume_from_checkpoint restarts" if checkpoint
              else "no checkpoint was written yet")
    return f"process {rank} of {world} {what}. Stopped; nothing was written; {resume}"


@contextmanager
def lost_peer_as_one_line(trainer: Any) -> Iterator[None]:
    """Turn a collective's failure on a lost or hung peer, raised inside, into :class:`PeerLost`."""
    try:
        yield
    except RuntimeError as exc:
        cause = lost_peer_cause(exc)
        if cause is None:
            raise
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        raise PeerLost(lost_peer_message(cause, trainer.args, step)) from None
