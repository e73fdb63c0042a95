"""``dfpo-train --preflight`` (dfpo_trl/cli/preflight.py and its preflight_* modules): each check's line and fix,
against this machine, stand-in servers on 127.0.0.1, and two processes on one machine standing for two nodes (a Gloo
rendezvous, the shared output_dir marker, the versions)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from standin_vllm import GetOnlyServer, SilentServer

from dfpo_trl.cli import preflight, preflight_server
from dfpo_trl.cli.main import main
from dfpo_trl.cli.preflight import PreflightFailure, Settings, check_interfaces, check_server, nccl_interfaces

ROOT = Path(__file__).resolve().parents[2]


def settings(**changes: object) -> Settings:
    base = dict(output_dir="out", model="tiny", server_mode=True, server_url=None, group_port=51216, num_machines=1,
                num_processes=1, machine_rank=0, main_process_ip=None, main_process_port=29500, use_cpu=True,
                timeout=10.0)
    return Settings(**{**base, **changes})  # type: ignore[arg-type]


def test_nccl_interface_syntax_prefix_exact_and_exclude() -> None:
    names = ["lo", "eth0", "eth1", "ib0", "ibp12s0"]
    assert nccl_interfaces("ib", names) == ["ib0", "ibp12s0"]
    assert nccl_interfaces("=ib0", names) == ["ib0"]
    assert nccl_interfaces("eth0,ib0", names) == ["eth0", "ib0"]
    assert nccl_interfaces("^lo,eth", names) == ["ib0", "ibp12s0"]
    assert nccl_interfaces("^=eth0", names) == ["lo", "eth1", "ib0", "ibp12s0"]


def test_interfaces_resolve_or_fail_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    here = {"lo": "127.0.0.1", "eth0": "10.0.0.5", "ib0": None}
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert "unset" in check_interfaces(here)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert check_interfaces(here) == "NCCL_SOCKET_IFNAME=eth -> eth0 10.0.0.5; GLOO_SOCKET_IFNAME=eth0 -> 10.0.0.5"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib")  # ib0 is there but has no address
    with pytest.raises(PreflightFailure, match=r"NCCL_SOCKET_IFNAME=ib selects no interface with an address .*"
                                               r"eth0 \(10.0.0.5\).*fix: set it to the interface"):
        check_interfaces(here)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth")  # Gloo wants one exact name
    with pytest.raises(PreflightFailure, match="GLOO_SOCKET_IFNAME=eth is not an interface with an address"):
        check_interfaces(here)
    # and this machine's own interfaces are read: loopback always has its address
    assert preflight.interface_addresses().get("lo") == "127.0.0.1"


def test_gpu_count_against_the_accelerate_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """This machine has no GPU: the 4 x 8 config wants 8 per node, and the line says how to fix it."""
    code = main(["--preflight", str(ROOT / "recipes/qwen3_32b.yaml"), "--config_file",
                 str(ROOT / "recipes/accelerate/zero3_4x8.yaml"), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1
    assert "preflight: FAIL node 0: this node has 0 GPU(s) visible, the accelerate config starts 8 per node (32 " \
           "processes on 4 machines); fix: request 8 GPUs per node" in err
    with pytest.raises(PreflightFailure, match="num_processes 30 is not a multiple of num_machines 4"):
        preflight.check_gpus(settings(use_cpu=False, num_processes=30, num_machines=4))


def test_settings_come_from_the_training_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training command's own arguments: flags beat the accelerate config and the recipe, a null in the config
    is unset (zero3_4x8.yaml's main_process_ip: MASTER_ADDR then), Slurm's node id is the machine rank, and flags
    the preflight does not read are ignored."""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("SLURM_NODEID", "3")
    seen = preflight.read_settings([str(ROOT / "recipes/qwen3_32b.yaml"), "--config_file",
                                    str(ROOT / "recipes/accelerate/zero3_4x8.yaml"), "--vllm_server_host", "10.0.0.9",
                                    "--max_steps", "3", "--output_dir", "/shared/out"])
    assert (seen.num_machines, seen.num_processes, seen.machine_rank) == (4, 32, 3)
    assert (seen.main_process_ip, seen.main_process_port) == ("10.0.0.1", 29500)
    assert seen.server_mode and seen.server_url == "http://10.0.0.9:8000" and seen.group_port == 51216
    assert (seen.model, seen.output_dir, seen.use_cpu) == ("Qwen/Qwen3-32B", "/shared/out", False)
    seen = preflight.read_settings([str(ROOT / "recipes/smollm2_cpu.yaml"), "--machine_rank", "0"])
    assert not seen.server_mode and seen.use_cpu and seen.num_machines == 1 and seen.machine_rank == 0


def test_output_dir_not_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PreflightFailure, match=r"output_dir .*file/out is not writable .*fix: set --output_dir"):
        preflight.check_writable(str(blocker / "out"))


