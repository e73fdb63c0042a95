"""A rerun into the same ``output_dir`` never destroys an earlier run (docs/source/guides/cli.md, "An earlier run's
results").

The earlier run's results move aside only once the new run's first optimizer step has ended, to the first free
``previous_run/``, ``previous_run.1/``, ...; nothing is ever deleted. The end-to-end tests interrupt the real
``dfpo-train`` in a subprocess as a terminal does, SIGINT to its process group, at a known point: a reward function
of the test's (an import path, as a user gives one) writes a mark and waits when the trainer reaches a given step,
and the test sends the signal once the mark exists. Points: while the run starts (before train()), inside the
first step's rollout, after the first step, and twice in a row (two reruns, and two Ctrl-C presses in one run).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import save_tiny_chat_model, write_tiny_recipe

from dfpo_trl.cli.files import (
    PREVIOUS_RUN_DIR,
    aside_folders,
    earlier_results,
    names_said,
    next_aside_folder,
    removed_if_left_empty,
    set_aside_previous_outputs,
)

ROOT = Path(__file__).resolve().parents[2]

# Waits at the rollout of global step STALL_AT_STEP (0: inside the first optimizer step) once STALL_MARK is named.
STALL_REWARD = '''
import os
import time
from pathlib import Path


def reward(prompts, completions, answer, trainer_state=None, **kwargs):
    stall = os.environ.get("STALL_AT_STEP")
    if stall is not None and trainer_state is not None and trainer_state.global_step == int(stall):
        Path(os.environ["STALL_MARK"]).write_text(str(trainer_state.global_step))
        time.sleep(600)
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(str(a)[-1] in t) for t, a in zip(texts, answer)]
'''
# A rollout every 2 optimizer steps: the rollout at global step 2 comes after steps 1 and 2 have ended.
CHANGES = dict(reward_funcs=["stallreward:reward"], steps_per_generation=2, max_steps=4, eval_size=2)


def tree(root: Path) -> dict[str, str | None]:
    """Every file under ``root`` with its content's hash, every folder with None."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


# ------------------------------------------------------------------------------------------------ the folders


def _write_run(out: Path, steps: int, extra: tuple[str, ...] = ("model.safetensors",)) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files = ["dfpo_summary.json", "dfpo_metrics.png", *extra]
    (out / "dfpo_summary.json").write_text(json.dumps({"steps": steps, "files": files}))
    for name in files[1:]:
        (out / name).write_text(f"{name} of the run of {steps} steps")


def test_each_earlier_run_goes_to_a_new_aside_folder_and_none_is_replaced(tmp_path: Path) -> None:
    """Three reruns: previous_run/, previous_run.1/, previous_run.2/, each holding its own run, byte for byte; a file
    or link where a folder name would go is passed over, not replaced."""
    out = tmp_path / "out"
    histories = []
    for steps in (1, 2, 3):
        _write_run(out, steps)
        histories.append(tree(out))
        outcome = set_aside_previous_outputs(out)
        assert outcome.moved == ["dfpo_metrics.png", "dfpo_summary.json", "model.safetensors"]
        assert outcome.target == out / (PREVIOUS_RUN_DIR if steps == 1 else f"{PREVIOUS_RUN_DIR}.{steps - 1}")
        assert [p.name for p in outcome.kept] == [p.name for p in aside_folders(out)][:-1]
    for steps, target in zip((1, 2, 3), ("previous_run", "previous_run.1", "previous_run.2"), strict=True):
        assert json.loads((out / target / "dfpo_summary.json").read_text())["steps"] == steps
        assert (out / target / "model.safetensors").read_text() == f"model.safetensors of the run of {steps} steps"
    (out / "previous_run.3").write_text("not a folder")  # a file of the user's: kept, and the name passed over
    (out / "previous_run.4").symlink_to(tmp_path / "nowhere")
    _write_run(out, 4)
    assert set_aside_previous_outputs(out).target == out / "previous_run.5"
    assert (out / "previous_run.3").read_text() == "not a folder" and (out / "previous_run.4").is_symlink()
    assert next_aside_folder(out) == out / "previous_run.6"


