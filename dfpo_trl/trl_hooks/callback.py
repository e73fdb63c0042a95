"""``DFPOCallback``: transformers' ``TrainerCallback`` with DFPO's two events, so that code outside the trainer (a test,
a benchmark, a user's probe) reads what each micro-step computed without replacing any of the trainer's names.

Pass one in ``callbacks=[...]`` or to ``trainer.add_callback``, as any TRL callback; ``DFPOTrainer`` calls
``on_pre_pass`` after each pre-pass and ``on_micro_step`` after each loss micro-step's objective, with the values it
goes on to use. The values are the trainer's own tensors: read them, never write them (the run would change).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

if TYPE_CHECKING:
    from ..groups.prepass import PrePassValues
    from ..objectives.step import StepObjective


class DFPOCallback(TrainerCallback):
    """A ``TrainerCallback`` that also receives DFPO's values; override the events you need (each is a no-op)."""

    def on_pre_pass(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        *,
        values: PrePassValues,
        **kwargs: Any,
    ) -> None:
        """After each pre-pass (layout ``pre_pass``, first micro-step of an optimizer step): its weights and values."""

    def on_micro_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        *,
        step: StepObjective,
        **kwargs: Any,
    ) -> None:
        """After each loss micro-step's objective, train or eval: TRL's loss inputs and the objective's values."""
