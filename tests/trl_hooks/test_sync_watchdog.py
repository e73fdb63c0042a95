"""The server-mode weight-sync watchdog (``vllm_sync_timeout``, trl_hooks/sync_watchdog.py) against stand-in
servers on 127.0.0.1: a stalled server ends the run, or the sync, within the timeout with one line, and what was in
``output_dir`` stays as it was.

vLLM is not installed here: the child processes tell TRL's modules it is available, as the colocate test does, and
run TRL's own ``VLLMClient`` against the stand-in. Each run is a child process, since the watchdog ends its process.
The NCCL set-up (``init_communicator``) needs a GPU and is not reached on the CPU; the HTTP calls that precede it
and the weight update's are, and they are what blocks when the server is dead or hung.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standin_vllm import GetOnlyServer, OneRolloutServer, SilentServer
from tiny import save_tiny_chat_model, write_tiny_recipe

from dfpo_trl.trl_hooks.sync_watchdog import STALL_EXIT_CODE, SyncWatchdog

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# Tell TRL's vLLM modules that vLLM is installed (it is not: nothing of vLLM itself is called before the stall).
VLLM_PRESENT = (
    "import trl.generation.vllm_client as vc, trl.generation.vllm_generation as vg\n"
    "vc.is_vllm_available = vg.is_vllm_available = lambda *a, **k: True\n"
)


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with its content's hash: what "untouched" is checked against."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_guard_returns_quietly_in_time_and_zero_means_no_limit() -> None:
    """A phase that ends in time leaves no line and no exit; a watchdog of 0 never arms."""
    exits: list[int] = []
    dog = SyncWatchdog(0.5, exit=exits.append)
    with dog.guard("a quick phase", lambda: "nowhere"):
        pass
    with SyncWatchdog(0, exit=exits.append).guard("unguarded", lambda: "nowhere"):
        time.sleep(0.3)
    time.sleep(0.7)
    assert exits == []


def test_guard_writes_one_line_and_exits_124_on_expiry(capfd: pytest.CaptureFixture[str]) -> None:
    """Past the deadline: one line naming the phase, the addresses and the variables, then exit code 124."""
    exits: list[int] = []
    dog = SyncWatchdog(0.3, exit=exits.append)
    with dog.guard("the weight sync", lambda: "vLLM server http://10.0.0.9:8000, rendezvous 10.0.0.1:51216"):
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    assert exits == [STALL_EXIT_CODE]
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("dfpo-train: the weight sync did not finish within 0 s (vllm_sync_timeout)")
    for part in ("http://10.0.0.9:8000", "10.0.0.1:51216", "VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                 "NCCL_IB_GID_INDEX", "--vllm_sync_timeout", "--resume_from_checkpoint"):
        assert part in lines[0]


def test_a_server_mode_sync_logs_what_it_streamed_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """Beside each phase's duration, the sync's size from TRL's metadata (name, dtype, shape per tensor), at DEBUG
    only: what a deadline is set from (docs/source/guides/cli.md)."""
    from types import SimpleNamespace

    from dfpo_trl.trl_hooks.sync_watchdog import WatchedVLLMGeneration, streamed_size

    metadata = [("a", "bfloat16", [2, 3]), ("b", "float32", [4]), ("c", "bfloat16", [])]
    assert streamed_size(metadata) == "the weight sync streamed 3 tensors, 11 parameters, 30 bytes (bfloat16, float32)"
    streamed: list[object] = []
    gen = WatchedVLLMGeneration.__new__(WatchedVLLMGeneration)  # TRL's server-mode state, no server
    gen.mode, gen.enable_sleep_mode, gen._weight_metadata, gen.watchdog = "server", False, metadata, SyncWatchdog(0)
    gen.accelerator = SimpleNamespace(is_main_process=True)
    gen.vllm_client = SimpleNamespace(update_named_params=lambda meta, params: streamed.append(meta),
                                      reset_prefix_cache=lambda: None)
    gen._iter_named_params = lambda: iter(())
    gen.sync_weights()  # not logged: INFO and above only
    with caplog.at_level(logging.DEBUG, logger="dfpo_trl.trl_hooks.sync_watchdog"):
        gen.sync_weights()
    assert streamed == [metadata, metadata]
    assert [r.getMessage() for r in caplog.records] == [
        "the weight sync streamed 3 tensors, 11 parameters, 30 bytes (bfloat16, float32)"]


@pytest.mark.slow
def test_run_against_a_server_that_never_answers_ends_within_the_timeout(
    tmp_path: Path, silent_server: SilentServer
) -> None:
    """``dfpo-train`` in server mode against a server that accepts and never answers: TRL's client would wait
    forever for /health. The run ends with exit code 124 within vllm_server_timeout + vllm_sync_timeout of the
    connection, with one line, and output_dir (an earlier checkpoint, a note) is byte for byte as it was."""
    out = tmp_path / "out"
    argv = write_tiny_recipe(tmp_path, save_tiny_chat_model(tmp_path / "model"), out, use_vllm=True,
                             vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=silent_server.port,
                             vllm_server_timeout=1.0, vllm_sync_timeout=3.0, max_steps=2)
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    (out / "checkpoint-2" / "dfpo_rollout_state_0.pt").write_bytes(b"\x00" * 64)
    (out / "notes.txt").write_text("kept")
    before = tree(out)
    script = VLLM_PRESENT + "import sys\nfrom dfpo_trl.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=300,
    )
    ended = time.monotonic()
    assert proc.returncode == STALL_EXIT_CODE, proc.stderr[-3000:]
    assert silent_server.first_accept is not None
    stalled_for = ended - silent_server.first_accept
    print(f"stall to exit: {stalled_for:.2f} s (limit 1 + 3 s); whole run {ended - start:.1f} s")
    assert 4.0 - 0.5 <= stalled_for <= 4.0 + 5.0  # the deadline, plus the child's exit and this test's polling
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dfpo-train:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "the vLLM server connection and weight-transfer set-up (init_communicator) did not finish" in lines[0]
    assert f"http://127.0.0.1:{silent_server.port}" in lines[0] and ":51216 (vllm_group_port)" in lines[0]
    assert "Traceback" not in proc.stderr
    assert tree(out) == before


@pytest.mark.distributed
def test_stalled_weight_sync_ends_every_process_within_the_timeout(tmp_path: Path) -> None:
    """Two processes (gloo) sync weights to a server that answered at start-up and no longer answers: the main
    process blocks in TRL's update request, the other in the barrier that ends the guarded sync. Both end with
    exit code 124 and the line within the timeout of the first request, not in the next collective."""
    server = GetOnlyServer()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    script = VLLM_PRESENT + f"""