def test_what_moves_the_summarys_files_and_checkpoints_not_the_rest(tmp_path: Path) -> None:
    """The files the summary lists (or, for a summary older than that list, what save_model writes), and the
    checkpoint-N/ folders (a fresh run would write over them, and `resume_from_checkpoint true` would pick an old
    one); a resumed run keeps checkpoint-N/ up to its own step K. Notes of the user's stay."""
    out = tmp_path / "out"
    for step in (2, 4, 6):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    for name in ("model.safetensors", "config.json", "notes.txt", "dfpo_metrics.png"):
        (out / name).write_text(name)
    (out / "dfpo_summary.json").write_text(json.dumps({"steps": 3}))  # no "files": an older summary
    assert earlier_results(out, keep_checkpoints_to=4) == [
        "checkpoint-6", "config.json", "dfpo_metrics.png", "dfpo_summary.json", "model.safetensors"
    ]
    outcome = set_aside_previous_outputs(out)
    assert outcome.moved == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "config.json", "dfpo_metrics.png",
                             "dfpo_summary.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "previous_run"]
    assert (out / "previous_run" / "checkpoint-4" / "trainer_state.json").read_text() == "{}"
    (out / "dfpo_summary.json").write_text(json.dumps({"files": ["dfpo_summary.json", "../notes.txt", "x.bin"]}))
    (out / "x.bin").write_text("x")
    assert set_aside_previous_outputs(out).moved == ["dfpo_summary.json", "x.bin"]
    assert (out / "notes.txt").is_file() and set_aside_previous_outputs(out).moved == []
    assert names_said(["a", "b"]) == "a, b"
    assert names_said(["a.json", "b", "checkpoint-2", "dfpo_summary.json", "model.safetensors"]) == \
        "dfpo_summary.json, model.safetensors, checkpoint-2 and 2 more"


def test_a_run_that_writes_nothing_leaves_no_empty_output_dir(tmp_path: Path) -> None:
    """The folders of output_dir that did not exist before the run are removed after it when still empty (the run
    created them and wrote nothing); a folder that holds anything, or that was there before, stays."""
    target = tmp_path / "a" / "b" / "out"
    with removed_if_left_empty(target):
        target.mkdir(parents=True)
    assert not (tmp_path / "a").exists() and tmp_path.is_dir()
    with removed_if_left_empty(target):
        target.mkdir(parents=True)
        (tmp_path / "a" / "notes.txt").write_text("mine")
    assert not (tmp_path / "a" / "b").exists() and (tmp_path / "a" / "notes.txt").is_file()
    with removed_if_left_empty(target):
        target.mkdir(parents=True)
        (target / "dfpo_summary.json").write_text("{}")
    assert (target / "dfpo_summary.json").is_file()
    (target / "dfpo_summary.json").unlink()
    with removed_if_left_empty(target):  # there before: stays, empty or not
        pass
    assert target.is_dir()


# ------------------------------------------------------------------------------------------------ real interrupts


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model, the stalling reward, and one finished run (its model saved) to copy for each test."""
    work = tmp_path_factory.mktemp("reruns")
    model = save_tiny_chat_model(work / "tiny")
    (work / "stallreward.py").write_text(STALL_REWARD)
    finished = work / "finished"
    proc = _start(work, model, finished)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert (finished / "model.safetensors").is_file() and (finished / "dfpo_summary.json").is_file()
    return work, model


def _start(work: Path, model: Path, out: Path, stall_at: int | None = None) -> subprocess.Popen:
    """``dfpo-train`` on the tiny recipe in a session (a process group) of its own, as a terminal runs it."""
    argv = write_tiny_recipe(work, model, out, save_model=True, **CHANGES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "STALL_MARK": str(work / f"mark-{out.name}")}
    env.pop("STALL_AT_STEP", None)
    if stall_at is not None:
        env["STALL_AT_STEP"] = str(stall_at)
    (work / f"mark-{out.name}").unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, "-m", "dfpo_trl", *argv], cwd=work, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_at_default)


def _sigint_at_default() -> None:
    """A terminal's child starts with SIGINT at its default. Under a shell that ignores it (a background job of a
    non-interactive shell, or ``nohup``), the child would inherit the ignore, and the test's Ctrl-C would not reach
    it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c(proc: subprocess.Popen, when: Path | str, work: Path, gap: float | None = None) -> tuple[int, str]:
    """SIGINT to ``proc``'s process group once the mark ``when`` exists (or, for a str, once stderr shows it), and
    with ``gap``, once more ``gap`` seconds later; its exit code and stderr."""
    deadline = time.monotonic() + 300
    if isinstance(when, Path):
        while not when.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never reached the point of the interrupt"
            time.sleep(0.1)
    else:
        seen = ""
        while when not in seen:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, seen[-3000:]
            seen += line
    os.killpg(proc.pid, signal.SIGINT)
    if gap is not None:
        time.sleep(gap)
        with contextlib.suppress(ProcessLookupError):  # it may have ended already
            os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _copy_finished(work: Path, name: str) -> Path:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(work / "finished", out)
    return out


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_ctrl_c_before_and_during_the_first_step_keeps_the_finished_run_in_place(work: tuple[Path, Path]) -> None:
    """Ctrl-C while the run starts (its trainer just built), then Ctrl-C inside the first step's rollout, twice in
    a row: the finished run stays where it was, byte for byte, nothing is written or moved, and the last line says
    that the earlier run's results are kept in place."""
    workdir, model = work
    out = _copy_finished(workdir, "before")
    finished = tree(out)
    code, err = _ctrl_c(_start(workdir, model, out, stall_at=0), "DFPO group layout", workdir)
    assert code == 130 and tree(out) == finished, err[-3000:]
    assert _last_line(err).startswith("dfpo-train: interrupted"), err[-3000:]
    for _ in range(2):
        code, err = _ctrl_c(_start(workdir, model, out, stall_at=0), workdir / "mark-before", workdir)
        assert code == 130 and tree(out) == finished, err[-3000:]
        assert _last_line(err) == (
            f"dfpo-train: interrupted at step 0 of 4, before this run's first optimizer step ended: nothing written to "
            f"{out}; the earlier run's results there (dfpo_summary.json, model.safetensors, chat_template.jinja and 6 "
            "more) are kept in place"
        )


