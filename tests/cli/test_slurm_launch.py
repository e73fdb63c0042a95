"""recipes/slurm/: the dry run prints every node's exact command; each is checked against the accelerate config and
the recipe it launches (process counts, ports, server host and port, model, output_dir) through accelerate's own
launch parser and dfpo-train's, for the default shape and for other node counts."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from dfpo_trl.cli.parser import parse_args
from dfpo_trl.cli.preflight import read_settings

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "recipes" / "slurm" / "qwen3_32b.sbatch"
RECIPE = yaml.safe_load((ROOT / "recipes" / "qwen3_32b.yaml").read_text())
ACCEL = yaml.safe_load((ROOT / "recipes" / "accelerate" / "zero3_4x8.yaml").read_text())

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the launch scripts are bash")


def dry_run(**env: str) -> dict[str, list[tuple[str, int | None, list[str]]]]:
    """The dry run's commands by role: server, preflight, train; each (host, machine rank, argv)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SBATCH), "--dry-run"], capture_output=True, text=True, timeout=60,
                          env={**clean, **env}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    roles: dict[str, list[tuple[str, int | None, list[str]]]] = {"server": [], "preflight": [], "train": []}
    for line in proc.stdout.splitlines():
        if line.startswith("#"):
            continue
        head, _, command = line.partition(": ")
        role, host, *rank = head.split(" ", 2)
        number = int(rank[0].removeprefix("(machine rank ").removesuffix(")")) if rank else None
        roles[role].append((host, number, shlex.split(command)))
    return roles


def accelerate_args(argv: list[str]) -> tuple[object, list[str]]:
    """accelerate launch's own parse of a train command, and the arguments it hands the module (dfpo-train's)."""
    from accelerate.commands.launch import launch_command_parser

    assert argv[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(argv[2:])
    return args, [args.training_script, *args.training_script_args]


@pytest.mark.parametrize("nodes, train_nodes", [(None, 4), ("h1 h2 h3", 2)])
def test_dry_run_matches_the_accelerate_config_and_the_recipe(
    nodes: str | None, train_nodes: int, gpu_recipes_parse_here: None
) -> None:
    roles = dry_run(**({"DRY_RUN_NODES": nodes} if nodes else {}))
    hosts = nodes.split() if nodes else [f"node{i}" for i in range(5)]
    server_host = hosts[-1]
    ((host, _, server),) = roles["server"]
    assert host == server_host
    assert server[:4] == ["env", "VLLM_SERVER_DEV_MODE=1", "vllm", "serve"]
    assert server[4] == RECIPE["model_name_or_path"]

    def value(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert int(value(server, "--port")) == RECIPE["vllm_server_port"]
    assert int(value(server, "--max-model-len")) == RECIPE["vllm_max_model_length"]
    assert int(value(server, "--tensor-parallel-size")) == 8
    assert value(server, "--weight-transfer-config") == '{"backend": "nccl"}'

    assert [(h, r) for h, r, _ in roles["train"]] == [(hosts[i], i) for i in range(train_nodes)]
    assert [(h, r) for h, r, _ in roles["preflight"]] == [(hosts[i], i) for i in range(train_nodes)]
    for (_, rank, train), (_, _, check) in zip(roles["train"], roles["preflight"], strict=True):
        args, script_args = accelerate_args(train)
        assert args.config_file == "recipes/accelerate/zero3_4x8.yaml"
        assert args.num_machines == train_nodes and args.num_processes == train_nodes * 8
        if train_nodes == ACCEL["num_machines"]:  # the default: the config's own shape
            assert (args.num_machines, args.num_processes) == (ACCEL["num_machines"], ACCEL["num_processes"])
        assert args.machine_rank == rank and args.main_process_ip == hosts[0]
        assert args.main_process_port == ACCEL["main_process_port"]
        assert args.rdzv_backend == "c10d" and args.module and script_args[0] == "dfpo_trl"
        _, config, model = parse_args(script_args[1:])  # dfpo-train's parse of what accelerate runs
        assert config.vllm_server_host == server_host and config.vllm_server_port == RECIPE["vllm_server_port"]
        assert config.output_dir == RECIPE["output_dir"] and model.model_name_or_path == RECIPE["model_name_or_path"]
        assert config.use_vllm and config.vllm_mode == "server"
        # the preflight reads the same counts, ports, server and directory as the training command
        assert check[:3] == ["python", "-m", "dfpo_trl.cli.preflight"]
        seen = read_settings(check[3:])
        assert (seen.num_machines, seen.num_processes, seen.machine_rank) == (train_nodes, train_nodes * 8, rank)
        assert (seen.main_process_ip, seen.main_process_port) == (hosts[0], ACCEL["main_process_port"])
        assert seen.server_url == f"http://{server_host}:{RECIPE['vllm_server_port']}"
        assert seen.output_dir == config.output_dir and seen.model == model.model_name_or_path


def test_dry_run_refuses_too_few_nodes_and_runs_nothing_outside_slurm() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SBATCH), "--dry-run"], capture_output=True, text=True, timeout=60,
                          env={**clean, "DRY_RUN_NODES": "a b", "TRAIN_NODES": "2"}, cwd=ROOT)
    assert proc.returncode == 2 and "TRAIN_NODES=2 needs 3 nodes (training + 1 server), the job has 2" in proc.stderr
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, timeout=60, env=clean, cwd=ROOT)
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr


