"""The main job's figure: one caption line for Asym and one for phi, saying what they mean and what they do at a
rollout's first step, which a tiny run confirms (Asym before = after, phi = 1 there; Asym 0 where all A = 0)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

import torch  # noqa: E402
from tiny import make_trainer  # noqa: E402
from tolerance import assert_close_to_rounding  # noqa: E402

from dfpo_trl import DFPOConfig, DFPOTrainer  # noqa: E402
from dfpo_trl.cli.plotting import CAPTION_CHARS_PER_LINE, plot_metrics, reading_guide  # noqa: E402
from dfpo_trl.metrics.mechanism import asym  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_asym_and_phi_have_one_caption_line_each() -> None:
    lines = reading_guide({"asym/before", "asym/after", "transform/phi_min",
                           "cancellation/shared_prefix_residual"}).splitlines()
    assert lines[0] == "How to read:" and len(lines) == 4
    asym_line, phi_line = lines[1:3]
    assert asym_line.startswith("Asym (eq. 23): spread of a group's weighted advantages s_i A_i")
    assert "equal at a rollout's first step (all s = 1), 0 where all A = 0" in asym_line
    assert phi_line.startswith("phi = s~ / s_bar: the transform's factor on each sequence weight")
    assert "1 at a rollout's first step" in phi_line
    assert all(len(line) <= CAPTION_CHARS_PER_LINE for line in lines)  # one printed line each


def test_the_caption_says_why_the_shared_prefix_residual_is_absent() -> None:
    """A run that logged the group metrics but no shared-prefix residual (the main job: its groups' short answers
    never all began with the same tokens) has no such panel; its caption says when the residual appears, instead of
    leaving the reader to look for it. A run without the group metrics says nothing of it."""
    lines = reading_guide({"asym/before", "asym/after", "transform/phi_min"}).splitlines()
    assert lines[-1] == ("No shared-prefix residual panel: it is measured where all of a group's completions begin "
                         "with the same tokens and it has a reward signal; no group here did.")
    assert len(lines[-1]) <= CAPTION_CHARS_PER_LINE
    assert "shared-prefix" not in reading_guide({"entropy"})


def test_caption_sits_below_every_panel() -> None:
    rows = [{"step": s, "step_reward": 0.5, "entropy": 1.0, "asym/before": 0.8, "asym/after": 0.6,
             "transform/phi_min": 0.9, "transform/phi_mean": 0.95, "transform/orth_residual": 1e-8,
             "cancellation/shared_prefix_residual": 0.1, "completions/mean_length": 9.0} for s in range(1, 9)]
    fig = plot_metrics(rows, heldout={"n": 100, "before": 0.48, "after": 0.82})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (caption,) = [t for t in fig.texts if t.get_text().startswith("How to read")]
    assert len(caption.get_text().splitlines()) == 5
    top = caption.get_window_extent(renderer).y1
    assert all(ax.get_tightbbox(renderer).y0 > top for ax in fig.axes if ax.get_visible())


def test_what_the_caption_says_about_a_rollouts_first_step() -> None:
    """Two rollouts of two optimizer steps: at each rollout's first step (1 and 3) the policy is the one that
    generated it, every s_bar is 1 up to rounding, so phi is 1 and Asym is the same before and after the
    transform; at the other steps Min-Replace lowers weights (phi < 1)."""
    trainer = make_trainer(
        DFPOTrainer, DFPOConfig, importance_sampling_level="sequence", loss_type="grpo", group_transform="min_replace",
        steps_per_generation=2, max_steps=4, learning_rate=5e-2, temperature=1.5,
    )
    trainer.train()
    rows = {row["step"]: row for row in trainer.state.log_history if "asym/before" in row}
    assert sorted(rows) == [1, 2, 3, 4]
    for step in (1, 3):
        assert_close_to_rounding(rows[step]["transform/phi_min"], 1.0, dtype=torch.float32, msg=f"step {step}")
        assert_close_to_rounding(rows[step]["asym/after"], rows[step]["asym/before"], dtype=torch.float32)
    assert min(rows[2]["transform/phi_min"], rows[4]["transform/phi_min"]) < 0.999
    # 0 where all A = 0: a group that scored alike has nothing to weight, whatever the weights
    assert asym(torch.tensor([[0.7, 1.3, 1.0]]), torch.zeros(1, 3)).item() == 0.0
