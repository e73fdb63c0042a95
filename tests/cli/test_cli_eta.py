"""The progress bar's time left comes from whole rollout periods: a period's first step generates (minutes on a
CPU) and the others only train, so the first step's pace alone put the end of a 5-minute job at 11:41."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import dfpo_trl.cli.progress as progress
from dfpo_trl.cli.progress import DFPOProgressCallback, RolloutRateBar, rollout_period, rollout_rate


def test_rollout_period_is_optimizer_steps_per_generation() -> None:
    def period(accumulation: int, per_generation: int | None, iterations: int) -> int:
        return rollout_period(SimpleNamespace(gradient_accumulation_steps=accumulation,
                                              steps_per_generation=per_generation, num_iterations=iterations))

    assert period(1, 4, 1) == 4  # the CPU recipe
    assert period(2, 8, 2) == 8  # 8 micro-steps per generation, each buffer used twice, 2 micro-steps per step
    assert period(4, None, 1) == 1  # TRL's default steps_per_generation: one generation per optimizer step


def test_rollout_rate_waits_for_a_whole_period_and_then_averages_whole_periods() -> None:
    # a rollout step of 10 s, then three training steps of 1 s, twice; start at t = 0
    ends = [10.0, 11.0, 12.0, 13.0, 23.0, 24.0]
    assert [rollout_rate(ends[:n], 0.0, 4) for n in (1, 2, 3)] == [None, None, None]
    assert rollout_rate(ends[:4], 0.0, 4) == pytest.approx(4 / 13)
    assert rollout_rate(ends[:6], 0.0, 4) == pytest.approx(4 / 13)  # the second period is not whole yet
    assert rollout_rate(ends[:1], 0.0, 1) == pytest.approx(1 / 10)  # a rollout every step: every step is whole


def test_bar_shows_no_time_left_until_a_rollout_period_ends_then_the_periods_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """16 steps, a rollout every 4: after step 1 (10 s) the stock bar said 15 x 10 s = 2:30 left; this one says "?"
    until step 4 (13 s for 4 steps), then 12 steps x 13/4 s = 0:39."""
    clock = iter([0.0, 10.0, 11.0, 12.0, 13.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    args = SimpleNamespace(gradient_accumulation_steps=1, steps_per_generation=4, num_iterations=1)
    state = SimpleNamespace(is_world_process_zero=True, max_steps=16, global_step=0)
    callback = DFPOProgressCallback()
    callback.on_train_begin(args, state, None)
    bar = callback.training_bar
    assert isinstance(bar, RolloutRateBar)
    shown = []
    for step in range(1, 5):
        state.global_step = step
        callback.on_step_end(args, state, None)
        shown.append(RolloutRateBar.format_meter(**bar.format_dict))
    assert all("<?, ?it/s" in text for text in shown[:3]), shown
    assert "<00:39, " in shown[3] and " 4/16 " in shown[3], shown[3]
    bar.close()
