"""A training process killed, or hung, in a multi-process ``dfpo-train`` launch on the CPU (gloo, one host): how long
every process takes to end, with which exit codes and which lines, what stays in ``output_dir``, and that the run
resumed from its last checkpoint is the uninterrupted one (docs/source/guides/cli.md, "Several nodes").

Launched as users launch: ``accelerate launch --multi_gpu --num_processes 2 -m dfpo_trl RECIPE`` for one node (with
``use_cpu: true``; ``--cpu --num_processes 2`` starts ONE process in accelerate 1.15, its simple launcher), and for
two "nodes" two launchers with ``--num_machines 2 --machine_rank 0/1 --rdzv_backend c10d --max_restarts 0``, as
recipes/slurm/dfpo_multinode.sh starts each node. The kill lands at a known point: once checkpoint-3 is whole, the
reward of process 1 stalls (a reward written here, by import path), process 0 scores its completions and waits in
TRL's gather of the rewards, and the test sends SIGKILL (a process that dies: killed, out of host memory) or SIGSTOP
(a process that hangs, or a node that is gone without closing its connections) to process 1.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from tiny import save_tiny_chat_model, write_tiny_recipe

from dfpo_trl.cli.paths import missing_process_files

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
# A rollout every 2 steps, checkpoints at 3 (inside the rollout of steps 3-4) and 6; the stall is at step 5's rollout.
CHANGES = dict(save_strategy="steps", save_steps=3, max_steps=8, steps_per_generation=2, learning_rate=1.0e-2,
               reward_funcs=["killed_rank_reward:reward"])
DDP_TIMEOUT = 20
REWARD = '''
"""The last digit of the answer in the completion; once STALL_AFTER exists each process marks MARKS/rank<R> and
process 1 then stalls (and is killed or stopped there)."""
import os
import time
from pathlib import Path


def reward(prompts, completions, answer, **kwargs):
    gate = os.environ.get("STALL_AFTER")
    if gate and Path(gate).exists():
        Path(os.environ["MARKS"], "rank" + os.environ["RANK"]).write_text(str(os.getpid()))
        if os.environ["RANK"] == "1":
            time.sleep(600)
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(str(a)[-1] in t) for t, a in zip(texts, answer)]
'''


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with its content's hash."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launch:
    """The launchers of one run (one per "node") and everything they start, found again by a token in their
    environment: torchrun starts each worker in a session of its own, so a launcher killed first would orphan them."""

    work: Path
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    launchers: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(self.work)]), "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DFPO_KILLED_RANK_TEST": self.token, **extra}

    def start(self, flags: list[str], argv: list[str], name: str, **extra: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--mixed_precision", "no",
                   "--dynamo_backend", "no", "-m", "dfpo_trl", *argv]
        log = self.work / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env(**extra),
                                    cwd=self.work, start_new_session=True)
        self.launchers.append(proc)
        self.logs.append(log)
        return proc

    def processes(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("DFPO_KILLED_RANK_TEST") == self.token:
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def workers(self) -> dict[int, psutil.Process]:
        return {int(p.environ()["RANK"]): p for p in self.processes() if "RANK" in p.environ()}

    def stop_all(self) -> None:
        for proc in self.processes():
            try:
                proc.kill()
            except psutil.Error:
                pass
        for launcher in self.launchers:
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def wait_until_waiting(proc: psutil.Process, limit: float, window: float = 0.5) -> None:
    """Until ``proc`` has used almost no CPU for ``window`` seconds: it waits in a collective (gloo's wait holds no
    CPU), not still scoring. A fixed sleep was not enough on a loaded machine: process 0, still computing when
    process 1 was killed, got the launcher's SIGTERM before it reached the collective."""
    deadline = time.monotonic() + limit
    used = sum(proc.cpu_times()[:2])
    while time.monotonic() < deadline:
        time.sleep(window)
        now = sum(proc.cpu_times()[:2])
        if now - used < 0.05 * window:
            return
        used = now
    raise AssertionError(f"process {proc.pid} never came to wait in a collective within {limit} s")


def wait_for(condition, limit: float, what: str, launch: Launch) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in launch.launchers):
            logs = "\n".join(log.read_text()[-3000:] for log in launch.logs)
            raise AssertionError(f"{what} did not happen within {limit} s:\n{logs}")
        time.sleep(0.05)


