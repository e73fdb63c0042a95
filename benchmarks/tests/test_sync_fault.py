"""``dfpo_bench.launch.sync_fault`` on the CPU: the commands it prints (and runs) agree with each other and with
its recipe, and the helpers its GPU record rests on read what the watchdog really writes (its DEBUG phase line and
its stall line) and tell an untouched ``output_dir`` from a touched one. The GPU run itself needs two GPUs."""

from __future__ import annotations

import io
import logging
import shlex
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from dfpo_trl.cli import parse_recipe
from dfpo_trl.testing.measures import STALL_EXIT_CODE, SyncWatchdog, streamed_size

ROOT = Path(__file__).resolve().parents[2]

from dfpo_bench.launch import sync_fault  # noqa: E402


def printed(argv: list[str]) -> tuple[dict[str, list[str]], dict]:
    """(command lines by their ``# name`` comment, the recipe) of ``--print-commands``."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert sync_fault.main(["--print-commands", *argv]) == 0
    text = out.getvalue()
    head, recipe = text.split("\n# recipe ", 1)
    lines: dict[str, list[str]] = {}
    name = None
    for line in head.splitlines():
        if line.startswith("# "):
            name = line[2:].split(" ")[0]
        else:
            lines[name] = shlex.split(line)
    return lines, yaml.safe_load(recipe.split("\n", 1)[1])


def env_and_options(tokens: list[str]) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """(VAR=value prefix, positional words, --flag value pairs; a flag with no value maps to '')."""
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    words, options, i = [], {}, 0
    while i < len(tokens):
        if tokens[i].startswith("--"):
            has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
            options[tokens[i]] = tokens[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            words.append(tokens[i])
            i += 1
    return env, words, options


def test_printed_commands_agree_with_the_recipe_and_each_other(tmp_path: Path, gpu_recipes_parse_here: None) -> None:
    """Server and trainer on different GPUs, the same model, host and port on both sides, the short deadline on the
    fault and resume runs only, the resume from the fault run's first checkpoint; the fault run's arguments parse
    into that deadline and output_dir."""
    work = tmp_path / "w"
    lines, recipe = printed(["--model", "/models/m", "--port", "8123", "--work-dir", str(work), "--fault-timeout",
                             "20", "--steps", "8", "--save-steps", "3"])
    assert set(lines) == {"server", "measure", "fault", "resume"}
    server_env, server_words, server = env_and_options(lines["server"])
    assert server_env == {"CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}
    assert server_words[-2:] == ["serve", "/models/m"]
    assert (server["--host"], server["--port"], server["--gpu-memory-utilization"]) == ("127.0.0.1", "8123", "0.15")
    assert server["--weight-transfer-config"] == '{"backend": "nccl"}' and "--enforce-eager" in server
    assert (recipe["model_name_or_path"], recipe["vllm_server_host"], recipe["vllm_server_port"]) == (
        "/models/m", "127.0.0.1", 8123)
    assert (recipe["use_vllm"], recipe["vllm_mode"], recipe["group_transform"]) == (True, "server", "min_replace")
    assert recipe["steps_per_generation"] > recipe["gradient_accumulation_steps"]  # off-policy: Min-Replace acts
    assert (recipe["save_strategy"], recipe["save_steps"], recipe["max_steps"]) == ("steps", 3, 8)
    assert recipe["output_dir"] == str(work / "measure")
    runs = {name: env_and_options(lines[name]) for name in ("measure", "fault", "resume")}
    for env, words, _ in runs.values():
        assert env == {"CUDA_VISIBLE_DEVICES": "0"}
        assert words == ["python3", "-m", "dfpo_trl", str(work / "recipe.yaml")]
    assert runs["measure"][2] == {}
    assert runs["fault"][2] == {"--output_dir": str(work / "fault"), "--vllm_sync_timeout": "20.0"}
    assert runs["resume"][2] == {**runs["fault"][2], "--resume_from_checkpoint": str(work / "fault" / "checkpoint-3")}

    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    fault_argv = [str(recipe_path), *lines["fault"][lines["fault"].index("dfpo_trl") + 2:]]
    _, training_args, model_args = parse_recipe(fault_argv)
    assert (training_args.vllm_sync_timeout, training_args.output_dir) == (20.0, str(work / "fault"))
    assert (training_args.save_steps, training_args.max_steps, model_args.model_name_or_path) == (3, 8, "/models/m")


def test_a_checkpoint_at_or_after_the_last_step_is_refused() -> None:
    with pytest.raises(SystemExit), redirect_stderr(io.StringIO()):
        sync_fault.parse(["--print-commands", "--steps", "4", "--save-steps", "4"])


def test_phase_times_read_the_watchdogs_own_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    """The line the parser reads is the one SyncWatchdog.guard logs, formatted as dfpo-train formats it."""
    dog = SyncWatchdog(60, exit=lambda code: None)
    with caplog.at_level(logging.DEBUG, logger="dfpo_trl.trl_hooks.sync_watchdog"):
        with dog.guard("the vLLM server connection and weight-transfer set-up (init_communicator)", str, 300):
            pass
        for _ in range(2):
            with dog.guard("the weight sync to the vLLM server (update_named_params)", str):
                time.sleep(0.01)
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")  # dfpo_trl.cli.main's format
    log = "\n".join(formatter.format(record) for record in caplog.records)
    times = sync_fault.phase_times("noise\n" + log + "\nINFO other: finished in 9 s of its 1 s limit\n")
    assert set(times) == {"setup", "sync"} and len(times["setup"]) == 1 and len(times["sync"]) == 2
    assert all(0.01 <= s < 5 for s in times["sync"]) and 0 <= times["setup"][0] < 5


def test_the_size_parser_reads_the_line_the_library_logs() -> None:
    """The watchdog's DEBUG line of a sync's size, formatted as dfpo-train formats it, read back."""
    line = streamed_size([("a", "bfloat16", [2, 3]), ("b", "float32", [4])])
    log = "INFO x: step 2\n" + f"DEBUG dfpo_trl.trl_hooks.sync_watchdog: {line}\n" * 2
    assert sync_fault.streamed_weights(log) == {"tensors": 2, "parameters": 10, "bytes": 28,
                                                "dtypes": ["bfloat16", "float32"]}
    assert sync_fault.streamed_weights("INFO x: step 2\n") is None


def test_the_checkpoint_callback_pauses_after_the_first_checkpoint_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fault run's callback (given to dfpo_train): an event per checkpoint; after the first, ``saved`` is marked
    and it waits for ``killed`` (here already there); the next checkpoint does not wait."""
    from types import SimpleNamespace

    (tmp_path / "killed").write_text("")
    callback = sync_fault.checkpoint_events(str(tmp_path))
    for step in (2, 4):
        callback.on_save(None, SimpleNamespace(global_step=step), None)
    assert (tmp_path / "saved").read_text() == "2"
    assert [(e["event"], e.get("step")) for e in sync_fault.events(capsys.readouterr().err)] == [
        ("checkpoint", 2), ("resumed_after_kill", None), ("checkpoint", 4)]