@pytest.mark.slow
def test_ctrl_c_after_the_first_step_twice_in_a_row_loses_nothing(work: tuple[Path, Path]) -> None:
    """The issue's case: a finished run, then two reruns into the same folder, each interrupted after its first
    step. The finished run's model is in previous_run/ byte for byte, the first interrupted run's partial summary in
    previous_run.1/, the second's at the top, and each run's last line says where the earlier one went."""
    workdir, model = work
    out = _copy_finished(workdir, "after")
    finished = tree(out)
    code, err = _ctrl_c(_start(workdir, model, out, stall_at=2), workdir / "mark-after", workdir)
    assert code == 130, err[-3000:]
    assert _last_line(err) == (f"dfpo-train: interrupted at step 2 of 4; partial results in {out} (the earlier "
                               f"run's moved to {out / 'previous_run'}/)")
    assert tree(out / "previous_run") == finished
    first_partial = tree(out)
    assert json.loads((out / "dfpo_summary.json").read_text())["steps"] == 2

    code, err = _ctrl_c(_start(workdir, model, out, stall_at=2), workdir / "mark-after", workdir)
    assert code == 130 and f"(the earlier run's moved to {out / 'previous_run.1'}/)" in _last_line(err)
    assert f"moved to {out / 'previous_run.1'}/; earlier runs kept in place: previous_run/" in err
    assert tree(out / "previous_run") == finished
    assert tree(out / "previous_run.1") == {k: v for k, v in first_partial.items() if not k.startswith("previous")}
    assert sorted(p.name for p in out.iterdir()) == ["dfpo_metrics.png", "dfpo_summary.json", "previous_run",
                                                      "previous_run.1"]

    # then a run that finishes: its summary names where the earlier (interrupted) run went
    proc = _start(workdir, model, out)
    stdout, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"earlier run moved to       {out / 'previous_run.2'}/" in stdout
    assert json.loads((out / "dfpo_summary.json").read_text())["earlier_run"] == str(out / "previous_run.2")
    assert tree(out / "previous_run") == finished


@pytest.mark.slow
def test_two_ctrl_c_presses_in_one_run_keep_the_finished_run(work: tuple[Path, Path]) -> None:
    """Ctrl-C pressed twice inside the first step, 0.05 s to 1 s apart: the second lands while the first is handled
    (the line "stopping (a few seconds); Ctrl-C again to quit at once"), or while the process ends. No traceback,
    exit code 130 (or killed by SIGINT, which the shell also reports as 130, when it lands in the interpreter's
    last moments), and the finished run is where it was, byte for byte."""
    workdir, model = work
    out = _copy_finished(workdir, "double")
    finished = tree(out)
    for gap in (0.05, 0.3, 1.0):
        code, err = _ctrl_c(_start(workdir, model, out, stall_at=0), workdir / "mark-double", workdir, gap=gap)
        assert code in (130, -signal.SIGINT) and tree(out) == finished, err[-3000:]
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("dfpo-train:")]
        assert lines[0].startswith("dfpo-train: interrupted"), err[-3000:]
        assert set(lines[1:]) <= {"dfpo-train: stopping (a few seconds); Ctrl-C again to quit at once"}, err
