"""``dfpo-train --preflight``'s checks of this node alone: the NCCL and Gloo interfaces, the GPUs the accelerate
config starts here, a writable ``output_dir``. Standard library; torch for the GPU count only.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path

from .preflight_settings import MARKER_PREFIX, PreflightFailure, Settings

__all__ = ["check_gpus", "check_interfaces", "check_writable", "interface_addresses", "nccl_interfaces"]


def interface_addresses() -> dict[str, str | None]:
    """This node's network interfaces and each one's IPv4 address (None without one), read from the kernel."""
    import fcntl
    import struct

    found: dict[str, str | None] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                found[name] = socket.inet_ntoa(packed[20:24])
            except OSError:
                found[name] = None
    return found


def nccl_interfaces(spec: str, names: Sequence[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME's value ``spec`` selects among ``names``: comma-separated prefixes,
    ``=`` before the list for exact names, ``^`` to exclude instead (NCCL's documented syntax)."""
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    parts = [p for p in spec.removeprefix("=").split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in parts)

    return [n for n in names if hit(n) != exclude]


def check_interfaces(addresses: dict[str, str | None]) -> str:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, when set, select an interface with an address on this node."""
    listing = ", ".join(f"{n} ({a})" for n, a in addresses.items() if a) or "none with an IPv4 address"
    said = []
    nccl = os.environ.get("NCCL_SOCKET_IFNAME")
    if nccl:
        chosen = [n for n in nccl_interfaces(nccl, list(addresses)) if addresses[n]]
        if not chosen:
            raise PreflightFailure(
                f"NCCL_SOCKET_IFNAME={nccl} selects no interface with an address on {socket.gethostname()} "
                f"(interfaces: {listing}); fix: set it to the interface the nodes reach each other on, or unset it"
            )
        said.append(f"NCCL_SOCKET_IFNAME={nccl} -> {', '.join(f'{n} {addresses[n]}' for n in chosen)}")
    gloo = os.environ.get("GLOO_SOCKET_IFNAME")
    if gloo:
        if not addresses.get(gloo):
            raise PreflightFailure(
                f"GLOO_SOCKET_IFNAME={gloo} is not an interface with an address on {socket.gethostname()} "
                f"(interfaces: {listing}); fix: set it to one exact interface name, or unset it"
            )
        said.append(f"GLOO_SOCKET_IFNAME={gloo} -> {addresses[gloo]}")
    return "; ".join(said) or f"NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME unset (interfaces: {listing})"


def check_gpus(settings: Settings) -> str:
    """This node has the GPUs accelerate starts on it: num_processes / num_machines."""
    if settings.use_cpu:
        return "use_cpu (accelerate config or recipe): no GPU needed"
    if settings.num_processes % settings.num_machines:
        raise PreflightFailure(
            f"the accelerate config's num_processes {settings.num_processes} is not a multiple of num_machines "
            f"{settings.num_machines}; fix: num_processes counts every node's processes (GPUs per node x nodes)"
        )
    wanted = settings.num_processes // settings.num_machines
    import torch

    found = torch.cuda.device_count()
    if found < wanted:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise PreflightFailure(
            f"this node has {found} GPU(s) visible{f' (CUDA_VISIBLE_DEVICES={visible})' if visible else ''}, the "
            f"accelerate config starts {wanted} per node ({settings.num_processes} processes on "
            f"{settings.num_machines} machines); fix: request {wanted} GPUs per node (#SBATCH --gpus-per-node) or "
            "pass --num_processes (all nodes' processes together)"
        )
    extra = f" ({found - wanted} unused)" if found > wanted else ""
    return f"{found} GPU(s) visible, {wanted} used per node{extra}"


def check_writable(output_dir: str) -> str:
    """output_dir can be created and written here."""
    path = Path(output_dir)
    probe = path / f"{MARKER_PREFIX}write_{socket.gethostname()}_{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe")
        probe.unlink()
    except OSError as exc:
        raise PreflightFailure(
            f"output_dir {output_dir} is not writable on {socket.gethostname()} ({exc.strerror or exc}); fix: set "
            "--output_dir to a directory on shared storage that every node can write"
        ) from exc
    return f"output_dir {path.resolve()} is writable"