def test_stall_line_is_the_watchdogs_line_and_last_error_the_traceback_end() -> None:
    exits: list[int] = []
    err = io.StringIO()
    with redirect_stderr(err):
        with SyncWatchdog(0.05, exit=exits.append).guard("the weight sync (update_named_params)", lambda: "here"):
            time.sleep(0.3)
    assert exits == [STALL_EXIT_CODE]
    log = "INFO x: step 2\n" + err.getvalue() + 'SYNC_FAULT {"event": "exit"}\n'
    line = sync_fault.stall_line(log)
    assert line == err.getvalue().strip() and "update_named_params" in line and "vllm_sync_timeout" in line
    assert sync_fault.stall_line("INFO x: step 2\n") is None
    crash = ("Traceback (most recent call last):\n  File x\nrequests.exceptions.ConnectionError: refused\n"
             'SYNC_FAULT {"event": "exit", "code": 1}\n')
    assert sync_fault.last_error(crash) == "requests.exceptions.ConnectionError: refused"
    assert sync_fault.last_error("all fine\n") is None


def test_events_skip_a_torn_line() -> None:
    log = ('x\nSYNC_FAULT {"event": "card", "name": "cpu"}\nSYNC_FAULT {"event": "checkpoint", "step": 2}\n'
           'SYNC_FAULT {"ev')
    assert [e["event"] for e in sync_fault.events(log)] == ["card", "checkpoint"]
    assert sync_fault.first_event(log, "checkpoint") == {"event": "checkpoint", "step": 2}
    assert sync_fault.first_event(log, "summary") is None


