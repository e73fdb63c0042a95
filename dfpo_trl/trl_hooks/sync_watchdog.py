"""Deadlines on TRL's server-mode weight sync and generation requests: a stalled sync, or a server that accepted a
generation request and stopped answering, ends the run with one line instead of a hang.

TRL 1.16's ``VLLMGeneration`` talks to a ``vllm serve`` process in server mode through ``VLLMClient``: at
construction the client waits for ``/health`` and sets up the NCCL weight-transfer group
(``init_communicator``, a rendezvous the server joins from its node at the trainer's address), and before each
rollout ``sync_weights`` streams every parameter over that group (``update_named_params``). None of these calls
has a timeout: ``requests`` waits forever on a server that accepted and never answers, and an NCCL rendezvous or
broadcast that the other side never joins blocks forever. Across nodes this is the common failure (a multi-homed
node advertising an address the server cannot reach, a dead server), and it shows as a job that hangs until its
time limit. The other training processes then wait in the next collective, so they hang too.

:class:`WatchedVLLMGeneration` is TRL's class with both phases run under a :class:`SyncWatchdog` on every
process: the main process in the calls above, the others in the ZeRO-3 gathers that feed the broadcast and in a
barrier that ends each guarded phase. When a phase outlives ``vllm_sync_timeout`` (set-up: plus
``vllm_server_timeout``, TRL's own wait for the server to come up) the watchdog prints one line (what stalled,
the server's address, the rendezvous address and port, the variables to check) and ends the process with exit
code :data:`STALL_EXIT_CODE`. It must end the process rather than raise: the main thread is blocked inside C
(a socket read, an NCCL wait) where no Python exception can reach it. A weight sync never overlaps a checkpoint
save (both run on the training loop's thread, and a ZeRO-3 save is collective), so no checkpoint is left
half-written: the last complete one is where ``--resume_from_checkpoint`` restarts (docs/source/guides/cli.md, "Several
nodes").

TRL's generation request (``VLLMClient.generate``, one POST for the whole rollout from the main process, the other
processes waiting in the broadcast of its answer) has no timeout either: a server that accepts and then stops
answering (a hung engine, a dead GPU behind a live HTTP front) hangs every process. ``generate`` runs under the same
watchdog, with ``vllm_generation_timeout`` (default :func:`generation_deadline`: a floor plus the rollout's tokens at
a conservative throughput) and the same exit and line.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import trl.trainer.grpo_trainer as grpo_trainer
from trl.generation.vllm_generation import VLLMGeneration

__all__ = [
    "CHECK_VARIABLES",
    "GENERATION_DEADLINE",
    "GENERATION_FLOOR_S",
    "GENERATION_TOKENS_PER_S",
    "STALL_EXIT_CODE",
    "SYNC_DEADLINE",
    "Deadline",
    "SyncWatchdog",
    "WatchedVLLMGeneration",
    "generation_deadline",
    "rendezvous_address",
    "streamed_size",
    "watched_vllm_generation",
]

logger = logging.getLogger(__name__)

# 124, as coreutils' `timeout` ends a command that ran past its limit: distinct from 2 (a refused command line),
# 130 (Ctrl-C) and 143 (SIGTERM), so a launcher or a test can tell a stalled sync apart.
STALL_EXIT_CODE = 124
# What a stalled cross-node sync most often comes down to (docs/source/guides/multinode.md, "Networking").
CHECK_VARIABLES = "VLLM_HOST_IP, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_GID_INDEX (RoCE)"
# The default generation deadline, estimated (not measured): a floor for the server to take the request up, plus every
# requested completion at its maximum length produced at GENERATION_TOKENS_PER_S, a throughput below any healthy
# server's for the models TRL trains (docs/source/guides/vllm.md, "A server that stops answering").
GENERATION_FLOOR_S = 600.0
GENERATION_TOKENS_PER_S = 500.0


class Deadline(NamedTuple):
    """The config field a guarded phase's limit comes from, what to check when it expires, and when raising it is
    the fix: the parts of the one line the watchdog writes."""

    field: str
    check: str
    slow: str


SYNC_DEADLINE = Deadline("vllm_sync_timeout", f"Check {CHECK_VARIABLES} and that the server node reaches the "
                         "rendezvous address", "the sync is only slow")
GENERATION_DEADLINE = Deadline("vllm_generation_timeout", "Check that the server is alive (its log, GET /health) and "
                               "that its GPUs are not stuck", "generation is only slow")


def generation_deadline(sequences: int, max_completion_length: int, configured: float | None) -> float:
    """The limit of one server-mode generation request of ``sequences`` completions: ``configured``
    (``vllm_generation_timeout``; 0: none) when set, else GENERATION_FLOOR_S + sequences × max_completion_length /
    GENERATION_TOKENS_PER_S seconds."""
    if configured is not None:
        return float(configured)
    return GENERATION_FLOOR_S + sequences * max_completion_length / GENERATION_TOKENS_PER_S


def rendezvous_address() -> str:
    """The address the trainer advertises for the weight-transfer rendezvous: vLLM's ``get_ip()`` (which honours
    ``VLLM_HOST_IP``) when vLLM imports, else ``VLLM_HOST_IP``, else a placeholder that says who picks it."""
    try:
        from vllm.utils.network_utils import get_ip

        return str(get_ip())
    except Exception:  # vLLM absent (CPU tests) or its helper moved: the message must still be written
        return os.environ.get("VLLM_HOST_IP") or "<vLLM's get_ip()>"


class SyncWatchdog:
    """Ends the process with one line when a guarded phase outlives its deadline (module docstring).

    ``exit`` is ``os._exit``: it ends the process even while the main thread is blocked in C, runs no atexit hook
    (TRL's would block on the same dead group) and writes nothing further to ``output_dir``."""

    def __init__(self, timeout: float, exit: Callable[[int], Any] = os._exit) -> None:
        self.timeout = float(timeout)
        self._exit = exit

    @contextmanager
    def guard(self, what: str, where: Callable[[], str], timeout: float | None = None,
              deadline: Deadline = SYNC_DEADLINE) -> Iterator[None]:
        """Run the block under the deadline (``timeout``, default the watchdog's; 0 or less: no deadline).
        ``what`` names the phase and ``where`` says the addresses tried; it is called only on expiry. ``deadline``
        names the field the limit comes from and what to check, for the line."""
        limit = self.timeout if timeout is None else float(timeout)
        if limit <= 0:
            yield
            return
        done = threading.Event()
        start = time.monotonic()

        def expire() -> None:
            if done.wait(limit):
                return
            waited = time.monotonic() - start
            line = (
                f"dfpo-train: {what} did not finish within {waited:.0f} s ({deadline.field}) on process "
                f"{os.environ.get('RANK', '0')}: {where()}. {deadline.check}; raise --{deadline.field} if "
                f"{deadline.slow}. Stopped; the last complete checkpoint is where --resume_from_checkpoint restarts."
            )
            try:
                sys.stdout.flush()
                print(line, file=sys.stderr, flush=True)
            finally:
                self._exit(STALL_EXIT_CODE)

        thread = threading.Thread(target=expire, name="dfpo-sync-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
        # what a phase takes is what its deadline should be set from (docs/source/guides/cli.md)
        logger.debug("%s finished in %.3f s of its %.0f s limit", what, time.monotonic() - start, limit)


class WatchedVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` whose server-mode set-up, weight sync and generation requests run under a
    :class:`SyncWatchdog`; colocate mode (no network between processes of different nodes) runs unchanged."""

    def __init__(self, *args: Any, sync_timeout: float, generation_timeout: float | None = None,
                 **kwargs: Any) -> None:
        self.watchdog = SyncWatchdog(sync_timeout)
        self.generation_timeout = generation_timeout
        super().__init__(*args, **kwargs)

    def _server_url(self) -> str:
        return self.server_base_url or f"http://{self.server_host}:{self.server_port}"

    def _where(self) -> str:
        return (
            f"vLLM server {self._server_url()}, weight-transfer rendezvous "
            f"{rendezvous_address()}:{self.group_port} (vllm_group_port)"
        )

    def _init_vllm(self) -> None:
        """TRL's set-up (wait for ``/health``, the NCCL group, a barrier); in server mode under a deadline of
        ``vllm_server_timeout + vllm_sync_timeout``: TRL's own wait for the server is part of it."""
        if self.mode != "server" or self.watchdog.timeout <= 0:
            super()._init_vllm()
            return
        with self.watchdog.guard(
            "the vLLM server connection and weight-transfer set-up (init_communicator)",
            self._where,
            self.server_timeout + self.watchdog.timeout,
        ):
            super()._init_vllm()

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None) -> tuple:
        """TRL's generation; in server mode under :func:`generation_deadline` on every process (the main one in the
        HTTP request, the others in the broadcast of its answer)."""
        sequences = len(prompts) * self.accelerator.num_processes
        limit = generation_deadline(sequences, self.max_completion_length, self.generation_timeout)
        if self.mode != "server" or limit <= 0:
            return super().generate(prompts, images, num_generations, profiler)
        with self.watchdog.guard(
            f"the generation request to the vLLM server ({sequences} completions of up to "
            f"{self.max_completion_length} tokens)",
            lambda: f"vLLM server {self._server_url()}",
            limit,
            GENERATION_DEADLINE,
        ):
            return super().generate(prompts, images, num_generations, profiler)

    def sync_weights(self) -> None:
        """TRL's weight sync, then a barrier, under the deadline: a process whose part ended early waits for the
        main process's broadcast there rather than in the next collective, so every process ends on time. In server
        mode, what the sync streamed is logged at DEBUG (:func:`streamed_size`), beside the phase's duration."""
        if self.mode != "server" or self.watchdog.timeout <= 0:
            super().sync_weights()
        else:
            with self.watchdog.guard("the weight sync to the vLLM server (update_named_params)", self._where):
                super().sync_weights()
                self.accelerator.wait_for_everyone()
        if self.mode == "server" and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", streamed_size(self._weight_metadata or []))


def streamed_size(metadata: list[tuple[str, str, list[int]]]) -> str:
    """What one server-mode weight sync streams, from TRL's metadata of it (name, dtype name, shape per tensor), as
    the DEBUG line says it: ``"the weight sync streamed <n> tensors, <n> parameters, <n> bytes (<dtype>, ...)"``. A
    deadline is set from a duration and the size behind it (docs/source/guides/cli.md)."""
    tensors = [(math.prod(shape), getattr(torch, dtype).itemsize) for _, dtype, shape in metadata]
    dtypes = ", ".join(sorted({dtype for _, dtype, _ in metadata}))
    return (f"the weight sync streamed {len(tensors)} tensors, {sum(n for n, _ in tensors)} parameters, "
            f"{sum(n * size for n, size in tensors)} bytes ({dtypes})")


@contextmanager
def watched_vllm_generation(sync_timeout: float, generation_timeout: float | None = None) -> Iterator[None]:
    """While the block runs (``GRPOTrainer.__init__``), TRL's trainer builds :class:`WatchedVLLMGeneration`
    instead of ``VLLMGeneration``: the trainer module's name is swapped and restored, TRL's code is unchanged."""
    original = getattr(grpo_trainer, "VLLMGeneration", None)
    if original is not VLLMGeneration:
        from .compat import _incompatible

        raise _incompatible("trl.trainer.grpo_trainer no longer builds VLLMGeneration (the weight-sync watchdog)")

    def build(*args: Any, **kwargs: Any) -> WatchedVLLMGeneration:
        return WatchedVLLMGeneration(*args, sync_timeout=sync_timeout, generation_timeout=generation_timeout,
                                     **kwargs)

    grpo_trainer.VLLMGeneration = build
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original