import sys
from accelerate import Accelerator
from tiny import tiny_model
from trl.distributed import DistributedBackend
from dfpo_trl.trl_hooks.sync_watchdog import SyncWatchdog, WatchedVLLMGeneration
accelerator = Accelerator(cpu=True)
# The state TRL's __init__ leaves in server mode; its init_communicator (NCCL) needs a GPU, so the group is absent.
gen = WatchedVLLMGeneration.__new__(WatchedVLLMGeneration)
gen.model, gen.accelerator, gen._dist = tiny_model(), accelerator, DistributedBackend(accelerator)
gen.mode, gen.enable_sleep_mode, gen._weight_metadata = "server", False, None
gen.server_base_url, gen.server_host, gen.server_port = {url!r}, None, None
gen.group_port, gen.server_timeout = 51216, 5
gen.watchdog = SyncWatchdog(3.0)
if accelerator.is_main_process:
    gen.vllm_client = vc.VLLMClient(base_url={url!r}, group_port=51216, connection_timeout=5)
accelerator.wait_for_everyone()
print("sync", flush=True)
gen.sync_weights()
print("the sync returned", flush=True)
"""
    port = _free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**child_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=tmp_path))
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            results.append((proc.returncode, out, err, time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.close()
    assert server.first_post is not None
    for rank, (code, out, err, ended) in enumerate(results):
        assert code == STALL_EXIT_CODE, (rank, err[-3000:])
        assert "sync" in out and "the sync returned" not in out
        lines = [line for line in err.splitlines() if line.startswith("dfpo-train:")]
        assert len(lines) == 1, (rank, err[-3000:])
        assert "the weight sync to the vLLM server (update_named_params) did not finish within 3 s" in lines[0]
        assert f"on process {rank}:" in lines[0] and url in lines[0]
        print(f"process {rank}: first request to exit {ended - server.first_post:.2f} s (limit 3 s)")
        assert ended - server.first_post <= 3.0 + 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_generation(timeout: float | None, client_generate: Any, exits: list[int]) -> Any:
    """TRL's server-mode VLLMGeneration state (one process, no server) with ``client_generate`` as its client's."""
    from types import SimpleNamespace

    from dfpo_trl.trl_hooks.sync_watchdog import WatchedVLLMGeneration

    gen = WatchedVLLMGeneration.__new__(WatchedVLLMGeneration)
    gen.mode, gen.enable_sleep_mode, gen.max_completion_length = "server", False, 8
    gen.temperature, gen.top_p, gen.top_k, gen.min_p, gen.repetition_penalty = 1.0, 1.0, 0, 0.0, 1.0
    gen.logprobs, gen.structured_outputs_regex, gen.generation_kwargs = 0, None, {}
    gen.server_base_url, gen.server_host, gen.server_port = "http://10.0.0.9:8000", None, None
    gen.accelerator = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0)
    gen.vllm_client = SimpleNamespace(generate=client_generate)
    gen.watchdog, gen.generation_timeout = SyncWatchdog(600, exit=exits.append), timeout
    return gen


def test_a_generation_request_past_its_deadline_ends_the_process_with_one_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Server mode: the request blocks past vllm_generation_timeout -> the line and exit code 124; in time, nothing."""
    import threading

    exits: list[int] = []
    hung = threading.Event()

    def answer(prompts: list[list[int]], n: int, **_: Any) -> dict[str, Any]:
        hung.wait(5 if len(prompts) == 1 else 0)  # the first call hangs until the watchdog has fired
        return {"prompt_ids": prompts, "completion_ids": [[3]] * (len(prompts) * n), "logprobs": None}

    gen = _server_generation(0.4, answer, exits)
    gen.generate([[5, 6]] * 4, None, 4)  # 4 rows of one prompt: one request
    assert exits == [STALL_EXIT_CODE]
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("dfpo-train: the generation request to the vLLM server (4 completions of up to 8 "
                               "tokens) did not finish within 0 s (vllm_generation_timeout) on process 0: vLLM server "
                               "http://10.0.0.9:8000. Check that the server is alive")
    assert "raise --vllm_generation_timeout if generation is only slow" in lines[0]
    assert "--resume_from_checkpoint" in lines[0]
    hung.set()
    exits.clear()
    gen.generate([[5, 6], [5, 6], [7, 8], [7, 8]], None, 2)  # answered at once
    time.sleep(0.6)
    assert exits == [] and capfd.readouterr().err == ""


