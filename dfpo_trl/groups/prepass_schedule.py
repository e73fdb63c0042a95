"""The pre-pass's schedule as plain integers: when it runs, which micro-batches it fills, when θ = θ_old, and how
many rows it forwards (docs/source/concepts/layouts.md, "The pre-pass and its cost").

Pure arithmetic on TRL's micro-step counter and the run's batch sizes, kept apart from
:class:`~dfpo_trl.groups.prepass.PrePass` (which applies it to tensors) so that the start-up line
(:func:`~dfpo_trl.groups.choice.describe_layout`) reads the same closed form the pre-pass is tested against, without
a trainer or a tensor.
"""

from __future__ import annotations

__all__ = ["at_old_policy", "off_policy", "pre_pass_rows", "starts_optimizer_step", "step_window"]


def starts_optimizer_step(step: int, accumulation: int) -> bool:
    """Whether TRL's micro-step ``step`` is the first of an optimizer step: the pre-pass runs there, once, because
    every micro-step of the step must read s̄ at the same θ (the one before the step's update)."""
    return step % accumulation == 0


def step_window(step: int, steps_per_generation: int, accumulation: int) -> list[int]:
    """The buffered micro-batches (indices into TRL's rollout buffer, in training order) of the optimizer step that
    starts at micro-step ``step``: TRL serves micro-batch ``step % steps_per_generation`` at each micro-step."""
    start = step % steps_per_generation
    return [(start + j) % steps_per_generation for j in range(accumulation)]


def at_old_policy(step: int, generate_every: int) -> bool:
    """Whether micro-step ``step`` is the first of a rollout: no optimizer step has run since it was generated, so
    θ = θ_old and the rollout's old log-probs are the current ones (the pre-pass may skip its forward)."""
    return step % generate_every == 0


def off_policy(step: int, generate_every: int, accumulation: int) -> bool:
    """Whether micro-step ``step`` trains on a rollout the policy has taken an optimizer step since (the same rule
    as ``trl_hooks.compat.off_policy_step``, from the run's shape instead of the trainer): its metrics are also
    logged under the ``*_off_policy`` names."""
    return step % generate_every >= accumulation


def pre_pass_rows(
    per_device: int, accumulation: int, steps_per_generation: int, group_size: int, iterations: int = 1
) -> list[int]:
    """Rows the pre-pass forwards on one process at each optimizer step of a rollout (docs/source/concepts/layouts.md,
    "The pre-pass and its cost"), for a process that holds whole groups (per-device batch × steps_per_generation a
    multiple of G). The layout lays each group's rows consecutively, so the step that trains rows [kR, (k+1)R)
    (R = accumulation × per-device batch) forwards every row of the groups those rows touch: G·⌈R/G⌉ when R is a
    multiple of G or G of R, at most G more otherwise. The first step after a rollout forwards none (θ = θ_old);
    with ``iterations`` > 1 the buffer is trained again from its first row.

    Returns:
        One count per optimizer step of the rollout, in order.
    """
    trained, local = accumulation * per_device, per_device * steps_per_generation
    per_pass = steps_per_generation // accumulation  # optimizer steps per pass over the buffer
    rows = []
    for k in range(per_pass * iterations):
        if k == 0:
            rows.append(0)
            continue
        start = (k % per_pass) * trained
        touched = (start + trained - 1) // group_size - start // group_size + 1
        rows.append(min(touched * group_size, local))
    return rows
