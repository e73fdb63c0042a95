"""``dfpo-train`` and checkpoints: ``--save_steps`` saves, a resumed run continues the interrupted one and reports its
held-out accuracy as what it is (docs/source/guides/cli.md, "Resume")."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tiny import save_tiny_chat_model, write_tiny_recipe

from dfpo_trl.cli.args import RecipeError
from dfpo_trl.cli.evaluation import BEFORE_KEY
from dfpo_trl.cli.main import main
from dfpo_trl.cli.parser import parse_args

pytestmark = pytest.mark.usefixtures("one_thread")

# 4 prompts x G = 4 per rollout, one micro-step per optimizer step, a rollout every 4 steps: step 2 is inside it.
CHANGES = dict(save_model=None, steps_per_generation=4, max_steps=4, learning_rate=1.0e-2)  # to the tiny recipe


def test_save_steps_on_the_command_line_implies_steps(tmp_path: Path) -> None:
    """Under a recipe with save_strategy "no", --save_steps N used to save nothing, silently: on the command line it
    now means a checkpoint every N steps. A recipe's own pair, or a strategy given with it, stands; the command
    line asking for both N steps and no checkpoints is refused."""
    [recipe] = write_tiny_recipe(tmp_path, **CHANGES)
    out = ["--output_dir", str(tmp_path / "out")]
    for flags in (["--save_steps", "3"], ["--save_steps=3"], ["--save-steps", "3"]):
        _, args, _ = parse_args([recipe, *flags, *out])
        assert (args.save_strategy, args.save_steps) == ("steps", 3)
    _, args, _ = parse_args([recipe, *out])
    assert args.save_strategy == "no"
    _, args, _ = parse_args([*write_tiny_recipe(tmp_path, **CHANGES, save_steps=3), *out])
    assert args.save_strategy == "no"  # the recipe's choice
    _, args, _ = parse_args([recipe, "--save_steps", "3", "--save_strategy", "epoch", *out])
    assert args.save_strategy == "epoch"
    with pytest.raises(RecipeError, match="--save_steps 3 with --save_strategy no .* saves no checkpoint: drop"):
        parse_args([recipe, "--save_steps", "3", "--save_strategy", "no", *out])


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied LM head and input embedding, as SmolLM2's: its checkpoints hold the tensor once."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_tied"), tied=True)


def summary(out: Path) -> dict:
    return json.loads((out / "dfpo_summary.json").read_text())


def test_resumed_run_continues_and_reports_the_runs_own_before(
    tmp_path: Path, tied_model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A 4-step run with --save_steps 2, then the same command resumed from checkpoint-2 (inside the rollout) into
    the same output_dir. The resumed run saves the very model the first saved (byte for byte), does not warn that
    the tied lm_head.weight is missing, and reports the first run's accuracy before training (from the checkpoint),
    not the resumed model's. From a checkpoint without it (written by another trainer) it measures at the resume
    step and says so: "at resume (step 2)", the gain "since step 2", the curve starting at step 2 (and saves by
    steps, at the checkpoint's save_steps: it was saved, so its run saved)."""
    out = tmp_path / "out"
    argv = write_tiny_recipe(tmp_path, tied_model_dir, out, **CHANGES)
    assert main([*argv, "--save_steps", "2"]) == 0
    first = summary(out)
    assert (out / "checkpoint-2" / "dfpo_rollout_state_0.pt").is_file() and (out / "checkpoint-4").is_dir()
    before = first["heldout"]["before"]
    assert first["heldout"]["resumed_at"] is None and first["heldout"]["curve"][0] == [0, before]
    assert first["log_history"][0] == {BEFORE_KEY: before, "heldout/problems": 4, "step": 0}
    capfd.readouterr()

    resume = [*argv, "--resume_from_checkpoint", str(out / "checkpoint-2")]
    assert main(resume) == 0
    printed = capfd.readouterr()
    resumed = summary(out)
    assert (out / "model.safetensors").read_bytes() == (out / "previous_run" / "model.safetensors").read_bytes()
    assert "missing keys" not in printed.err + printed.out
    held = resumed["heldout"]
    assert (held["before"], held["resumed_at"], held["after"]) == (before, 2, first["heldout"]["after"])
    assert held["curve"] == [[0, before], [4, held["after"]]] and resumed["time_split"]["eval_before"] == 0
    assert f"held-out greedy accuracy before training: {before:.3f} (4 problems; from the checkpoint, resumed at " \
           "step 2)" in printed.out
    assert "resumed at step 2, the accuracy before training is the checkpoint's" in printed.out

    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["log_history"] = [row for row in state["log_history"] if BEFORE_KEY not in row]
    state_file.write_text(json.dumps(state))
    (out / "checkpoint-2" / "dfpo_run.json").unlink()  # as another trainer's checkpoint: no record of dfpo-train's
    capfd.readouterr()
    assert main(resume) == 0
    printed = capfd.readouterr()
    held = summary(out)["heldout"]
    assert held["before"] is None and held["resumed_at"] == 2 and held["curve"][0] == [2, held["at_resume"]]
    assert f"held-out greedy accuracy at resume (step 2): {held['at_resume']:.3f} (4 problems" in printed.out
    assert "since step 2, 4 fixed problems; measured at the resume, the checkpoint holds no accuracy before " \
           "training" in printed.out


def test_resumed_run_keeps_the_curve_and_the_checkpoint_settings(
    tmp_path: Path, tied_model_dir: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A run measuring the held-out accuracy every 2 steps, saving every 2 (--save_steps 2), resumed from checkpoint-2
    with the same command without --save_steps: the resumed curve carries step 2's point from the checkpoint
    (dropped before), the run saves checkpoint-4 as the first did (it saved nothing), and transformers' raw
    "save_steps: 500 (from args) != 2 (from trainer_state.json)" warning is gone. --save_steps given again wins."""
    out = tmp_path / "out"
    argv = write_tiny_recipe(tmp_path, tied_model_dir, out, **CHANGES, eval_every=2)
    assert main([*argv, "--save_steps", "2"]) == 0
    first = summary(out)["heldout"]
    assert [step for step, _ in first["curve"]] == [0, 2, 4]
    assert json.loads((out / "checkpoint-2" / "dfpo_run.json").read_text())["heldout"]["curve"] == first["curve"][:2]
    capfd.readouterr()

    with caplog.at_level(logging.INFO, logger="dfpo_trl"):
        assert main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
    printed = capfd.readouterr()
    resumed = summary(out)["heldout"]
    assert resumed["curve"][:2] == first["curve"][:2] and [s for s, _ in resumed["curve"]] == [0, 2, 4]
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()  # saved, as the checkpoint's run did
    said = printed.out + printed.err + caplog.text
    assert "do not match" not in said and "(from trainer_state.json)" not in said
    assert "resuming with save_strategy 'steps' and save_steps 2 from the checkpoint" in caplog.text

    _, args, _ = parse_args([*argv, "--resume_from_checkpoint", str(out / "checkpoint-2"), "--save_steps", "3"])
    assert (str(getattr(args.save_strategy, "value", args.save_strategy)), args.save_steps) == ("steps", 3)
