"""The CLI's progress bar follows the rollout's generation token by token (on a CPU the first rollout takes minutes
before the first optimizer step), without changing what is generated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import save_tiny_chat_model, tiny_model, tiny_tokenizer, write_tiny_recipe

from dfpo_trl.cli.progress import DFPOProgressCallback, GenerationProgress

pytestmark = pytest.mark.usefixtures("one_thread")


def test_generation_progress_counts_tokens_and_finished_completions_and_leaves_sampling_alone() -> None:
    model, tokenizer = tiny_model(), tiny_tokenizer()
    prompt = tokenizer(["Compute 3 + 4 ="] * 6, return_tensors="pt")
    eos = tokenizer.eos_token_id
    kwargs = dict(**prompt, max_new_tokens=8, do_sample=True, temperature=3.0, pad_token_id=0, eos_token_id=eos)
    torch.manual_seed(1)
    plain = model.generate(**kwargs)
    reports: list[tuple[int, int, int, int]] = []
    counter = GenerationProgress(lambda *r: reports.append(r), prompt["input_ids"].size(1), 8, [eos])
    torch.manual_seed(1)
    followed = model.generate(**kwargs, logits_processor=[counter])
    assert torch.equal(plain, followed)  # the processor returns the scores unchanged
    generated = plain[:, prompt["input_ids"].size(1) :]
    assert [r[2] for r in reports] == list(range(1, generated.size(1) + 1))  # one report per new token
    assert all(total == 6 and max_new == 8 for _, total, _, max_new in reports)
    for done, _, token, _ in reports:  # finished = an end-of-sequence among the tokens generated before this one
        assert done == int((generated[:, : token - 1] == eos).any(dim=1).sum())
    assert [r[0] for r in reports] == sorted(r[0] for r in reports)


def test_cli_bar_shows_the_rollouts_generation_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rollout of 2 prompts x G = 4 = 8 completions of at most 4 tokens feeds the 2 steps: the bar reports its
    tokens 1, 2, ... of 4 for 8 completions; the held-out evaluations (4 problems, before the bar opens and after
    it closes) report nothing; the description is cleared when generation ends."""
    from dfpo_trl.cli.main import main

    argv = write_tiny_recipe(tmp_path, save_tiny_chat_model(tmp_path / "model"), tmp_path / "out", plot=False,
                             disable_tqdm=False)

    shown: list[tuple[int, int, int, int]] = []
    show = DFPOProgressCallback.show_generation

    def record(self: DFPOProgressCallback, *report: int) -> None:
        shown.append(report)
        show(self, *report)

    monkeypatch.setattr(DFPOProgressCallback, "show_generation", record)
    assert main(argv) == 0
    err = capsys.readouterr().err
    tokens = [token for _, _, token, _ in shown]
    assert tokens == list(range(1, len(tokens) + 1)) and 1 <= len(tokens) <= 4
    assert {(total, max_new) for _, total, _, max_new in shown} == {(8, 4)}
    assert "generating: token 1/4, 0/8 completions done" in err
    last_frame = err.split("\r")[-1]
    assert "generating" not in last_frame


def test_cli_bar_names_the_heldout_evaluation_along_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With eval_every 1 the held-out evaluation after step 1 runs while the bar is open: the bar names it (with the
    evaluation's own token budget, eval_max_new_tokens 4, and its 4 problems), a line above the bar gives its
    accuracy, and the bar's postfix then shows it."""
    from dfpo_trl.cli.main import main

    argv = [*write_tiny_recipe(tmp_path, save_tiny_chat_model(tmp_path / "model"), tmp_path / "out", plot=False,
                               disable_tqdm=False, eval_max_new_tokens=3), "--eval_every", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "held-out evaluation: token 1/3, 0/4 completions done" in captured.err
    assert "generating: token 1/4, 0/8 completions done" in captured.err  # the rollout, as before
    assert "held-out greedy accuracy at step 1: " in captured.out
    assert "heldout=" in captured.err


def test_cli_evaluations_outside_the_bar_show_their_own_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The held-out evaluation before training (on a loaded machine, minutes before the first step) and the one
    after it run while no training bar is open: each shows its own line, with the batch, the token and the time
    left, cleared when it ends (the accuracy then printed on its own line)."""
    from dfpo_trl.cli.main import main

    argv = write_tiny_recipe(tmp_path, save_tiny_chat_model(tmp_path / "model"), tmp_path / "out", plot=False,
                             disable_tqdm=False, eval_max_new_tokens=3, max_steps=1)
    assert main(argv) == 0
    captured = capsys.readouterr()
    for when in ("before", "after"):
        assert f"held-out greedy accuracy {when} training (4 problems): batch 1/1, token 1/3 (" in captured.err
        assert f"held-out greedy accuracy {when} training (4 problems): batch 1/1, token 3/3 (100%" in captured.err
        assert f"held-out greedy accuracy {when} training: " in captured.out
    assert " left)" in captured.err


def test_elapsed_line_redraws_the_time_taken_and_is_off_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from dfpo_trl.cli.progress import elapsed_line

    with elapsed_line("converting", every=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert err.count("converting: 00:00") >= 3  # drawn at the start, then redrawn as time passes
    with elapsed_line("converting", enabled=False):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""
