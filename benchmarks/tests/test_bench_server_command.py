"""The server-mode benchmark's server line (``dfpo_bench.launch.vllm_server``), checked without vLLM: TRL's own
builder's command for the run's arguments, with the flags TRL needs for its weight push and its log-probabilities (a
line without them starts a server that generates but never receives the trainer's weights), the environment that
opens the weight-transfer endpoints, and a derived recipe that points the trainer at that server."""

from __future__ import annotations

import io
import shlex
import sys
from contextlib import redirect_stdout

import pytest
from trl.scripts import vllm_serve as trl_serve

from dfpo_bench.launch import vllm_server

REQUIRED = ["--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "-1"]


def test_print_commands_gives_trls_server_for_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trl_serve, "is_vllm_available", lambda min_version=None: False)  # no --enable-scale-out
    out = io.StringIO()
    with redirect_stdout(out):
        vllm_server.main(["--print-commands", "--model", "/models/m", "--port", "8123"])
    lines = [shlex.split(line) for line in out.getvalue().strip().splitlines()]
    theirs = trl_serve.build_command(trl_serve.ScriptArguments(model="/models/m", host="127.0.0.1", port=8123,
                                                               gpu_memory_utilization=0.5, max_model_len=1024))
    assert theirs[:4] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    env = ["CUDA_VISIBLE_DEVICES=1", "VLLM_SERVER_DEV_MODE=1"]
    assert lines == [[*env, "vllm", "serve", *theirs[4:]], [*env, "python3", *theirs[1:]]]
    assert all(" ".join(REQUIRED[i:i + 2]) in " ".join(theirs) for i in (0, 2, 4))  # each flag with its value
    recipe = vllm_server.derived_recipe("/models/m", 8123, "/tmp/unused", 4, {})
    assert [recipe[k] for k in ("vllm_mode", "vllm_server_host", "vllm_server_port")] == ["server", "127.0.0.1", 8123]
    assert recipe["model_name_or_path"] == "/models/m" and recipe["group_transform"] == "min_replace"


def test_the_weight_check_asks_for_the_trained_weights_within_the_same_weights_floor() -> None:
    initial, trained = [-1.0, -2.0, -7.0], [-0.5, -1.5, -6.0]
    served_initial = [-1.0, -2.0, -6.8]  # the same weights, 0.2 apart on the unlikely token: the floor
    held, numbers = vllm_server.weight_sync_check(served_initial, initial, [-0.5, -1.5, -5.7], trained, 0.05)
    assert held and numbers["bound"] == pytest.approx(0.45)
    stale, _ = vllm_server.weight_sync_check(served_initial, initial, served_initial, trained, 0.05)
    assert not stale  # a server still on the initial weights
