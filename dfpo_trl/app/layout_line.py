"""The start-up line that says which group layout the trainer chose (docs/layouts.md), why, and what it costs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from ..config import DFPOConfig
from ..trainer import LAYOUT_CROSS_PROCESS, LAYOUT_GROUP_GRANULAR, LAYOUT_PRE_PASS, LAYOUT_REDISTRIBUTED

__all__ = ["describe_layout", "trainer_layout_record_dropped"]


class _DropLayoutRecord(logging.Filter):
    """Drops the trainer's "DFPO group layout: NAME" record while :func:`describe_layout` prints a fuller one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("DFPO group layout:")


def describe_layout(layout: str, args: DFPOConfig, processes: int) -> str:
    """One start-up line: the group layout the trainer chose (docs/layouts.md), why, and what it costs."""
    b, G = args.per_device_train_batch_size, args.num_generations
    A, S = args.gradient_accumulation_steps, args.steps_per_generation
    head = f"DFPO group layout: {layout}"
    if layout == LAYOUT_GROUP_GRANULAR:
        return f"{head} (per_device_train_batch_size {b} holds whole groups of num_generations {G}): no extra cost"
    if layout == LAYOUT_CROSS_PROCESS:
        return (f"{head} (groups straddle the {processes} processes; steps_per_generation 1): one all-gather of 6 "
                "floats per sequence per micro-step, no extra forward")
    if layout == LAYOUT_REDISTRIBUTED:
        return (f"{head} (groups straddle micro-steps; {b} rows x {processes} processes is a multiple of G = {G}): "
                "one all-to-all of the rollout per rollout and an all-gather of 6 floats per sequence per "
                "micro-step, no extra forward")
    if layout == LAYOUT_PRE_PASS:
        why = f"per_device_train_batch_size {b} is not a multiple of num_generations {G}"
        fix = f"a per_device_train_batch_size that is a multiple of {G} makes the layout free (group_granular)"
        steps = S // A  # optimizer steps per rollout; the first of each runs at θ_old and needs no pre-pass
        if steps <= 1:
            return f"{head} ({why}): no extra forward, every optimizer step is the first of its rollout; {fix}"
        trained = A * b  # rows an optimizer step trains on, per process
        forwarded = min(b * S, trained * G)  # at most: every local member of every group the step touches
        low, high = 100 / 3, 100 * forwarded / (3 * trained)  # a no-grad forward ~ 1/3 of forward + backward
        gather = " and an all-gather of 6 floats per sequence" if processes > 1 else ""
        return (
            f"{head} ({why}): {steps - 1} of every {steps} optimizer steps add a no-grad forward over {trained}"
            f"-{forwarded} rows per process{gather}, about +{low:.0f}% to +{high:.0f}% of their compute "
            f"(docs/layouts.md, the pre-pass and its cost); {fix}"
        )
    return (f"{head} (no in-group transform active: TRL's batch order): no extra cost; group metrics only on "
            "micro-batches that hold whole groups (group_granular_batches: true gives them every step)")


@contextmanager
def trainer_layout_record_dropped() -> Iterator[None]:
    """While the trainer is built, drop its "DFPO group layout: NAME" record: :func:`describe_layout`'s line, logged
    after it, says the name and why it was chosen and what it costs."""
    trainer_log = logging.getLogger("dfpo_trl.trainer")
    layout_name_only = _DropLayoutRecord()
    trainer_log.addFilter(layout_name_only)
    try:
        yield
    finally:
        trainer_log.removeFilter(layout_name_only)
