"""``dfpo-train --preflight``'s settings: what the checks read from the training command line (the recipe, the
accelerate config, the flags), the failure every check raises, and this node's installed versions.
Standard library and YAML only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MARKER_PREFIX", "PreflightFailure", "Settings", "local_version", "read_settings"]

MARKER_PREFIX = ".dfpo_preflight_"


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
        description="Check this node before a multi-node job (docs/source/guides/multinode.md); run it on every node.",
    )
    parser.add_argument("recipe", help="the training recipe (YAML)")
    parser.add_argument("--config_file", help="the accelerate config the job is launched with")
    for name in (
        "machine_rank",
        "num_machines",
        "num_processes",
        "main_process_port",
        "vllm_server_port",
        "vllm_group_port",
    ):
        parser.add_argument(f"--{name}", type=int)
    for name in (
        "main_process_ip",
        "output_dir",
        "model_name_or_path",
        "vllm_server_host",
        "vllm_server_base_url",
        "vllm_mode",
        "use_vllm",
        "rdzv_backend",
    ):
        parser.add_argument(f"--{name}")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds the rendezvous of the nodes may take (default 120)"
    )
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


def local_version(name: str) -> str | None:
    """This node's version of the distribution ``name``, None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
