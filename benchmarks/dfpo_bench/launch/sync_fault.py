"""vLLM server mode on two GPUs: how long the weight sync takes (to set ``vllm_sync_timeout``'s default from), and
a server killed mid-run ending the trainer with the watchdog's one line, its outputs untouched, then a resume.

    # on a machine with 2 GPUs, after the kit's setup with vLLM (benchmarks/README.md); ~5 minutes
    python -m dfpo_bench.launch.sync_fault --model /root/models/smollm2-135m-instruct --out $OUT/sync_fault.json
    # the server line, the three dfpo-train command lines and the recipe; no GPU needed
    python -m dfpo_bench.launch.sync_fault --print-commands

The watchdog puts a deadline (``vllm_sync_timeout``, dfpo_trl/trl_hooks/sync_watchdog.py) on TRL's server-mode
communicator set-up and weight sync; its default (600 s) is an estimate, and the NCCL phases were never stalled on a
GPU. This script, on one host (server on ``--server-gpu``, trainer on ``--trainer-gpu``: NCCL refuses two ranks on
one device), reuses vllm_server.py's server (its command, start and ``/health`` wait) and recipe, and runs:

1. **measure**: ``dfpo-train`` in server mode (Min-Replace off-policy: ``steps_per_generation`` 4 > accumulation 2, a
   rollout every 2 steps, ``--steps`` 6 by default, a checkpoint every ``--save-steps`` 2) with the default
   deadline; the watchdog logs each guarded phase's duration at DEBUG (``... finished in X s of its Y s limit``)
   and what each sync streamed (``the weight sync streamed N tensors, P parameters, B bytes (dtypes)``), read back
   here;
2. **fault**: the same with ``--vllm_sync_timeout`` ``--fault-timeout`` (30 s) into another ``output_dir``. Right
   after the first checkpoint is saved the trainer waits (a callback this script's launcher gives ``dfpo_train``, so
   that the kill falls between a checkpoint and the next rollout's sync every time, not at a random point) while
   this script hashes ``output_dir`` and SIGKILLs the server's process group; then: seconds from the kill to the
   trainer's exit, its exit code (124: the watchdog; another: a clean error, its last line kept), the watchdog's
   line, ``output_dir`` byte-identical before and after, and no checkpoint folder that was not complete at the kill.
   30 s, because a refused connection is not a hang for TRL's client: its HTTP retries (urllib3, backoff 2: 0 + 4 +
   8 + 16 + 32 s) give up with a ``ConnectionError`` after about 60 s, and a longer deadline would race them;
3. **resume**: a new server, the fault run resumed with ``--resume_from_checkpoint`` from that checkpoint, and
   whether it reaches ``max_steps``.

Each run is ``dfpo_train`` (what ``python -m dfpo_trl`` runs) in a child process of this script (``--child``), which
adds only the DEBUG level for the watchdog, a callback for the checkpoints and the pause after the first one, and
one ``SYNC_FAULT {json}`` line per event; nothing of the library is wrapped. Every step is bounded (``--budget-s``
for the whole script, 480 s by default), a step that fails is recorded with its log tail and the next one still
runs, and every child process group is stopped on exit. ``--out`` gets the record (cards, versions, the checkout,
every time and line, exit codes); a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]

from dfpo_bench.launch.vllm_server import benchmark_server_command, start_server  # noqa: E402
from dfpo_bench.lib.common import SUMMARY_FILE, installed_versions, write_json  # noqa: E402
from dfpo_bench.lib.provenance import checkout_state, tree_hashes  # noqa: E402
from dfpo_bench.lib.vllm_tools import derived_recipe, shell_line, stop_server, vllm_has_scale_out  # noqa: E402

EVENT = "SYNC_FAULT "  # the child's event lines: EVENT + one JSON object
PAUSE_ENV = "SYNC_FAULT_PAUSE_DIR"  # the fault run's child waits there after its first checkpoint
PAUSE_LIMIT_S = 120.0  # how long that child waits for the kill before it goes on regardless
STALL_EXIT_CODE = 124  # dfpo_trl.trl_hooks.sync_watchdog.STALL_EXIT_CODE (not imported: it imports TRL)
# "DEBUG dfpo_trl.trl_hooks.sync_watchdog: <what> finished in 0.412 s of its 600 s limit"
PHASE_LINE = re.compile(r"sync_watchdog: (?P<what>.+?) finished in (?P<seconds>[0-9.]+) s of its "
                        r"(?P<limit>[0-9.]+) s limit")
STALL_LINE = re.compile(r"^dfpo-train: .* did not finish within .*$", re.MULTILINE)
# "DEBUG dfpo_trl.trl_hooks.sync_watchdog: the weight sync streamed 272 tensors, 134515008 parameters, ... (bfloat16)"
SIZE_LINE = re.compile(r"sync_watchdog: the weight sync streamed (?P<tensors>\d+) tensors, (?P<parameters>\d+) "
                       r"parameters, (?P<bytes>\d+) bytes \((?P<dtypes>[^)]*)\)")
PHASES = {"init_communicator": "setup", "update_named_params": "sync"}


# ------------------------------------------------------------------------------------------------ pure helpers
def compare_trees(before: dict[str, str], after: dict[str, str]) -> dict[str, Any]:
    """What changed between two :func:`tree_hashes`: files added, removed, rewritten, and checkpoint folders that
    appeared (a checkpoint begun after ``before`` is partial when the run did not finish)."""
    def checkpoints(tree: dict[str, str]) -> set[str]:
        return {name.split("/")[0] for name in tree if re.fullmatch(r"(tmp-)?checkpoint-\d+", name.split("/")[0])}

    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(name for name in set(before) & set(after) if before[name] != after[name])
    return {"identical": not (added or removed or changed), "files": len(before), "added": added,
            "removed": removed, "changed": changed,
            "new_checkpoint_dirs": sorted(checkpoints(after) - checkpoints(before))}


def phase_times(log: str) -> dict[str, list[float]]:
    """The watchdog's DEBUG lines of a log, by phase: ``setup`` (init_communicator) and ``sync``
    (update_named_params) seconds, in order; an unknown phase under its own text."""
    out: dict[str, list[float]] = {}
    for match in PHASE_LINE.finditer(log):
        what = match["what"]
        kind = next((v for k, v in PHASES.items() if k in what), what)
        out.setdefault(kind, []).append(float(match["seconds"]))
    return out


def streamed_weights(log: str) -> dict[str, Any] | None:
    """The first sync's size from the watchdog's DEBUG line (tensors, parameters, bytes, dtypes), or None."""
    match = SIZE_LINE.search(log)
    if match is None:
        return None
    return {"tensors": int(match["tensors"]), "parameters": int(match["parameters"]), "bytes": int(match["bytes"]),
            "dtypes": [d for d in match["dtypes"].split(", ") if d]}


def stall_line(log: str) -> str | None:
    """The watchdog's one line (``dfpo-train: ... did not finish within ...``), or None."""
    match = STALL_LINE.search(log)
    return match.group(0) if match else None


