"""The pre-pass's integer rules (``groups/prepass_schedule.py``) and its one owner: the trainer reaches the pre-pass
through one call per micro-step, and the start-up line counts rows with the same function the pre-pass is tested
against (docs/source/concepts/layouts.md, "The pre-pass and its cost")."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from dfpo_trl.groups import choice
from dfpo_trl.groups.prepass_schedule import (
    at_old_policy,
    off_policy,
    pre_pass_rows,
    starts_optimizer_step,
    step_window,
)
from dfpo_trl.trl_hooks.compat import off_policy_step

TRAINER = Path(__file__).resolve().parents[2] / "dfpo_trl" / "trainer.py"


def test_runs_at_the_first_micro_step_of_each_optimizer_step():
    assert [s for s in range(12) if starts_optimizer_step(s, 4)] == [0, 4, 8]


def test_the_window_is_the_step_micro_batches_in_training_order():
    # steps_per_generation 6, accumulation 3: micro-step 9 (second pass over the buffer) trains micro-batches 3, 4, 5
    assert step_window(0, 6, 3) == [0, 1, 2]
    assert step_window(9, 6, 3) == [3, 4, 5]


def test_old_policy_only_at_the_first_micro_step_of_a_rollout():
    assert [s for s in range(16) if at_old_policy(s, 8)] == [0, 8]


def test_off_policy_is_trl_hooks_rule_from_the_shape():
    """The pre-pass logs its ``*_off_policy`` metrics by the same rule the trainer's loss uses."""
    for steps_per_generation, iterations, accumulation in [(8, 1, 2), (4, 2, 2), (6, 1, 3)]:
        every = steps_per_generation * iterations
        for step in range(3 * every):
            trainer = SimpleNamespace(_step=step, num_iterations=iterations, args=SimpleNamespace(
                steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation))
            assert off_policy(step, every, accumulation) == off_policy_step(trainer)


def test_the_start_up_line_counts_with_the_schedule():
    assert choice.pre_pass_rows is pre_pass_rows


def test_the_trainer_reaches_the_pre_pass_through_one_call():
    """Besides building it and testing whether there is one, ``trainer.py`` uses ``self.pre_pass`` only to call
    ``before_micro_step``: which rows, the skip, the forward, the attach and the metrics are the pre-pass's."""
    tree = ast.parse(TRAINER.read_text(encoding="utf-8"))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "pre_pass"}
    assert used == {"before_micro_step"}