def test_compare_trees_tells_untouched_from_rewritten_and_a_new_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "model.safetensors").write_bytes(b"weights")
    (out / "run.log").write_text("a")
    before = sync_fault.tree_hashes(out)
    same = sync_fault.compare_trees(before, sync_fault.tree_hashes(out))
    assert same["identical"] and same["files"] == 2 and same["new_checkpoint_dirs"] == []
    (out / "checkpoint-2" / "model.safetensors").write_bytes(b"weightz")
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "optimizer.pt").write_bytes(b"half")
    (out / "run.log").unlink()
    diff = sync_fault.compare_trees(before, sync_fault.tree_hashes(out))
    assert not diff["identical"]
    assert diff["changed"] == ["checkpoint-2/model.safetensors"] and diff["removed"] == ["run.log"]
    assert diff["added"] == ["checkpoint-4/optimizer.pt"] and diff["new_checkpoint_dirs"] == ["checkpoint-4"]
    assert sync_fault.tree_hashes(tmp_path / "absent") == {}


def test_the_child_launcher_waits_after_its_first_checkpoint_then_resumes_to_max_steps(tmp_path: Path) -> None:
    """The launcher the GPU run trains through, on the CPU without a server: the fault run's child stops after its
    first checkpoint until the kill is signalled (nothing is written meanwhile), reports its checkpoints and summary
    as events, and a run resumed from that checkpoint reaches max_steps."""
    from dfpo_trl.testing import save_tiny_chat_model, write_tiny_recipe

    model, out, pause = save_tiny_chat_model(tmp_path / "model"), tmp_path / "fault", tmp_path / "pause"
    pause.mkdir()
    argv = write_tiny_recipe(tmp_path, model, out, save_strategy="steps", save_steps=1, skip_eval=True, max_steps=2)
    args = sync_fault.parse(["--work-dir", str(tmp_path), "--trainer-gpu", "0"])
    seen: dict[str, dict[str, str]] = {}

    def watch(_process: object) -> None:
        if not seen and (pause / "saved").exists():
            seen["at_save"] = sync_fault.tree_hashes(out)
            time.sleep(1.0)  # the child is waiting: nothing in output_dir may change
            seen["a_second_later"] = sync_fault.tree_hashes(out)
            (pause / "killed").write_text("")

    children = sync_fault.Children()
    first = sync_fault.run_trainer(args, children, "first", argv, 240, sync_fault.Budget(300), watch,
                                   env={sync_fault.PAUSE_ENV: str(pause)})
    assert first["status"] == "ok", first.get("log_tail")
    assert (pause / "saved").read_text() == "1" and seen["at_save"] == seen["a_second_later"]
    assert any(name.startswith("checkpoint-1/") for name in seen["at_save"])
    assert first["checkpoints"] == [1, 2] and first["summary"]["steps"] == 2 and first["card"] == "cpu"
    resumed = sync_fault.run_trainer(args, children, "resumed",
                                     [*argv, "--resume_from_checkpoint", str(out / "checkpoint-1")], 240,
                                     sync_fault.Budget(300))
    assert resumed["status"] == "ok", resumed.get("log_tail")
    assert resumed["checkpoints"] == [2] and resumed["summary"]["steps"] == 2
    assert all(p.poll() is not None for p in children.processes)