def last_error(log: str) -> str | None:
    """The last line that reads as an error (a traceback's last line, ``dfpo-train: error``, an NCCL error), or
    None: what a run that ended otherwise than by the watchdog said last."""
    pattern = re.compile(r"(Error|Exception|error:|NCCL WARN|Killed|Traceback)")
    lines = [line.strip() for line in log.splitlines() if line.strip() and not line.startswith(EVENT)]
    return next((line for line in reversed(lines) if pattern.search(line)), None)


def events(log: str) -> list[dict[str, Any]]:
    """The child's ``SYNC_FAULT {json}`` lines, in order (a torn last line is skipped)."""
    out = []
    for line in log.splitlines():
        if line.startswith(EVENT):
            try:
                out.append(json.loads(line[len(EVENT):]))
            except json.JSONDecodeError:
                continue
    return out


def first_event(log: str, name: str) -> dict[str, Any] | None:
    return next((e for e in events(log) if e.get("event") == name), None)


# ------------------------------------------------------------------------------------------------ commands
def fault_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """vllm_server.py's derived recipe, with a rollout every 2 steps (4 micro-batches of generation for an
    accumulation of 2: off-policy, so Min-Replace acts), checkpoints, and no held-out evaluation or final model
    (time the fault run does not need)."""
    return derived_recipe(args.model, args.port, str(pathlib.Path(args.work_dir) / "measure"), args.steps, {
        "steps_per_generation": 4, "gradient_accumulation_steps": 2, "save_strategy": "steps",
        "save_steps": args.save_steps, "skip_eval": True, "save_model": False, "train_size": 256})


