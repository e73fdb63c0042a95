"""RunShape: the run's shape as the group layout, the pre-pass and DelTA read it, one frozen record.

Built once by the trainer from TRL's settings and the accelerator (``DFPOTrainer.__init__``), so that no part of
``groups/`` or ``delta/`` holds the trainer: what changes during a run (the optimizer step, θ) is passed to each call.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunShape"]


@dataclass(frozen=True)
class RunShape:
    """The numbers that fix how a rollout is laid out over micro-steps and processes (docs/layouts.md)."""

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
