"""A failure in the user's own code (a reward function, a task, its data) ends ``dfpo-train`` in one line: the
user's frame (file:line), the exception, and for a reward the completion, its group and the training row; and the
previous run's results stay where they were, byte for byte, since no optimizer step ran."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
from tiny import write_tiny_recipe

from dfpo_trl.cli.main import main

USER_MODULE = '''\
def raises(prompts, completions, **kwargs):
    raise ValueError("boom")


def short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def nan(prompts, completions, **kwargs):
    return [float("nan")] + [0.0] * (len(completions) - 1)


def none(prompts, completions, **kwargs):
    return [None] * len(completions)


def bad_task():
    return {}["no such key"]


class BadData:
    name = "bad_data"
    reward_funcs = []

    def build_dataset(self, split, n, seed):
        rows = [1, 2]
        return rows[5]
'''


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture
def setup(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Path, dict]:
    """The command (the tiny recipe; the user's module in the working directory) and an output_dir holding an earlier
    run's summary, figure and model file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usermod", raising=False)  # each test's own copy, from its own folder
    (tmp_path / "usermod.py").write_text(USER_MODULE)
    out = tmp_path / "out"
    out.mkdir()
    files = ["dfpo_summary.json", "dfpo_metrics.png", "model.safetensors"]
    (out / "dfpo_summary.json").write_text(json.dumps({"steps": 3, "files": files}))
    (out / "dfpo_metrics.png").write_bytes(b"\x89PNG\r\n\x1a\nearlier figure")
    (out / "model.safetensors").write_bytes(bytes(range(256)))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    return write_tiny_recipe(tmp_path, tiny_model_dir, out, eval_size=2), out, before


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def _untouched(out: Path, before: dict) -> None:
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no previous_run/ either


def test_a_reward_that_raises_is_one_line_naming_frame_completion_group_and_row(
    setup: tuple[list[str], Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    argv, out, before = setup
    assert main([*argv, "--reward_funcs", "usermod:raises"]) == 1
    line = _one_line(capsys)
    assert re.fullmatch(
        r"dfpo-train: error: reward function 'raises' at usermod\.py:2: raised ValueError: boom on completion 0 of "
        r"the rollout's 8 \(group 0, its completion 0 of 4; training row \d+\); fix the function or drop it from "
        r"reward_funcs", line), line
    _untouched(out, before)


@pytest.mark.parametrize(("name", "said"), [
    ("short", r"reward function 'short' at usermod\.py:5: returned 7 rewards for 8 completions, on the rollout's "
              r"batch of 8 completions; return one float per completion, in order \(None where the reward does not "
              r"apply\)"),
    ("nan", r"reward function 'nan' at usermod\.py:9: returned nan, not a finite number, on completion 0 of the "
            r"rollout's 8 \(group 0, its completion 0 of 4; training row \d+\); return one float per completion, in "
            r"order \(None where the reward does not apply\)"),
])
def test_a_reward_that_returns_the_wrong_thing_is_one_line(
    setup: tuple[list[str], Path, dict], capsys: pytest.CaptureFixture[str], name: str, said: str
) -> None:
    argv, out, before = setup
    assert main([*argv, "--reward_funcs", f"usermod:{name}"]) == 1
    line = _one_line(capsys)
    assert re.fullmatch(f"dfpo-train: error: {said}", line), line
    _untouched(out, before)


def test_a_reward_that_never_applies_warns_in_one_line_and_the_run_trains_on(
    setup: tuple[list[str], Path, dict], caplog: pytest.LogCaptureFixture
) -> None:
    """None for every completion (TRL's "does not apply"): TRL warns and trains on, and so does dfpo-train (it
    refused such a run, and a multi-task run died at the first rollout no reward applied to). One line per rollout."""
    argv, out, _ = setup
    assert main([*argv, "--reward_funcs", "usermod:none"]) == 0
    warned = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0], caplog.text[-3000:]  # 2 steps of one rollout
    assert "(none of the rollout's 8 completions has a reward: their advantages are 0 and nothing is learned from " \
           "this rollout; training goes on, as in TRL)" in warned[0]
    assert json.loads((out / "dfpo_summary.json").read_text())["steps"] == 2


def test_a_task_or_its_data_that_raises_is_one_line(
    setup: tuple[list[str], Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    argv, out, before = setup
    assert main([*argv, "--task", "usermod:bad_task"]) == 1
    assert _one_line(capsys) == ("dfpo-train: error: --task on the command line: task 'usermod:bad_task' failed at "
                                 "usermod.py:18: KeyError: 'no such key'")
    assert main([*argv, "--task", "usermod:BadData"]) == 1
    assert _one_line(capsys) == textwrap.dedent("""\
        dfpo-train: error: --task on the command line: task 'usermod:BadData' building its training data failed at \
usermod.py:27: IndexError: list index out of range""")
    _untouched(out, before)