def train_argv(args: argparse.Namespace, recipe: pathlib.Path, run: str) -> list[str]:
    """The ``dfpo-train`` arguments of ``run``: ``measure`` (the recipe as is, the default deadline), ``fault`` (its
    own ``output_dir``, a short deadline) and ``resume`` (the fault run from its first checkpoint)."""
    fault_dir = pathlib.Path(args.work_dir) / "fault"
    argv = [str(recipe)]
    if run in ("fault", "resume"):
        argv += ["--output_dir", str(fault_dir), "--vllm_sync_timeout", str(args.fault_timeout)]
    if run == "resume":
        argv += ["--resume_from_checkpoint", str(fault_dir / f"checkpoint-{args.save_steps}")]
    return argv


def command_lines(args: argparse.Namespace, recipe: pathlib.Path) -> list[str]:
    """The server line and each run's ``python -m dfpo_trl`` line, as this script runs them (the trainer through
    its ``--child`` launcher, with the same arguments)."""
    lines = ["# server (started for each run; killed with SIGKILL to its process group in the fault run)",
             shell_line(benchmark_server_command(args, python="python3"), gpus=str(args.server_gpu))]
    for run in ("measure", "fault", "resume"):
        lines += [f"# {run}", f"CUDA_VISIBLE_DEVICES={args.trainer_gpu} "
                  + shlex.join(["python3", "-m", "dfpo_trl", *train_argv(args, recipe, run)])]
    return lines


# ------------------------------------------------------------------------------------------------ the child
def emit(event: str, **fields: Any) -> None:
    """One event line on stderr, flushed: it must be in the log even when the watchdog ends the process."""
    print(EVENT + json.dumps({"event": event, **fields}), file=sys.stderr, flush=True)


