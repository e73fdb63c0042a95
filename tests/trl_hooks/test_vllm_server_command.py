"""The generation server's command line. TRL 1.16 deprecates its own server script: it only runs vLLM's server
with flags TRL needs (weights in over NCCL, processed log-probs), so a line missing one starts a server that
generates but never receives the trainer's weights. Checked here without vLLM, against TRL's own builder
(``trl.scripts.vllm_serve.build_command``): benchmarks/lib/vllm_tools.py's builder, and every ``vllm serve`` line
the README and the server-mode recipes show, with the recipe's model, port and context."""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import shlex
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml
from trl.scripts import vllm_serve as trl_serve

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks.<kind>.<script> from the root

from benchmarks.launch import vllm_server  # noqa: E402
from benchmarks.lib import vllm_tools  # noqa: E402

REQUIRED = {"--weight-transfer-config": '{"backend": "nccl"}', "--logprobs-mode": "processed_logprobs",
            "--max-logprobs": "-1"}
# vllm serve flag -> (ScriptArguments field, type): how a printed line is read back into TRL's arguments
FLAG_FIELDS = {"--host": ("host", str), "--port": ("port", int),
               "--tensor-parallel-size": ("tensor_parallel_size", int),
               "--data-parallel-size": ("data_parallel_size", int),
               "--gpu-memory-utilization": ("gpu_memory_utilization", float), "--dtype": ("dtype", str),
               "--kv-cache-dtype": ("kv_cache_dtype", str), "--model-impl": ("vllm_model_impl", str),
               "--uvicorn-log-level": ("log_level", str), "--max-model-len": ("max_model_len", int)}
SERVER_RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml")
                        if yaml.safe_load(p.read_text()).get("vllm_mode") == "server")
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


def joined_commands(lines: list[str]) -> list[str]:
    """Shell commands of ``lines``, backslash continuations joined."""
    commands, current = [], ""
    for line in lines:
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        commands.append((current + stripped).strip())
        current = ""
    return commands


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    return [c for block in blocks for c in joined_commands(block.splitlines()) if not c.startswith("#")]


def header_commands(recipe: Path) -> list[str]:
    """The commands in a recipe's leading comment block (the launch lines)."""
    header = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(re.sub(r"^#\s?", "", line))
    return joined_commands(header)


def server_lines(commands: list[str]) -> list[str]:
    return [c for c in commands if re.search(r"(^|\s)vllm serve\s", c)]


def as_trl_arguments(model: str, options: dict[str, str | None]) -> dict[str, Any]:
    """A printed line's options read back into ScriptArguments fields (TRL's imposed flags left out)."""
    unknown = set(options) - set(FLAG_FIELDS) - set(REQUIRED)
    assert not unknown, f"flags TRL's builder would not write for a printed line: {unknown}"
    return {FLAG_FIELDS[f][0]: FLAG_FIELDS[f][1](v) for f, v in options.items() if f in FLAG_FIELDS}


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


def test_server_mode_recipes_exist() -> None:
    assert {p.name for p in SERVER_RECIPES} >= {"qwen3_32b.yaml", "qwen3_next_80b_a3b.yaml"}


@pytest.mark.parametrize("recipe", SERVER_RECIPES, ids=lambda p: p.name)
def test_recipe_header_server_line(monkeypatch: pytest.MonkeyPatch, recipe: Path) -> None:
    values = yaml.safe_load(recipe.read_text())
    commands = header_commands(recipe)
    (line,) = server_lines(commands)
    env, head, model, options = parse_serve(shlex.split(line))
    assert head == ["vllm"] and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert REQUIRED.items() <= options.items()
    assert model == values["model_name_or_path"]
    assert int(options["--port"]) == values["vllm_server_port"]
    assert int(options["--max-model-len"]) == values["vllm_max_model_length"]
    assert options["--host"] == "0.0.0.0"  # reachable from the training nodes
    gpus = env["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(set(gpus)) == len(gpus) == int(options["--tensor-parallel-size"]) * int(options["--data-parallel-size"])
    # exactly the flags TRL's builder writes for these arguments on any vLLM it supports (no --enable-scale-out)
    theirs = trl_command(monkeypatch, False, model, **as_trl_arguments(model, options))
    assert options == parse_serve(theirs)[3]
    # the trainer: this recipe under accelerate, pointed at the server's host (the port is the recipe's)
    trainers = [c for c in commands if c.startswith("accelerate launch") and f"recipes/{recipe.name}" in c]
    assert trainers and all(f"-m dfpo_trl recipes/{recipe.name}" in c and "--vllm_server_host" in c for c in trainers)
    assert values["use_vllm"] is True and values["vllm_mode"] == "server"


def test_dense_model_is_served_without_data_parallelism() -> None:
    """vLLM (0.14 on) refuses data parallelism for a dense model; Qwen3-32B is dense."""
    (line,) = server_lines(header_commands(ROOT / "recipes" / "qwen3_32b.yaml"))
    assert parse_serve(shlex.split(line))[3]["--data-parallel-size"] == "1"


def test_readme_server_lines_are_the_recipes() -> None:
    commands = readme_commands()
    lines = server_lines(commands)
    assert lines
    by_model = {parse_serve(shlex.split(line))[2]: parse_serve(shlex.split(line)) for line in lines}
    assert len(by_model) == len(lines)
    for recipe in SERVER_RECIPES:
        values = yaml.safe_load(recipe.read_text())
        (header_line,) = server_lines(header_commands(recipe))
        assert by_model.pop(values["model_name_or_path"]) == parse_serve(shlex.split(header_line)), recipe.name
        trainers = [c for c in commands if c.startswith("accelerate launch") and f"recipes/{recipe.name}" in c]
        assert trainers and all("--vllm_server_host" in c for c in trainers)
    assert not by_model, f"README server lines for no server-mode recipe: {sorted(by_model)}"


def test_no_trl_vllm_serve_in_user_facing_text() -> None:
    """TRL 1.16's wrapper is deprecated (gone in TRL 2): nothing tells users to start the server with it."""
    paths = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/**/*.md"),
             *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("recipes/**/*.yaml"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("examples/**/*.py"), *ROOT.glob("dfpo_trl/**/*.py")]
    assert len(paths) > 20
    found = [str(p.relative_to(ROOT)) for p in paths if re.search(r"trl\s+vllm[-_]serve", p.read_text())]
    assert not found