def test_sbatch_header_wires_the_time_limit_signal_and_bad_exit() -> None:
    """SIGTERM before the time limit reaches every step's processes (dfpo-train's clean stop), and every srun
    kills its other tasks when one fails."""
    text = SBATCH.read_text()
    assert "#SBATCH --signal=TERM@300" in text and "#SBATCH --nodes=5" in text and "#SBATCH --gpus-per-node=8" in text
    launcher = (ROOT / "recipes" / "slurm" / "dfpo_multinode.sh").read_text()
    assert launcher.count("--kill-on-bad-exit=1") == 2
    for name in ("VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_GID_INDEX"):
        assert f"# {name}:" in text  # each network variable is explained where it is set


# ---------------------------------------------------------------------------------------- the job, on one machine

SHIMS = ROOT / "tests" / "cli" / "slurm_shims"  # srun, scontrol, vllm (a stand-in server), accelerate (a stand-in run)


def run_job(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[dict], float]:
    """The sbatch script's batch step on this machine: Slurm's srun and scontrol, `vllm serve` and `accelerate
    launch` are stand-ins (tests/cli/slurm_shims/); the preflight is the real one, on two "nodes" over Gloo."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        vllm_port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        main_port = s.getsockname()[1]
    config = tmp_path / "accel.yaml"
    config.write_text(yaml.safe_dump({**ACCEL, "use_cpu": True}))  # the preflight's GPU check: none here
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "use_vllm": True, "vllm_mode": "server",
                                      "output_dir": str(tmp_path / "out")}))
    log = tmp_path / "log.jsonl"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base = {
        "PATH": f"{SHIMS}{os.pathsep}{Path(os.sys.executable).parent}{os.pathsep}{clean['PATH']}",
        "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FAKE_LOG": str(log),
        "SLURM_JOB_NODELIST": "n0 n1 srv", "SLURM_SUBMIT_DIR": str(ROOT),
        "RECIPE": str(recipe), "ACCELERATE_CONFIG": str(config), "MODEL": "tiny", "OUTPUT_DIR": str(tmp_path / "out"),
        "GPUS_PER_NODE": "1", "SERVER_TP": "1", "VLLM_PORT": str(vllm_port), "MAIN_PORT": str(main_port),
        "SERVER_HOST": "127.0.0.1", "MASTER_HOST": "127.0.0.1", "HEALTH_POLL_S": "0.5", "MONITOR_POLL_S": "0.5",
        "STOP_GRACE_S": "20",
    }
    start = time.monotonic()
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, timeout=240,
                          env={**clean, **base, **env}, cwd=tmp_path)
    took = time.monotonic() - start
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, events, took


@pytest.mark.distributed
def test_job_starts_the_server_then_the_preflight_then_training(tmp_path: Path) -> None:
    proc, events, _ = run_job(tmp_path, FAKE_SERVER_START_S="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert events[0]["role"] == "server" and events[0]["argv"][:2] == ["serve", "tiny"]
    assert sorted(e["rank"] for e in events if e["role"] == "train") == [0, 1]
    out = proc.stdout
    assert out.index("vLLM server up at http://127.0.0.1:") < out.index("preflight: node 0") < \
        out.index("training ended with exit code 0")
    for rank in (0, 1):
        assert f"preflight: ok   node {rank}: vLLM server http://127.0.0.1:" in out
        assert f"preflight: ok   node {rank}: output_dir {tmp_path / 'out'} is the same directory on every node" in out


@pytest.mark.distributed
def test_job_stops_training_when_the_server_dies_and_never_trains_without_one(tmp_path: Path) -> None:
    """The server exits 1 s after both training tasks started (the stand-in run would take 120 s): the job sends
    SIGTERM, training stops as dfpo-train does (143), the job ends with that code in seconds. A server that fails at
    start ends the job before any preflight or training."""
    proc, events, took = run_job(tmp_path, FAKE_SERVER_EXIT_AFTER_TRAIN="2", FAKE_TRAIN_S="120")
    ended = time.time()
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "the vLLM server on srv exited during training; stopping training" in proc.stderr
    assert [e["role"] for e in events][-1] == "server-exit"  # training had started when the server died
    assert sorted(e["rank"] for e in events if e["role"] == "train") == [0, 1]
    lost = ended - events[-1]["time"]
    print(f"server lost to the job's end: {lost:.1f} s (the job took {took:.1f} s)")  # poll: 0.5 s
    assert lost < 20, lost
    (tmp_path / "log.jsonl").unlink()
    proc, events, _ = run_job(tmp_path, FAKE_SERVER_FAIL="1")
    assert proc.returncode == 1
    assert "the vLLM server on srv exited before http://127.0.0.1:" in proc.stderr
    assert [e["role"] for e in events] == ["server"] and "preflight:" not in proc.stdout