def test_the_generation_deadline_is_the_field_or_the_stated_default() -> None:
    from dfpo_trl.trl_hooks.sync_watchdog import GENERATION_FLOOR_S, GENERATION_TOKENS_PER_S, generation_deadline

    assert generation_deadline(4096, 30720, None) == GENERATION_FLOOR_S + 4096 * 30720 / GENERATION_TOKENS_PER_S
    assert generation_deadline(64, 768, None) == 600.0 + 64 * 768 / 500.0
    assert generation_deadline(64, 768, 90.0) == 90.0
    assert generation_deadline(64, 768, 0) == 0.0  # no limit
    exits: list[int] = []
    gen = _server_generation(0, lambda prompts, n, **_: {"prompt_ids": prompts, "completion_ids": [[3]] * n,
                                                         "logprobs": None}, exits)
    gen.generate([[5]] * 2, None, 2)
    assert exits == []


@pytest.mark.slow
def test_run_against_a_server_that_goes_silent_after_its_first_rollout_ends_within_the_timeout(
    tmp_path: Path,
) -> None:
    """``dfpo-train`` in server mode: the stand-in answers the first rollout's generation request, the run trains a
    step and writes checkpoint-1, and the second request is accepted and never answered. The run ends with exit code
    124 and one line within vllm_generation_timeout of that request; output_dir is as it was when the request went
    out, and checkpoint-1 is whole (its state, weights and DFPO's rollout state load). The NCCL weight transfer needs
    a GPU: the child replaces TRL's client's two NCCL calls with no-ops, everything HTTP is TRL's own."""
    from dfpo_trl.testing import WORDS

    out = tmp_path / "out"
    snapshot: dict[str, dict[str, str]] = {}
    server = OneRolloutServer([WORDS.index("7"), WORDS.index("<eos>")], on_stall=lambda: snapshot.update(at=tree(out)))
    argv = write_tiny_recipe(tmp_path, save_tiny_chat_model(tmp_path / "model"), out, use_vllm=True,
                             vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=5.0,
                             vllm_generation_timeout=3.0, max_steps=3, steps_per_generation=1, save_strategy="steps",
                             save_steps=1, save_model=None, skip_eval=True, train_size=16)
    script = VLLM_PRESENT + (
        "vc.VLLMClient.init_communicator = lambda self, device=0: None  # NCCL: a GPU only\n"
        "vc.VLLMClient.update_named_params = lambda self, metadata, named_params: None\n"
        "import sys\nfrom dfpo_trl.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                              env=child_env(), cwd=tmp_path, timeout=300)
        ended = time.monotonic()
    finally:
        server.close()
    assert proc.returncode == STALL_EXIT_CODE, proc.stderr[-3000:]
    assert server.rollouts == 2 and server.stalled_at is not None
    stalled_for = ended - server.stalled_at
    print(f"stall to exit: {stalled_for:.2f} s (limit 3 s)")
    assert 3.0 - 0.5 <= stalled_for <= 3.0 + 5.0  # the deadline, plus the child's exit
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dfpo-train:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "the generation request to the vLLM server (4 completions of up to 4 tokens) did not finish within 3 s " \
           f"(vllm_generation_timeout) on process 0: vLLM server {server.url}" in lines[0]
    assert "Traceback" not in proc.stderr
    assert tree(out) == snapshot["at"]  # nothing written after the request went out
    checkpoint = out / "checkpoint-1"
    import json

    import torch
    from safetensors.torch import load_file

    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 1
    assert load_file(checkpoint / "model.safetensors")
    assert torch.load(checkpoint / "dfpo_rollout_state_0.pt", weights_only=False) is not None
