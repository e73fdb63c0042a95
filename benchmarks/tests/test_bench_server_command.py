"""The benchmarks' generation-server command (``dfpo_bench.lib.vllm_tools``), checked without vLLM against TRL's own
builder (``trl.scripts.vllm_serve.build_command``): TRL 1.16 deprecates its server script, and a line missing one of
the flags TRL needs starts a server that generates but never receives the trainer's weights.

``REQUIRED``, ``parse_serve`` and ``trl_command`` repeat tests/trl_hooks/test_vllm_server_command.py's (which checks
the documents' ``vllm serve`` lines): the two test folders never import each other, and the library builds no server
line, so a reader of one has no place in ``dfpo_trl.testing``."""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import shlex
import sys
from contextlib import redirect_stdout
from typing import Any

import pytest
from trl.scripts import vllm_serve as trl_serve

from dfpo_bench.launch import vllm_server
from dfpo_bench.lib import vllm_tools

REQUIRED = {"--weight-transfer-config": '{"backend": "nccl"}', "--logprobs-mode": "processed_logprobs",
            "--max-logprobs": "-1"}

ARGUMENT_SETS = [
    {},
    {"host": "127.0.0.1", "gpu_memory_utilization": 0.5, "max_model_len": 1024},  # the two-GPU benchmark's server
    {"tensor_parallel_size": 8, "max_model_len": 32768},  # the paper recipes' generation node
    {"revision": "main", "data_parallel_size": 2, "port": 8001, "dtype": "bfloat16", "kv_cache_dtype": "fp8",
     "vllm_model_impl": "transformers", "log_level": "warning", "enable_prefix_caching": True, "enforce_eager": True,
     "trust_remote_code": True, "distributed_executor_backend": "ray",
     "speculative_config": '{"method": "qwen3_next_mtp", "num_speculative_tokens": 5}'},
    {"enable_prefix_caching": False, "enforce_eager": None},
]


def parse_serve(tokens: list[str]) -> tuple[dict[str, str], list[str], str, dict[str, str | None]]:
    """(environment, head, model, options) of ``[VAR=value ...] <head> serve MODEL --flag [value] ...``; options
    as a mapping, since vLLM's argument parser does not care about their order."""
    tokens = list(tokens)
    env: dict[str, str] = {}
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    serve = tokens.index("serve")
    head, model, rest = tokens[:serve], tokens[serve + 1], tokens[serve + 2 :]
    options: dict[str, str | None] = {}
    i = 0
    while i < len(rest):
        flag = rest[i]
        assert flag.startswith("--") and flag not in options, (flag, tokens)
        has_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
        options[flag] = rest[i + 1] if has_value else None
        i += 2 if has_value else 1
    return env, head, model, options


def trl_command(monkeypatch: pytest.MonkeyPatch, scale_out: bool, model: str, **kwargs: Any) -> list[str]:
    """TRL's command for these arguments, with its "vLLM >= 0.30 installed" check answered by ``scale_out``."""
    def installed(min_version: str | None = None) -> bool:
        assert min_version == vllm_tools.SCALE_OUT_VLLM
        return scale_out

    monkeypatch.setattr(trl_serve, "is_vllm_available", installed)
    return trl_serve.build_command(trl_serve.ScriptArguments(model=model, **kwargs))


def test_builder_keywords_are_trl_script_arguments() -> None:
    """A field TRL adds to its ScriptArguments would otherwise go unnoticed by the comparisons below."""
    fields = {f.name for f in dataclasses.fields(trl_serve.ScriptArguments)} - {"model"}
    keywords = set(inspect.signature(vllm_tools.server_command).parameters) - {"model", "scale_out", "python"}
    assert keywords == fields


@pytest.mark.parametrize("scale_out", [False, True], ids=["vllm<0.30", "vllm>=0.30"])
@pytest.mark.parametrize("kwargs", ARGUMENT_SETS, ids=["defaults", "benchmark", "paper", "every_option", "negated"])
def test_server_command_is_trls(monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], scale_out: bool) -> None:
    model = "Qwen/Qwen3-32B"
    ours = vllm_tools.server_command(model, scale_out=scale_out, python=sys.executable, **kwargs)
    theirs = trl_command(monkeypatch, scale_out, model, **kwargs)
    assert parse_serve(ours) == parse_serve(theirs)
    _, head, _, options = parse_serve(ours)
    assert head == [sys.executable, "-m", "vllm.entrypoints.cli.main"]  # the kit's form: no console script
    assert REQUIRED.items() <= options.items()
    assert ("--enable-scale-out" in options) == scale_out


def test_shell_line_is_what_trl_tells_users_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's deprecated wrapper warns with the ``vllm serve`` line to run instead and execs with its environment."""
    kwargs = {"tensor_parallel_size": 8, "max_model_len": 32768}
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(trl_serve, "is_vllm_available", lambda min_version=None: False)
    monkeypatch.setattr(trl_serve.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    with pytest.warns(FutureWarning) as record:
        trl_serve.main(trl_serve.ScriptArguments(model="Qwen/Qwen3-32B", **kwargs))
    told = next(line.strip() for w in record for line in str(w.message).splitlines() if "vllm serve" in line)
    ours = vllm_tools.shell_line(vllm_tools.server_command("Qwen/Qwen3-32B", **kwargs))
    assert parse_serve(shlex.split(ours)) == parse_serve(shlex.split(told))
    assert ours.startswith("VLLM_SERVER_DEV_MODE=1 vllm serve ")
    (_, argv, env), = calls
    assert vllm_tools.SERVER_ENV.items() <= env.items()
    assert parse_serve(argv)[2:] == parse_serve(shlex.split(ours))[2:]


def test_print_commands_gives_the_benchmarks_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """--print-commands: the two-GPU run's server on GPU 1, as ``vllm serve`` and in the kit's module form."""
    out = io.StringIO()
    with redirect_stdout(out):
        vllm_server.main(["--print-commands", "--model", "/models/m", "--port", "8123"])
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 2
    parsed = [parse_serve(shlex.split(line)) for line in lines]
    assert [p[1] for p in parsed] == [["vllm"], ["python3", "-m", "vllm.entrypoints.cli.main"]]
    theirs = trl_command(monkeypatch, False, "/models/m", host="127.0.0.1", port=8123, gpu_memory_utilization=0.5,
                         max_model_len=1024)
    for env, _, model, options in parsed:
        assert env == {"CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}
        assert (model, options) == parse_serve(theirs)[2:]
    recipe = vllm_tools.derived_recipe("/models/m", 8123, "/tmp/unused", 4, {})
    trainer_side = (recipe["vllm_mode"], recipe["vllm_server_host"], recipe["vllm_server_port"])
    assert trainer_side == ("server", "127.0.0.1", 8123)
