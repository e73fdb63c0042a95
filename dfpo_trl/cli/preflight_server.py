"""``dfpo-train --preflight``'s checks of the vLLM server in server mode: it answers, serves the recipe's model,
exposes the weight-transfer endpoints and runs this node's vLLM; and the rendezvous address this node would advertise
(a warning). Standard library only.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from .preflight_settings import PreflightFailure, Settings, local_version

__all__ = ["HTTP_TIMEOUT_S", "advertised_address", "check_server", "source_address"]

# How long one HTTP request to the server may take: the health endpoint answers in milliseconds once up.
HTTP_TIMEOUT_S = 10.0


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310 (http only, user's host)
        return json.loads(response.read().decode() or "null")


def advertised_address() -> str | None:
    """The address TRL's client advertises for the weight-transfer rendezvous: vLLM's ``get_ip()``, which is
    ``VLLM_HOST_IP`` when set, else the source address of the default route."""
    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    return source_address(("8.8.8.8", 80))  # get_ip()'s own probe; a UDP connect sends nothing


def source_address(server: tuple[str, int]) -> str | None:
    """The local address this node's routing uses to reach ``server`` (name, port); a UDP connect sends no packet."""
    name, port = server
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(name), port))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def check_server(settings: Settings) -> list[tuple[str, str]]:
    """The server answers, serves the recipe's model, has the weight-transfer endpoints and this node's vLLM; and
    the rendezvous address (a warning). Returns (status, line) pairs; raises on a failure."""
    url = settings.server_url or ""
    parsed = urllib.parse.urlparse(url)
    server = (parsed.hostname or "", parsed.port or 80)
    env_fix = "start it first and wait for its /health (recipes/slurm/), check --vllm_server_host/--vllm_server_port"
    try:
        with socket.create_connection(server, timeout=HTTP_TIMEOUT_S):
            pass
    except OSError as exc:
        where = f"{server[0]}:{server[1]}"
        raise PreflightFailure(f"vLLM server {where} cannot be reached ({exc}); fix: {env_fix}") from exc
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
            'restart it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{"backend": "nccl"}\''
        ) from exc
    except (OSError, ValueError) as exc:
        raise PreflightFailure(f"vLLM server {url}: /get_world_size did not answer ({exc}); fix: {env_fix}") from exc
    size = world.get("world_size") if isinstance(world, dict) else world
    lines.append(("ok", f"its weight-transfer endpoints answer (world size {size})"))
    local = local_version("vllm")
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
    if settings.machine_rank == 0 and not _is_loopback(server):
        advertised, reaching = advertised_address(), source_address(server)
        if advertised and reaching and advertised != reaching:
            warning = (
                f"this node advertises {advertised}:{settings.group_port} for the weight-transfer rendezvous but "
                f"reaches the server from {reaching}; if the server cannot reach {advertised} the first weight "
                f"sync hangs until vllm_sync_timeout: export VLLM_HOST_IP={reaching} on this node"
            )
            lines.append(("warn", warning))
        else:
            lines.append(("ok", f"weight-transfer rendezvous at {advertised or '?'}:{settings.group_port}"))
    return lines


def _is_loopback(server: tuple[str, int]) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(server[0])).is_loopback
    except (OSError, ValueError):
        return False
