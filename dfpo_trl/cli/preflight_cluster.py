"""``dfpo-train --preflight``'s checks across nodes: a Gloo rendezvous of one process per node, then a shared
``output_dir`` (node 0's marker read back by every node) and the same versions everywhere. Standard library and
torch.distributed.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .preflight_settings import MARKER_PREFIX, PreflightFailure, Settings, local_version

__all__ = ["VERSIONED", "check_across_nodes", "shared_storage", "versions"]

# The packages whose versions must agree across nodes (their distribution names).
VERSIONED = ("torch", "trl", "transformers", "accelerate", "deepspeed", "vllm", "dfpo-trl")


def _deadline(seconds: float, what: str) -> threading.Event:
    """Ends the process with a FAIL line if not set within ``seconds``: Gloo's own timeouts do not cover every
    stall (a peer that connected and went silent)."""
    done = threading.Event()

    def expire() -> None:
        if not done.wait(seconds):
            print(f"preflight: FAIL {what}", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=expire, daemon=True).start()
    return done


def versions() -> dict[str, str]:
    """This node's versions of :data:`VERSIONED` and Python ("absent" for a package not installed)."""
    found = {name: local_version(name) or "absent" for name in VERSIONED}
    found["python"] = ".".join(map(str, sys.version_info[:3]))
    return found


def check_across_nodes(settings: Settings, report: Callable[[str, str], None]) -> None:
    """The Gloo rendezvous of one process per node, then the shared output_dir and the versions."""
    import datetime

    import torch.distributed as dist

    address = f"{settings.main_process_ip}:{settings.main_process_port}"
    fix = (
        f"fix: check --main_process_ip (node 0's address, here {settings.main_process_ip}), that port "
        f"{settings.main_process_port} is open between the nodes, --num_machines and each node's --machine_rank, "
        "and GLOO_SOCKET_IFNAME on multi-homed nodes"
    )
    if not settings.main_process_ip:
        raise PreflightFailure(f"no node 0 address for {settings.num_machines} machines; {fix}")
    done = _deadline(
        settings.timeout + 30, f"rendezvous at {address} still open after {settings.timeout + 30:.0f} s; {fix}"
    )
    start = time.monotonic()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{address}",
            rank=settings.machine_rank,
            world_size=settings.num_machines,
            timeout=datetime.timedelta(seconds=settings.timeout),
        )
        hosts: list[Any] = [None] * settings.num_machines
        dist.all_gather_object(hosts, socket.gethostname())
    except Exception as exc:  # torch raises RuntimeError or DistStoreError, by version
        raise PreflightFailure(
            f"rendezvous of {settings.num_machines} nodes at {address} failed after "
            f"{time.monotonic() - start:.0f} s as node {settings.machine_rank} ({str(exc).splitlines()[0][:160]}); "
            f"{fix}"
        ) from exc
    report("ok", f"rendezvous at {address}: {settings.num_machines} nodes ({', '.join(map(str, hosts))})")
    try:
        shared_storage(settings, hosts)
        report("ok", f"output_dir {settings.output_dir} is the same directory on every node")
        mine = versions()
        every: list[Any] = [None] * settings.num_machines
        dist.all_gather_object(every, mine)
        differ = {k: sorted({str(v[k]) for v in every}) for k in mine if len({str(v[k]) for v in every}) > 1}
        if differ:
            detail = "; ".join(
                f"{k}: " + ", ".join(f"node {r} ({hosts[r]}) {every[r][k]}" for r in range(len(every))) for k in differ
            )
            raise PreflightFailure(
                f"versions differ across nodes: {detail}; fix: install the same versions on every "
                "node (one environment on shared storage, or the same pinned requirements)"
            )
        report("ok", "same versions on every node: " + ", ".join(f"{k} {v}" for k, v in mine.items()))
    finally:
        dist.destroy_process_group()
        done.set()


def shared_storage(settings: Settings, hosts: list[Any]) -> None:
    """Node 0 writes a marker with a fresh token into output_dir; every node must read that token there."""
    import torch.distributed as dist

    token = [secrets.token_hex(8) if settings.machine_rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = Path(settings.output_dir) / f"{MARKER_PREFIX}{token[0]}"
    if settings.machine_rank == 0:
        marker.write_text(token[0])
    dist.barrier()
    try:
        seen = marker.read_text() == token[0]
    except OSError:
        seen = False
    every: list[Any] = [None] * settings.num_machines
    dist.all_gather_object(every, seen)
    dist.barrier()
    if settings.machine_rank == 0:
        marker.unlink(missing_ok=True)
    blind = [f"node {r} ({hosts[r]})" for r, ok in enumerate(every) if not ok]
    if blind:
        raise PreflightFailure(
            f"output_dir {settings.output_dir} is not shared: {', '.join(blind)} cannot read the marker node 0 "
            f"({hosts[0]}) wrote there; fix: put output_dir on storage every node mounts at the same path (ZeRO-3 "
            "checkpoints and dfpo_rollout_state_<process>.pt must be read back by every node on resume)"
        )