def checkpoint_events(pause: str | None) -> Any:
    """A transformers callback: each checkpoint as an event line once it is complete (``on_save`` follows the whole
    save, DFPO's rollout state included); with ``pause`` (the fault run), after the first one it marks ``saved``
    there and waits for ``killed`` (at most :data:`PAUSE_LIMIT_S`)."""
    from transformers import TrainerCallback

    class CheckpointEvents(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            emit("checkpoint", step=state.global_step)
            if pause and not (pathlib.Path(pause) / "saved").exists():
                (pathlib.Path(pause) / "saved").write_text(str(state.global_step))
                deadline = time.monotonic() + PAUSE_LIMIT_S
                while not (pathlib.Path(pause) / "killed").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                emit("resumed_after_kill", waited_out=not (pathlib.Path(pause) / "killed").exists())

    return CheckpointEvents()


def child(train: list[str]) -> int:
    """``dfpo-train`` with the watchdog's DEBUG lines (each phase's duration, each sync's size), the checkpoints
    and the pause after the first one (the fault run) from a callback given to ``dfpo_train``, and the run's summary
    as event lines."""
    import logging

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("dfpo_trl.trl_hooks.sync_watchdog").setLevel(logging.DEBUG)
    import torch
    import yaml
    from dfpo_trl.cli import dfpo_train

    emit("card", name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    code = dfpo_train(train, callbacks=[checkpoint_events(os.environ.get(PAUSE_ENV))])
    output_dir = (train[train.index("--output_dir") + 1] if "--output_dir" in train
                  else yaml.safe_load(pathlib.Path(train[0]).read_text())["output_dir"])
    summary_file = pathlib.Path(output_dir) / SUMMARY_FILE
    if summary_file.exists():  # every run that got to train writes it, an interrupted one too
        summary = json.loads(summary_file.read_text())
        emit("summary", steps=summary.get("steps"), max_steps=summary.get("max_steps"),
             interrupted=summary.get("interrupted"))
    emit("exit", code=code)
    return code


# ------------------------------------------------------------------------------------------------ the parent
class Budget:
    """The whole script's wall-clock bound: each step gets at most what is left (less a reserve for the record)."""

    def __init__(self, seconds: float, reserve: float = 10.0) -> None:
        self.end = time.monotonic() + seconds - reserve

    def left(self, cap: float) -> float:
        return max(0.0, min(cap, self.end - time.monotonic()))


class Children:
    """Every process group this script started, stopped on exit (normal, an exception, SIGTERM or Ctrl-C)."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def add(self, process: subprocess.Popen) -> subprocess.Popen:
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        """SIGKILL each group whose leader still runs (by its id; one already reaped was stopped by its step)."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # the group: vLLM's engine cores with the server
                    process.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass


def tail(path: pathlib.Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def server_up(args: argparse.Namespace, children: Children, name: str, budget: Budget) -> dict[str, Any]:
    """vllm_server.py's ``start_server`` under what is left of the budget; the record has the process when up."""
    log = pathlib.Path(args.work_dir) / f"server_{name}.log"
    step = argparse.Namespace(**{**vars(args), "server_timeout": budget.left(args.server_timeout)})
    if step.server_timeout < 5:
        return {"status": "skipped: out of time"}
    try:
        process, up_s = start_server(step, log)
    except Exception as exc:  # noqa: BLE001 - recorded; the next step still runs
        return {"status": "crash", "error": repr(exc), "log_tail": tail(log)}
    children.add(process)
    return {"status": "up", "startup_s": round(up_s, 1), "process": process, "log": str(log)}


def run_trainer(args: argparse.Namespace, children: Children, name: str, argv: list[str], cap_s: float,
                budget: Budget, watch: Callable[[subprocess.Popen], None] | None = None,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``dfpo-train`` run through ``--child`` on the trainer's GPU, bounded; ``watch`` is called every 50 ms
    while it runs. The record: exit code (None on a timeout, then the group is killed), wall seconds, the events,
    the watchdog's phase times and line, and the log's tail unless it ended with 0."""
    log = pathlib.Path(args.work_dir) / f"{name}.log"
    limit = budget.left(cap_s)
    if limit < 5:
        return {"status": "skipped: out of time"}
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", *argv]
    child_env = {**os.environ, **(env or {}), "CUDA_VISIBLE_DEVICES": str(args.trainer_gpu), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    try:
        with open(log, "w") as handle:
            process = children.add(subprocess.Popen(command, cwd=ROOT, env=child_env, stdout=handle,
                                                    stderr=subprocess.STDOUT, start_new_session=True))
        while process.poll() is None and time.monotonic() - start < limit:
            if watch is not None:
                watch(process)
            time.sleep(0.05)
        timed_out = process.poll() is None
        if timed_out:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    except Exception as exc:  # noqa: BLE001 - recorded; the next step still runs
        return {"status": "crash", "error": repr(exc), "log_tail": tail(log), "log": str(log)}
    text = log.read_text(errors="replace")
    code = None if timed_out else process.returncode
    record: dict[str, Any] = {
        "status": f"timeout after {limit:.0f} s" if timed_out else ("ok" if code == 0 else f"exit {code}"),
        "exit_code": code, "wall_s": round(time.monotonic() - start, 1), "argv": argv, "log": str(log),
        "phase_s": phase_times(text), "weights": streamed_weights(text),
        "summary": first_event(text, "summary"), "card": (first_event(text, "card") or {}).get("name"),
        "checkpoints": [e["step"] for e in events(text) if e.get("event") == "checkpoint"],
        "stall_line": stall_line(text), "last_error": last_error(text)}
    if code != 0:
        record["log_tail"] = tail(log)
    return record


def fault_run(args: argparse.Namespace, children: Children, recipe: pathlib.Path, budget: Budget) -> dict[str, Any]:
    """Run 2: the server SIGKILLed while the trainer waits after its first checkpoint; outputs hashed around it."""
    server = server_up(args, children, "fault", budget)
    if server["status"] != "up":
        return {"server": server}
    process = server.pop("process")
    output_dir = pathlib.Path(args.work_dir) / "fault"
    pause = pathlib.Path(args.work_dir) / "pause"
    pause.mkdir(parents=True, exist_ok=True)
    kill: dict[str, Any] = {}

    def watch(_trainer: subprocess.Popen) -> None:
        if kill or not (pause / "saved").exists():
            return
        kill["checkpoint_step"] = int((pause / "saved").read_text() or 0)
        kill["before"] = tree_hashes(output_dir)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            kill["server_already_gone"] = True
        kill["at"] = time.monotonic()
        (pause / "killed").write_text("")

    record = run_trainer(args, children, "fault", train_argv(args, recipe, "fault"), args.fault_timeout + 240,
                         budget, watch, env={PAUSE_ENV: str(pause)})
    ended = time.monotonic()
    stop_server(process)
    record["server"] = server
    if "at" not in kill:
        record["killed"] = False
        return record
    after = tree_hashes(output_dir)
    record.update(killed=True, checkpoint_step=kill["checkpoint_step"],
                  kill_to_exit_s=round(ended - kill["at"], 1) if record.get("exit_code") is not None else None,
                  outputs=compare_trees(kill["before"], after),
                  by_watchdog=record.get("exit_code") == STALL_EXIT_CODE,
                  within_timeout=record.get("exit_code") is not None and ended - kill["at"] <= args.fault_timeout + 30)
    return record


def resume_run(args: argparse.Namespace, children: Children, recipe: pathlib.Path, budget: Budget) -> dict[str, Any]:
    """Run 3: a new server; the fault run resumed from its first checkpoint must reach ``max_steps``."""
    checkpoint = pathlib.Path(args.work_dir) / "fault" / f"checkpoint-{args.save_steps}"
    if not checkpoint.is_dir():
        return {"status": f"skipped: no {checkpoint.name} to resume from"}
    server = server_up(args, children, "resume", budget)
    if server["status"] != "up":
        return {"server": server}
    process = server.pop("process")
    try:
        record = run_trainer(args, children, "resume", train_argv(args, recipe, "resume"), 240, budget)
    finally:
        stop_server(process)
    record["server"] = server
    summary = record.get("summary") or {}
    record["reached_max_steps"] = summary.get("steps") == args.steps and record.get("exit_code") == 0
    return record


def measure_run(args: argparse.Namespace, children: Children, recipe: pathlib.Path, budget: Budget) -> dict[str, Any]:
    """Run 1: every set-up and sync timed under the default deadline."""
    server = server_up(args, children, "measure", budget)
    if server["status"] != "up":
        return {"server": server}
    process = server.pop("process")
    try:
        record = run_trainer(args, children, "measure", train_argv(args, recipe, "measure"), 240, budget)
    finally:
        stop_server(process)
    record["server"] = server
    for kind in ("setup", "sync"):
        values = record.get("phase_s", {}).get(kind) or []
        record[f"{kind}_max_s"] = max(values) if values else None
    return record


def table(result: dict[str, Any]) -> str:
    """The short summary printed last."""
    runs = result["runs"]
    m, f, r = runs.get("measure", {}), runs.get("fault", {}), runs.get("resume", {})
    weights = m.get("weights") or {}
    rows = [
        ("card(s)", ", ".join(result.get("cards") or []) or "?"),
        ("server start-ups (s)", ", ".join(str(x.get("server", {}).get("startup_s")) for x in (m, f, r))),
        ("measure", f"{m.get('status')}; {len((m.get('phase_s') or {}).get('sync') or [])} syncs, max "
                    f"{m.get('sync_max_s')} s; set-up max {m.get('setup_max_s')} s; "
                    f"{weights.get('tensors')} tensors, {weights.get('bytes')} bytes"),
        ("fault", f"{f.get('status')}; kill -> exit {f.get('kill_to_exit_s')} s (timeout {result['fault_timeout']} "
                  f"s); watchdog: {f.get('by_watchdog')}; outputs identical: "
                  f"{(f.get('outputs') or {}).get('identical')}; new checkpoint dirs: "
                  f"{(f.get('outputs') or {}).get('new_checkpoint_dirs')}"),
        ("fault line", (f.get("stall_line") or f.get("last_error") or "-")[:160]),
        ("resume", f"{r.get('status')}; steps {(r.get('summary') or {}).get('steps')} of {result['max_steps']}; "
                   f"reached: {r.get('reached_max_steps')}"),
        ("wall (s)", str(result.get("wall_s"))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def gpu_names() -> list[str]:
    """The host's cards by ``nvidia-smi -L`` (the parent holds no CUDA context; each child records its own)."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/root/models/smollm2-135m-instruct")
    p.add_argument("--out", default="/tmp/sync_fault/sync_fault.json", help="the JSON record")
    p.add_argument("--work-dir", help="recipe, logs and output_dirs (default: the --out file's folder)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--server-gpu", type=int, default=1)
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.15,
                   help="the server's share of its GPU (other jobs may share the cards)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="serve without CUDA-graph capture: a shorter start-up, the same weight path")
    p.add_argument("--server-timeout", type=float, default=180.0, help="seconds a server start may take")
    p.add_argument("--steps", type=int, default=6, help="max_steps (a rollout every 2 steps)")
    p.add_argument("--save-steps", type=int, default=2, help="a checkpoint every this many steps")
    p.add_argument("--fault-timeout", type=float, default=30.0,
                   help="the fault run's --vllm_sync_timeout (below TRL's 60 s of retries on a refused connection)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="the whole script's wall-clock bound (330 s cut the resume on 2 H200s)")
    p.add_argument("--commit", help="the checkout's commit, when this copy of it has no .git")
    p.add_argument("--print-commands", action="store_true",
                   help="print the server line, the three dfpo-train lines and the recipe, and exit (no GPU)")
    args = p.parse_args(argv)
    args.work_dir = args.work_dir or str(pathlib.Path(args.out).parent)
    if not 0 < args.save_steps < args.steps:
        p.error("--save-steps must be below --steps: the fault run needs a checkpoint before its end")
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw[:1] == ["--child"]:
        return child(raw[1:])
    args = parse(raw)
    work = pathlib.Path(args.work_dir)
    recipe_path = work / "recipe.yaml"
    recipe = fault_recipe(args)
    if args.print_commands:
        print("\n".join(command_lines(args, recipe_path)))
        print(f"# recipe {recipe_path}")
        print(yaml.safe_dump(recipe, sort_keys=False), end="")
        return 0
    started = time.monotonic()
    budget = Budget(args.budget_s)
    work.mkdir(parents=True, exist_ok=True)
    for folder in ("measure", "fault", "pause"):  # this script's own folders: a rerun starts from none
        shutil.rmtree(work / folder, ignore_errors=True)
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    state = checkout_state(ROOT)
    result: dict[str, Any] = {
        "cards": gpu_names(), "versions": installed_versions(), "checkout": state,
        "commit": args.commit or state.get("commit"), "server_command": command_lines(args, recipe_path)[1],
        "server_argv": benchmark_server_command(args, python=sys.executable, scale_out=vllm_has_scale_out()),
        "recipe": recipe, "max_steps": args.steps, "save_steps": args.save_steps,
        "fault_timeout": args.fault_timeout, "runs": {}}
    children = Children()

    def terminated(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, terminated)
    try:
        for name, step in (("measure", measure_run), ("fault", fault_run), ("resume", resume_run)):
            try:
                result["runs"][name] = step(args, children, recipe_path, budget)
            except Exception as exc:  # noqa: BLE001 - recorded; the next step still runs
                result["runs"][name] = {"status": "crash", "error": repr(exc)}
            if name == "measure" and (result["runs"][name].get("card")):
                result["trainer_card"] = result["runs"][name]["card"]
            print(f"sync_fault: {name}: {result['runs'][name].get('status')}", flush=True)
            result["wall_s"] = round(time.monotonic() - started, 1)
            write_json(args.out, result)
    except KeyboardInterrupt as exc:
        result["interrupted"] = str(exc) or "SIGINT"
    finally:
        children.stop_all()
        result["wall_s"] = round(time.monotonic() - started, 1)
        write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
