"""The generation server's command line. TRL 1.16 deprecates its own server script: it only runs vLLM's server
with flags TRL needs (weights in over NCCL, processed log-probs), so a line missing one starts a server that
generates but never receives the trainer's weights. Checked here without vLLM, against TRL's own builder
(``trl.scripts.vllm_serve.build_command``): every ``vllm serve`` line the docs' multi-node guide and the server-mode
recipes show, with the recipe's model, port and context (the benchmarks' own builder is checked in benchmarks/tests)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from trl.scripts import vllm_serve as trl_serve

ROOT = Path(__file__).resolve().parents[2]

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
        assert min_version is not None  # TRL asks only about the scale-out version
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


GUIDE = ROOT / "docs" / "source" / "guides" / "multinode.md"  # the paper recipes' launch commands


def guide_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
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


def test_guide_server_lines_are_the_recipes() -> None:
    commands = guide_commands()
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
    assert not by_model, f"{GUIDE.name} server lines for no server-mode recipe: {sorted(by_model)}"


def test_no_trl_vllm_serve_in_user_facing_text() -> None:
    """TRL 1.16's wrapper is deprecated (gone in TRL 2): nothing tells users to start the server with it."""
    paths = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/**/*.md"),
             *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("recipes/**/*.yaml"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("examples/**/*.py"), *ROOT.glob("dfpo_trl/**/*.py")]
    assert len(paths) > 20
    found = [str(p.relative_to(ROOT)) for p in paths if re.search(r"trl\s+vllm[-_]serve", p.read_text())]
    assert not found
