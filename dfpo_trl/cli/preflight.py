"""``dfpo-train --preflight`` (or ``python -m dfpo_trl.cli.preflight``): the checks to run on every node before a
multi-node job, each answered in one line with its fix, so that a job does not start only to hang.

    python -m dfpo_trl.cli.preflight recipes/qwen3_32b.yaml --config_file recipes/accelerate/zero3_4x8.yaml \\
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --vllm_server_host $VLLM_HOST

It takes the training command's own arguments (the recipe, the accelerate flags, the recipe's fields on the command
line) and checks, in this order, stopping at the first failure with exit code 1:

1. ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``, when set, name interfaces of this node that have an address;
2. this node has the GPUs the accelerate config starts on it (``num_processes / num_machines``);
3. ``output_dir`` is writable;
4. in vLLM server mode: the server answers on its host and port, serves the recipe's model, exposes the
   weight-transfer endpoints (``VLLM_SERVER_DEV_MODE=1``) and runs this node's vLLM version; and the address this
   node would advertise for the weight-transfer rendezvous is the one it reaches the server from (a warning: a
   multi-homed node may advertise an interface the server cannot reach, docs/source/guides/multinode.md);
5. with several machines, a Gloo rendezvous of one process per node at ``main_process_ip:main_process_port``
   (the address and port the training launch uses), then: ``output_dir`` is one directory on every node (node 0
   writes a marker there, every other node must read it back) and torch, TRL, transformers, accelerate,
   DeepSpeed, vLLM and dfpo-trl are the same versions on every node.

Standard library, YAML and, for 2 and 5 only, torch. Nothing is written but the marker, removed at the end. The
checks live in ``preflight_settings`` (the settings and the failure), ``preflight_local`` (1-3),
``preflight_server`` (4) and ``preflight_cluster`` (5); this module runs them in order.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Sequence

from .files import removed_if_left_empty
from .preflight_cluster import check_across_nodes
from .preflight_local import check_gpus, check_interfaces, check_writable, interface_addresses, nccl_interfaces
from .preflight_server import check_server
from .preflight_settings import PreflightFailure, Settings, read_settings

__all__ = ["PreflightFailure", "Settings", "main", "nccl_interfaces", "read_settings", "run_checks"]


def run_checks(settings: Settings, report: Callable[[str, str], None]) -> None:
    """Every check in order; raises :class:`PreflightFailure` at the first failure."""
    report("ok", check_interfaces(interface_addresses()))
    report("ok", check_gpus(settings))
    report("ok", check_writable(settings.output_dir))
    if settings.server_mode:
        for status, line in check_server(settings):
            report(status, line)
    if settings.num_machines > 1:
        check_across_nodes(settings, report)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks on this node; 0 when all passed (warnings allowed), 1 at the first failure."""
    args = sys.argv[1:] if argv is None else list(argv)
    node = "?"

    def report(status: str, line: str) -> None:
        print(f"preflight: {status:<4} node {node}: {line}", flush=True)

    try:
        settings = read_settings(args)
        node = str(settings.machine_rank)
        with removed_if_left_empty(settings.output_dir):  # the checks create it; a preflight leaves no empty one
            run_checks(settings, report)
    except PreflightFailure as exc:
        print(f"preflight: FAIL node {node}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"preflight: node {node} ({socket.gethostname()}) is ready", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
