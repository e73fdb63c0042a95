"""RunShape: the run's shape as the group layout, the pre-pass and DelTA read it, one frozen record.

Built once, by :func:`run_shape`, from TRL's settings and the accelerator (``DFPOTrainer.__init__``), so that no part
of ``groups/`` or ``delta/`` holds the trainer: what changes during a run (the optimizer step, θ) is passed to each
call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..trl_hooks.compat import generate_every

__all__ = ["RunShape", "run_shape"]


@dataclass(frozen=True)
class RunShape:
    """The numbers that fix how a rollout is laid out over micro-steps and processes
    (docs/source/concepts/layouts.md)."""

    num_generations: int  # G of training rollouts
    num_generations_eval: int  # G of evaluation rollouts
    per_device_batch: int  # per_device_train_batch_size: rows of one micro-batch
    steps_per_generation: int  # micro-batches of one rollout
    gradient_accumulation_steps: int  # micro-steps of one optimizer step
    generate_every: int  # micro-steps between two rollouts, as TRL counts them (trl_hooks/compat.generate_every)
    seed: int  # DFPO's per-rollout random draws (groups/ids.rollout_generator)
    process_index: int
    num_processes: int
    prepass_batch_size: int  # rows of one pre-pass forward

    def group_size(self, mode: str) -> int:
        """G of the batches of ``mode``: ``num_generations`` in training, ``num_generations_eval`` else."""
        return self.num_generations if mode == "train" else self.num_generations_eval


def run_shape(trainer: Any) -> RunShape:
    """The run's shape, read once from a built TRL trainer: its G, its batch sizes and schedule, its accelerator."""
    args, accelerator = trainer.args, trainer.accelerator
    return RunShape(
        num_generations=trainer.num_generations, num_generations_eval=trainer.num_generations_eval,
        per_device_batch=args.per_device_train_batch_size, steps_per_generation=args.steps_per_generation,
        gradient_accumulation_steps=args.gradient_accumulation_steps, generate_every=generate_every(trainer),
        seed=args.seed, process_index=accelerator.process_index, num_processes=accelerator.num_processes,
        prepass_batch_size=args.prepass_batch_size or 4 * args.per_device_train_batch_size,
    )