def test_server_checks_against_a_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reachable, same model, dev endpoints on, same vLLM: ok lines. Each break gives its own line and fix."""
    server = GetOnlyServer()
    try:
        lines = check_server(settings(server_url=server.url))
        assert [s for s, _ in lines] == ["ok"] * len(lines)
        assert any("it serves tiny" in line for _, line in lines)
        with pytest.raises(PreflightFailure, match=r"serves tiny, the recipe trains model_name_or_path Qwen/Qwen3-32B;"
                                                   r" fix: serve the recipe's model \(vllm serve Qwen/Qwen3-32B\)"):
            check_server(settings(server_url=server.url, model="Qwen/Qwen3-32B"))
        assert check_server(settings(server_url=server.url, model="/models/tiny"))  # a local copy of the same name
        monkeypatch.setattr(preflight_server, "local_version", lambda name: "0.30.0" if name == "vllm" else None)
        with pytest.raises(PreflightFailure, match="runs vLLM 0.26.0, this node has 0.30.0"):
            check_server(settings(server_url=server.url))
        server.routes.pop("/get_world_size")
        with pytest.raises(PreflightFailure, match="no /get_world_size \\(404\\).*VLLM_SERVER_DEV_MODE=1"):
            check_server(settings(server_url=server.url))
    finally:
        server.close()
    with pytest.raises(PreflightFailure, match=r"vLLM server 127.0.0.1:\d+ cannot be reached.*fix: start it first"):
        check_server(settings(server_url=server.url))  # closed: refused


def test_server_that_never_answers_fails_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    server = SilentServer()
    monkeypatch.setattr(preflight_server, "HTTP_TIMEOUT_S", 1.0)
    start = time.monotonic()
    try:
        with pytest.raises(PreflightFailure, match="accepts connections but /health or /v1/models did not answer "
                                                   "within 1 s"):
            check_server(settings(server_url=f"http://127.0.0.1:{server.port}"))
    finally:
        server.close()
    assert time.monotonic() - start < 5


def test_advertised_rendezvous_address_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 advertising one address and reaching the server from another: a warning line with the fix."""
    server = GetOnlyServer()
    monkeypatch.setattr(preflight_server, "_is_loopback", lambda server: False)
    monkeypatch.setattr(preflight_server, "advertised_address", lambda: "10.9.9.9")
    try:
        lines = dict((line, status) for status, line in check_server(settings(server_url=server.url)))
    finally:
        server.close()
    warned = [line for line, status in lines.items() if status == "warn"]
    assert len(warned) == 1 and "advertises 10.9.9.9:51216" in warned[0]
    assert "export VLLM_HOST_IP=127.0.0.1" in warned[0]


# ------------------------------------------------------------------------------------------------ two "nodes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(tmp_path: Path, outputs: list[Path], n: int = 2, timeout: float = 60.0,
           patch: dict[int, str] | None = None) -> list[tuple[int, str, str]]:
    """``n`` preflight processes on this machine standing for n nodes, each with its output_dir; ``patch``: code
    a node runs first. Returns each one's (exit code, stdout, stderr)."""
    accel = tmp_path / "accel.yaml"
    accel.write_text(yaml.safe_dump({"num_machines": 2, "num_processes": 2, "use_cpu": True,
                                     "main_process_port": _free_port(), "main_process_ip": "127.0.0.1"}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"use_cpu": True, "model_name_or_path": "tiny"}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(n):
        script = (patch or {}).get(rank, "") + "\nimport sys\nfrom dfpo_trl.cli.preflight import main\n" \
                                               "sys.exit(main(sys.argv[1:]))\n"
        procs.append(subprocess.Popen(
            [sys.executable, "-c", script, str(recipe), "--config_file", str(accel), "--machine_rank", str(rank),
             "--output_dir", str(outputs[rank]), "--timeout", str(timeout)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout + 90)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.mark.distributed
def test_two_nodes_sharing_output_dir_pass(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    results = _nodes(tmp_path, [shared, shared])
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"preflight: ok   node {rank}: rendezvous at 127.0.0.1:" in out and ": 2 nodes" in out
        assert f"output_dir {shared} is the same directory on every node" in out
        assert "same versions on every node: torch " in out and f"node {rank} (" in out.splitlines()[-1]
    assert not list(shared.glob(".dfpo_preflight_*"))  # the marker is removed
    assert not shared.exists()  # and the folder the preflight created for its checks, empty, too


@pytest.mark.distributed
def test_two_nodes_with_separate_output_dirs_or_versions_fail_on_every_node(tmp_path: Path) -> None:
    """Node 1 does not see node 0's marker (its output_dir is another directory: another disk on a real node); then
    node 1 has another torch. Every node fails with the same line, none hangs."""
    outputs = [tmp_path / "a", tmp_path / "b"]
    results = _nodes(tmp_path, outputs)
    for rank, (code, _, err) in enumerate(results):
        assert code == 1
        assert f"preflight: FAIL node {rank}: output_dir {outputs[rank]} is not shared: node 1 (" in err
        assert "cannot read the marker node 0" in err and "fix: put output_dir on storage every node mounts" in err
    other_torch = ("import dfpo_trl.cli.preflight_cluster as p\n_v = p.versions\n"
                   "p.versions = lambda: {**_v(), 'torch': '0.0.1'}\n")
    shared = tmp_path / "shared"
    results = _nodes(tmp_path, [shared, shared], patch={1: other_torch})
    for code, _, err in results:
        assert code == 1
        assert "versions differ across nodes: torch: node 0 (" in err and ") 0.0.1; fix: install the same" in err


@pytest.mark.distributed
def test_rendezvous_with_a_missing_node_fails_within_its_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    (code, _, err), = _nodes(tmp_path, [tmp_path / "out"], n=1, timeout=3.0)
    took = time.monotonic() - start
    assert code == 1
    assert "preflight: FAIL node 0: rendezvous of 2 nodes at 127.0.0.1:" in err
    assert "fix: check --main_process_ip (node 0's address, here 127.0.0.1), that port" in err
    assert took < 3.0 + 60  # the timeout, plus importing torch on a shared CPU
