"""The profile labels on DFPO's parts (dfpo_trl/profiling.py): a tiny run under ``torch.profiler`` shows every label
of ``PROFILE_LABELS`` and no other ``dfpo/`` one, and without a profiler a label is a shared ``nullcontext``."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from dfpo_trl.profiling import PROFILE_LABELS, profiled
from dfpo_trl.testing import tiny_trainer

SEQUENCE = dict(importance_sampling_level="sequence", epsilon=3e-2, epsilon_high=4e-2, group_transform="min_replace",
                steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=8, max_steps=2)


def dfpo_labels_of_a_run(**overrides: object) -> dict[str, int]:
    """``dfpo/`` label -> calls, over a tiny Min-Replace run's training under the profiler."""
    trainer = tiny_trainer(**{**SEQUENCE, **overrides})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train()
    calls: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("dfpo/"):
            calls[event.name] = calls.get(event.name, 0) + 1
    return calls


def test_a_run_shows_every_label_and_no_other() -> None:
    """Two runs reach every part: the default layout with both mechanism meters on, and the pre-pass layout."""
    metered = dfpo_labels_of_a_run(log_energy_buckets=2)
    pre_pass = dfpo_labels_of_a_run(group_layout="pre_pass", per_device_train_batch_size=2)  # groups straddle
    assert set(metered) | set(pre_pass) == set(PROFILE_LABELS)
    # 2 optimizer steps of 2 micro-steps: the objective and each meter once a micro-step, the pre-pass once an
    # optimizer step
    assert metered["dfpo/micro_step_objective"] == metered["dfpo/compute_loss"] == 4
    assert metered["dfpo/watch_token_coefficients.backward_hook"] == metered["dfpo/watch_gradient_energy"] == 4
    assert pre_pass["dfpo/pre_pass"] == 2 and "dfpo/pre_pass" not in metered


def test_without_a_profiler_a_label_is_a_shared_nullcontext() -> None:
    assert not torch.autograd._profiler_enabled()
    off = profiled("dfpo/compute_loss")
    assert isinstance(off, nullcontext) and off is profiled("dfpo/log")


def test_a_label_outside_the_list_is_refused() -> None:
    with pytest.raises(ValueError, match="not in PROFILE_LABELS"):
        profiled("dfpo/somewhere_else")