def watch_ends(procs: list[psutil.Process], start: float, limit: float) -> dict[int, float]:
    """Seconds from ``start`` to each process's end (exited, or a zombie its parent has not reaped)."""
    ends: dict[int, float] = {}
    deadline = start + limit
    while len(ends) < len(procs) and time.monotonic() < deadline:
        for proc in procs:
            if proc.pid in ends:
                continue
            try:
                gone = proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                ends[proc.pid] = time.monotonic() - start
        time.sleep(0.05)
    return ends


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The tiny model, the reward module and the recipe: (folder, argv without --output_dir)."""
    work = tmp_path_factory.mktemp("killed_rank")
    model = save_tiny_chat_model(work / "model")
    (work / "killed_rank_reward.py").write_text(REWARD)
    return work, write_tiny_recipe(work, model, **CHANGES)


ONE_NODE = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]


@pytest.fixture(scope="module")
def killed_run(work: tuple[Path, list[str]]) -> Iterator[dict]:
    """One node, two processes: process 1 SIGKILLed in the rollout of step 5, once checkpoint-3 is whole."""
    folder, argv = work
    out, marks = folder / "killed", folder / "marks-killed"
    marks.mkdir()
    launch = Launch(folder)
    try:
        launcher = launch.start([*ONE_NODE, "--main_process_port", str(free_port())],
                                [*argv, "--output_dir", str(out)], "killed", MARKS=str(marks),
                                STALL_AFTER=str(out / "checkpoint-3" / "dfpo_rollout_state_1.pt"))
        wait_for(lambda: (marks / "rank0").exists() and (marks / "rank1").exists(), 300, "the stall", launch)
        time.sleep(1.0)
        procs = launch.processes()
        workers = launch.workers()
        wait_until_waiting(workers[0], 120)  # process 0 is in TRL's gather of the rewards
        before = tree(out)
        killed_at = time.monotonic()
        workers[1].send_signal(signal.SIGKILL)
        ends = watch_ends(procs, killed_at, 120)
        code = launcher.wait(timeout=60)
        yield dict(out=out, before=before, after=tree(out), ends=ends, procs=procs, code=code, workers=workers,
                   log=(folder / "killed.log").read_text(), argv=argv, launch_pid=launcher.pid)
    finally:
        launch.stop_all()


def test_a_killed_process_ends_the_launch_in_seconds_checkpoints_untouched(killed_run: dict) -> None:
    """torchrun's agent (inside accelerate launch) sees process 1 die, signals process 0 and exits 1, naming the
    killed process; process 0, waiting in a collective, already ended on the closed connection with one line. Every
    process is gone within seconds; output_dir holds checkpoint-3 whole and byte for byte as before the kill, and
    nothing else was written (no partial checkpoint-6, no summary)."""
    run = killed_run
    ends = run["ends"]
    print(f"SIGKILL of process 1 to the end of: process 1 {ends.get(run['workers'][1].pid, -1):.2f} s, process 0 "
          f"{ends.get(run['workers'][0].pid, -1):.2f} s, the launcher {ends.get(run['launch_pid'], -1):.2f} s; "
          f"launcher exit code {run['code']}")
    assert len(ends) == len(run["procs"]) == 3, (ends, run["log"][-3000:])
    assert max(ends.values()) < 10, ends  # measured 0.5 s; the agent's own bound is SIGTERM, then SIGKILL 30 s later
    assert run["code"] == 1
    log = run["log"]
    pid1 = run["workers"][1].pid
    assert f"exitcode  : -9 (pid: {pid1})" in log and f"Signal 9 (SIGKILL) received by PID {pid1}" in log
    lines = [line for line in log.splitlines() if line.startswith("dfpo-train:")]
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith("dfpo-train: process 0 of 2 lost its connection to another process in a collective "
                               "after step 4 (")
    assert "Connection closed by peer" in lines[0] or "Connection reset by peer" in lines[0]
    assert lines[0].endswith(f"Stopped; nothing was written; the last whole checkpoint, {run['out'] / 'checkpoint-3'}, "
                             "is where --resume_from_checkpoint restarts")
    assert "[rank0]: Traceback" not in log  # the line instead of process 0's traceback
    assert run["after"] == run["before"]
    assert sorted(p.name for p in run["out"].iterdir()) == ["README.md", "checkpoint-3"]
    checkpoint = run["out"] / "checkpoint-3"
    assert (checkpoint / "trainer_state.json").is_file() and missing_process_files(checkpoint) == []


def test_resume_after_the_kill_is_the_uninterrupted_run(killed_run: dict, work: tuple[Path, list[str]]) -> None:
    """The killed run resumed with --resume_from_checkpoint true (checkpoint-3, inside a rollout) to max_steps, and
    the same recipe run without interruption: the final checkpoint's weights and optimizer state are byte for byte
    the same."""
    folder, argv = work
    reference = folder / "uninterrupted"
    launch = Launch(folder)
    try:
        for name, tail in (("uninterrupted", ["--output_dir", str(reference)]),
                           ("resumed", ["--output_dir", str(killed_run["out"]), "--resume_from_checkpoint", "true"])):
            start = time.monotonic()
            proc = launch.start([*ONE_NODE, "--main_process_port", str(free_port())], [*argv, *tail], name)
            code = proc.wait(timeout=400)
            print(f"{name}: exit {code} in {time.monotonic() - start:.1f} s")
            assert code == 0, (folder / f"{name}.log").read_text()[-3000:]
    finally:
        launch.stop_all()
    resumed_log = (folder / "resumed.log").read_text()
    assert "from the checkpoint, resumed at step 3" in resumed_log
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        resumed = (killed_run["out"] / "checkpoint-8" / name).read_bytes()
        assert resumed == (reference / "checkpoint-8" / name).read_bytes(), name


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_two_nodes_end_when_one_nodes_process_dies_or_hangs(how: str, work: tuple[Path, list[str]]) -> None:
    """Two launchers on one host stand for two nodes, started as the Slurm kit starts each (c10d rendezvous, no
    restarts), --ddp_timeout 20. Node 1's process killed: node 0's process ends on the closed connection at once,
    with the line. Node 1's process stopped (a hang, or a node gone without closing its connections): node 0's
    process waits in gloo's collective until ddp_timeout, then ends with the line naming it; node 1's launcher,
    whose rendezvous store (node 0's) is gone, signals its process and kills it 30 s later. Exit code 1 on both
    nodes; output_dir as it was."""
    folder, argv = work
    out, marks = folder / f"two-{how}", folder / f"marks-two-{how}"
    marks.mkdir()
    port = free_port()
    launch = Launch(folder)
    env = dict(MARKS=str(marks), STALL_AFTER=str(out / "checkpoint-3" / "dfpo_rollout_state_1.pt"))
    tail = [*argv, "--output_dir", str(out), "--ddp_timeout", str(DDP_TIMEOUT)]
    try:
        for rank in (0, 1):
            flags = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                     "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "c10d",
                     "--max_restarts", "0"]
            launch.start(flags, tail, f"two-{how}-node{rank}", **env)
            if rank == 0:  # node 0's agent hosts the rendezvous; node 1's would take the port on one host
                wait_for(lambda: listening(port), 120, "node 0's rendezvous store", launch)
        wait_for(lambda: (marks / "rank0").exists() and (marks / "rank1").exists(), 300, "the stall", launch)
        time.sleep(1.0)
        procs = launch.processes()
        workers = launch.workers()
        wait_until_waiting(workers[0], 120)  # process 0 is in TRL's gather of the rewards
        node0 = [p for p in procs if p.pid in (launch.launchers[0].pid, workers[0].pid)]
        node1 = [p for p in procs if p.pid in (launch.launchers[1].pid, workers[1].pid)]
        before = tree(out)
        start, start_wall = time.monotonic(), time.time()
        workers[1].send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)
        ends = watch_ends(procs, start, 120)
        codes = [launcher.wait(timeout=60) for launcher in launch.launchers]
        after = tree(out)
    finally:
        launch.stop_all()
    node0_log = launch.logs[0].read_text()
    print(f"{how} of node 1's process to the end of: node 0's process {ends.get(workers[0].pid, -1):.2f} s, its "
          f"launcher {ends.get(launch.launchers[0].pid, -1):.2f} s; node 1's launcher "
          f"{ends.get(launch.launchers[1].pid, -1):.2f} s; exit codes {codes}")
    assert len(ends) == 4, (ends, node0_log[-3000:])
    assert codes == [1, 1]
    lines = [line for line in node0_log.splitlines() if line.startswith("dfpo-train:")]
    assert len(lines) == 1, node0_log[-3000:]
    node0_end = max(ends[p.pid] for p in node0)
    if how == "SIGKILL":
        assert node0_end < DDP_TIMEOUT / 2, ends
        assert lines[0].startswith("dfpo-train: process 0 of 2 lost its connection to another process in a "
                                   "collective after step 4 (")
        assert max(ends[p.pid] for p in node1) < DDP_TIMEOUT / 2, ends
    else:
        # what ended it: ddp_timeout, which counts from process 0's entry into the collective, just after its mark
        # and before the signal (the test waits for both marks, then 1 s): so read process 0's wait from its mark
        waited = ends[workers[0].pid] + start_wall - (marks / "rank0").stat().st_mtime
        print(f"node 0's process from its mark to its end: {waited:.2f} s")
        assert DDP_TIMEOUT <= waited <= DDP_TIMEOUT + 10, (waited, ends)
        assert lines[0].startswith(f"dfpo-train: process 0 of 2 waited ddp_timeout ({DDP_TIMEOUT} s) for another "
                                   "process in a collective after step 4 (Timed out waiting 20000ms for ")
        assert max(ends[p.pid] for p in node1) <= DDP_TIMEOUT + 30 + 20, ends
    assert "is where --resume_from_checkpoint restarts" in lines[0] and "checkpoint-3" in lines[0]
    assert after == before
