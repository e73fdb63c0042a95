"""objectives/step.py: one function, ``objective_values``, assembles the objective for the loss and the pre-pass."""

from __future__ import annotations

from typing import Any

import pytest
from tiny import make_trainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.testing import DFPOCallback

pytestmark = pytest.mark.usefixtures("one_thread")

# the users'-size ordering of dfpo_bench.bit_identity: a micro-batch smaller than a group, so the pre-pass layout
PRE_PASS = dict(importance_sampling_level="sequence", epsilon=3e-2, epsilon_high=4e-2, group_transform="min_replace",
                per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=4,
                num_generations=4, learning_rate=5e-2, log_mechanism_metrics=True)


def test_the_pre_pass_and_every_loss_micro_step_call_the_one_objective_function(tmp_path):
    """In a real ``train()`` of the pre-pass layout, the pre-pass (groups/prepass.py) and each loss micro-step (through
    ``micro_step_objective``) get their values from the same function, ``objectives.step.objective_values``: both
    callers name the one function object, and a :class:`~dfpo_trl.testing.DFPOCallback` sees its return values once
    per optimizer step (the pre-pass) and once per micro-step, the pre-pass first."""
    import dfpo_trl.groups.prepass as prepass
    import dfpo_trl.objectives.step as step

    assert prepass.objective_values is step.objective_values

    class Events(DFPOCallback):
        def __init__(self) -> None:
            self.calls: list[str] = []
            self.pre_pass_values: list[Any] = []
            self.micro_step_values: list[Any] = []

        def on_pre_pass(self, args: Any, state: Any, control: Any, *, values: Any, **kwargs: Any) -> None:
            self.calls.append("pre_pass")
            self.pre_pass_values.append(values.objective)

        def on_micro_step(self, args: Any, state: Any, control: Any, *, step: Any, **kwargs: Any) -> None:
            self.calls.append("micro_step")
            self.micro_step_values.append(step.values)

    trainer = make_trainer(DFPOTrainer, DFPOConfig, output_dir=str(tmp_path), max_steps=3, **PRE_PASS)
    events = Events()
    trainer.add_callback(events)
    assert trainer.group_layout == "pre_pass"
    trainer.train()
    calls = events.calls
    assert calls.count("pre_pass") == 3  # one per optimizer step
    assert calls.count("micro_step") == 3 * 2  # one per loss micro-step
    assert calls[:3] == ["pre_pass", "micro_step", "micro_step"]  # the pre-pass before its optimizer step's losses
    assert all(isinstance(values, step.ObjectiveValues) for values in events.pre_pass_values + events.micro_step_values)
    # its values hold every member of the step's groups, transformed: what the group metrics read (logged once, there)
    assert all(values.grouped is not None and values.row_ids.numel() % 4 == 0 for values in events.pre_pass_values)
    assert any("asym/before" in row for row in trainer.state.log_history)
