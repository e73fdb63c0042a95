"""``dfpo-train --preflight`` (or ``python -m dfpo_trl.app.preflight``): the checks to run on every node before a
multi-node job, each answered in one line with its fix, so that a job does not start only to hang.

    python -m dfpo_trl.app.preflight recipes/qwen3_32b.yaml --config_file recipes/accelerate/zero3_4x8.yaml \\
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --vllm_server_host $VLLM_HOST

It takes the training command's own arguments (the recipe, the accelerate flags, the recipe's fields on the command
line) and checks, in this order, stopping at the first failure with exit code 1:

1. ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``, when set, name interfaces of this node that have an address;
2. this node has the GPUs the accelerate config starts on it (``num_processes / num_machines``);
3. ``output_dir`` is writable;
4. in vLLM server mode: the server answers on its host and port, serves the recipe's model, exposes the
   weight-transfer endpoints (``VLLM_SERVER_DEV_MODE=1``) and runs this node's vLLM version; and the address this
   node would advertise for the weight-transfer rendezvous is the one it reaches the server from (a warning: a
   multi-homed node may advertise an interface the server cannot reach, README "Several nodes");
5. with several machines, a Gloo rendezvous of one process per node at ``main_process_ip:main_process_port``
   (the address and port the training launch uses), then: ``output_dir`` is one directory on every node (node 0
   writes a marker there, every other node must read it back) and torch, TRL, transformers, accelerate,
   DeepSpeed, vLLM and dfpo-trl are the same versions on every node.

Standard library, YAML and, for 2 and 5 only, torch. Nothing is written but the marker, removed at the end.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

__all__ = ["PreflightFailure", "Settings", "main", "nccl_interfaces", "read_settings", "run_checks"]

# The packages whose versions must agree across nodes (their distribution names).
VERSIONED = ("torch", "trl", "transformers", "accelerate", "deepspeed", "vllm", "dfpo-trl")
MARKER_PREFIX = ".dfpo_preflight_"
# How long one HTTP request to the server may take: the health endpoint answers in milliseconds once up.
HTTP_TIMEOUT_S = 10.0


class PreflightFailure(Exception):
    """A check that failed: ``str(exc)`` is its line (the problem, then the fix)."""


@dataclass
class Settings:
    """What the checks read: the training command's recipe fields and accelerate flags, command line first."""

    output_dir: str
    model: str | None
    server_mode: bool
    server_url: str | None
    group_port: int
    num_machines: int
    num_processes: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int
    use_cpu: bool
    timeout: float


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dfpo-train --preflight",
        description="Check this node before a multi-node job (README, 'Several nodes'); run it on every node.",
    )
    parser.add_argument("recipe", help="the training recipe (YAML)")
    parser.add_argument("--config_file", help="the accelerate config the job is launched with")
    for name in ("machine_rank", "num_machines", "num_processes", "main_process_port", "vllm_server_port",
                 "vllm_group_port"):
        parser.add_argument(f"--{name}", type=int)
    for name in ("main_process_ip", "output_dir", "model_name_or_path", "vllm_server_host", "vllm_server_base_url",
                 "vllm_mode", "use_vllm", "rdzv_backend"):
        parser.add_argument(f"--{name}")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds the rendezvous of the nodes may take (default 120)")
    return parser


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def _load_yaml(path: str, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PreflightFailure(f"{what} {path}: cannot be read ({exc}); fix: pass the file the job uses") from exc
    if not isinstance(data, dict):
        raise PreflightFailure(f"{what} {path}: not a YAML mapping; fix: pass the file the job uses")
    return data


def read_settings(argv: Sequence[str]) -> Settings:
    """The settings from the training command line ``argv``; flags the preflight does not read are ignored, so
    the training command's own arguments can be passed as they are."""
    args, _ = _parser().parse_known_args(list(argv))
    recipe = _load_yaml(args.recipe, "recipe")
    accel = _load_yaml(args.config_file, "accelerate config") if args.config_file else {}

    def pick(flag: Any, source: dict[str, Any], key: str, default: Any = None) -> Any:
        """The flag, else the file's value (a null there is unset: zero3_4x8.yaml's main_process_ip), else default."""
        if flag is not None:
            return flag
        return default if source.get(key) is None else source[key]

    use_vllm = str(pick(args.use_vllm, recipe, "use_vllm", False)).lower() in ("true", "1", "yes")
    server_mode = use_vllm and str(pick(args.vllm_mode, recipe, "vllm_mode", "colocate")) == "server"
    base_url = pick(args.vllm_server_base_url, recipe, "vllm_server_base_url")
    if base_url is None and server_mode:
        host = pick(args.vllm_server_host, recipe, "vllm_server_host", "0.0.0.0")
        base_url = f"http://{host}:{pick(args.vllm_server_port, recipe, 'vllm_server_port', 8000)}"
    num_machines = int(pick(args.num_machines, accel, "num_machines", 1))
    machine_rank = args.machine_rank
    if machine_rank is None:  # under Slurm, one task per node: the node's index in the step
        machine_rank = _env_int("MACHINE_RANK", "NODE_RANK", "SLURM_NODEID")
    return Settings(
        output_dir=str(pick(args.output_dir, recipe, "output_dir", "trainer_output")),
        model=pick(args.model_name_or_path, recipe, "model_name_or_path"),
        server_mode=server_mode,
        server_url=base_url.rstrip("/") if base_url else None,
        group_port=int(pick(args.vllm_group_port, recipe, "vllm_group_port", 51216)),
        num_machines=num_machines,
        num_processes=int(pick(args.num_processes, accel, "num_processes", 1)),
        machine_rank=int(pick(machine_rank, accel, "machine_rank", 0)),
        main_process_ip=pick(args.main_process_ip, accel, "main_process_ip", os.environ.get("MASTER_ADDR")),
        main_process_port=int(pick(args.main_process_port, accel, "main_process_port", 29500)),
        use_cpu=bool(accel.get("use_cpu", False)) or str(recipe.get("use_cpu", False)).lower() == "true",
        timeout=args.timeout,
    )


# ------------------------------------------------------------------------------------------------ interfaces


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


# ------------------------------------------------------------------------------------------------ GPUs, output_dir


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


# ------------------------------------------------------------------------------------------------ the vLLM server


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310 (http only, user's host)
        return json.loads(response.read().decode() or "null")


def _local_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def advertised_address() -> str | None:
    """The address TRL's client advertises for the weight-transfer rendezvous: vLLM's ``get_ip()``, which is
    ``VLLM_HOST_IP`` when set, else the source address of the default route."""
    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    return source_address("8.8.8.8", 80)  # get_ip()'s own probe; a UDP connect sends nothing


def source_address(host: str, port: int) -> str | None:
    """The local address this node's routing uses to reach ``host`` (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), port))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def check_server(settings: Settings) -> list[tuple[str, str]]:
    """The server answers, serves the recipe's model, has the weight-transfer endpoints and this node's vLLM; and
    the rendezvous address (a warning). Returns (status, line) pairs; raises on a failure."""
    url = settings.server_url or ""
    parsed = urllib.parse.urlparse(url)
    host, port = parsed.hostname or "", parsed.port or 80
    env_fix = "start it first and wait for its /health (recipes/slurm/), check --vllm_server_host/--vllm_server_port"
    try:
        with socket.create_connection((host, port), timeout=HTTP_TIMEOUT_S):
            pass
    except OSError as exc:
        raise PreflightFailure(f"vLLM server {host}:{port} cannot be reached ({exc}); fix: {env_fix}") from exc
    try:
        _get_json(f"{url}/health")
        models = _get_json(f"{url}/v1/models")
    except (OSError, ValueError) as exc:  # urllib's errors and timeouts are OSErrors
        raise PreflightFailure(
            f"vLLM server {url} accepts connections but /health or /v1/models did not answer within "
            f"{HTTP_TIMEOUT_S:.0f} s ({exc}); fix: check the server's log (still loading, hung, or another service "
            "on that port)"
        ) from exc
    lines = [("ok", f"vLLM server {url} answers /health")]
    served = [(m.get("id"), m.get("root")) for m in (models or {}).get("data", []) if isinstance(m, dict)]
    if settings.model:
        wanted = settings.model.rstrip("/")
        names = {str(n).rstrip("/") for pair in served for n in pair if n}
        same = wanted in names or Path(wanted).name in {Path(n).name for n in names}
        if not same:
            raise PreflightFailure(
                f"vLLM server {url} serves {', '.join(sorted(names)) or 'no model'}, the recipe trains "
                f"model_name_or_path {wanted}; fix: serve the recipe's model (vllm serve {wanted}) or train the "
                "served one"
            )
        lines.append(("ok", f"it serves {wanted}"))
    try:
        world = _get_json(f"{url}/get_world_size")
    except urllib.error.HTTPError as exc:
        raise PreflightFailure(
            f"vLLM server {url} has no /get_world_size ({exc.code}): its weight-transfer endpoints are off; fix: "
            "restart it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\": \"nccl\"}'"
        ) from exc
    except (OSError, ValueError) as exc:
        raise PreflightFailure(f"vLLM server {url}: /get_world_size did not answer ({exc}); fix: {env_fix}") from exc
    size = world.get("world_size") if isinstance(world, dict) else world
    lines.append(("ok", f"its weight-transfer endpoints answer (world size {size})"))
    local = _local_version("vllm")
    try:
        remote = (_get_json(f"{url}/version") or {}).get("version")
    except (OSError, ValueError, AttributeError):
        remote = None
    if local and remote and local != remote:
        raise PreflightFailure(
            f"vLLM server {url} runs vLLM {remote}, this node has {local}; the weight transfer's protocol changes "
            f"between releases; fix: install vLLM {remote} here (or serve with {local})"
        )
    lines.append(("ok", f"vLLM {remote or '?'} on the server, {local or 'not installed'} here"))
    if settings.machine_rank == 0 and not _is_loopback(host):
        advertised, reaching = advertised_address(), source_address(host, port)
        if advertised and reaching and advertised != reaching:
            lines.append((
                "warn",
                f"this node advertises {advertised}:{settings.group_port} for the weight-transfer rendezvous but "
                f"reaches the server from {reaching}; if the server cannot reach {advertised} the first weight sync "
                f"hangs until vllm_sync_timeout: export VLLM_HOST_IP={reaching} on this node",
            ))
        else:
            lines.append(("ok", f"weight-transfer rendezvous at {advertised or '?'}:{settings.group_port}"))
    return lines


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------------ across nodes


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
    found = {name: _local_version(name) or "absent" for name in VERSIONED}
    found["python"] = ".".join(map(str, sys.version_info[:3]))
    return found


def check_across_nodes(settings: Settings, report: Callable[[str, str], None]) -> None:
    """The Gloo rendezvous of one process per node, then the shared output_dir and the versions."""
    import datetime

    import torch.distributed as dist

    address = f"{settings.main_process_ip}:{settings.main_process_port}"
    fix = (f"fix: check --main_process_ip (node 0's address, here {settings.main_process_ip}), that port "
           f"{settings.main_process_port} is open between the nodes, --num_machines and each node's --machine_rank, "
           "and GLOO_SOCKET_IFNAME on multi-homed nodes")
    if not settings.main_process_ip:
        raise PreflightFailure(f"no node 0 address for {settings.num_machines} machines; {fix}")
    done = _deadline(settings.timeout + 30, f"rendezvous at {address} still open after {settings.timeout + 30:.0f} "
                                            f"s; {fix}")
    start = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=settings.machine_rank,
                                world_size=settings.num_machines,
                                timeout=datetime.timedelta(seconds=settings.timeout))
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
            detail = "; ".join(f"{k}: " + ", ".join(f"node {r} ({hosts[r]}) {every[r][k]}" for r in
                                                     range(len(every))) for k in differ)
            raise PreflightFailure(f"versions differ across nodes: {detail}; fix: install the same versions on every "
                                   "node (one environment on shared storage, or the same pinned requirements)")
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


# ------------------------------------------------------------------------------------------------ the run


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
        run_checks(settings, report)
    except PreflightFailure as exc:
        print(f"preflight: FAIL node {node}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"preflight: node {node} ({socket.gethostname()}) is ready", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
