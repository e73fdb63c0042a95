"""TRL's warning for completions that no reward function scores, in one line and with how many there were.

TRL 1.16's ``_calculate_rewards`` warns when every reward function returned None for a completion ("All reward
functions returned None for the following kwargs: ..."), printing that completion's every column over several
lines, and trains on: such a completion's advantage is 0, so a rollout where none is scored teaches nothing, and
the run goes on to the next (a multi-task run meets rollouts no reward applies to). ``DFPOTrainer`` does the same
(docs/source/concepts/decisions.md, "A rollout no reward applies to"): TRL's record is held while TRL scores the
rollout, then given back to TRL's logger as one line, the row shortened, with the count of unscored completions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["NO_REWARD_WARNING", "TRL_LOGGER", "held_no_reward_warning", "one_line_no_reward_warning"]

TRL_LOGGER = "trl.trainer.grpo_trainer"
NO_REWARD_WARNING = "All reward functions returned None for the following kwargs:"  # TRL's words
ROW_CHARACTERS = 160  # how much of the unscored row's columns the line shows


class _Hold(logging.Filter):
    """Keeps TRL's no-reward record back (the others pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if NO_REWARD_WARNING in record.getMessage():  # accelerate's logger may head it with "[RANK 0] "
            self.held.append(record)
            return False
        return True


@contextmanager
def held_no_reward_warning() -> Iterator[list[logging.LogRecord]]:
    """Within the block, TRL's no-reward warning is held in the list yielded instead of printed."""
    hold = _Hold()
    trl_logger = logging.getLogger(TRL_LOGGER)
    trl_logger.addFilter(hold)
    try:
        yield hold.held
    finally:
        trl_logger.removeFilter(hold)


def one_line_no_reward_warning(record: logging.LogRecord, unscored: int, total: int) -> None:
    """Give TRL's held record back to TRL's logger as one line: TRL's words, the row's columns shortened, and how
    many of the rollout's ``total`` completions no reward scored."""
    text = " ".join(record.getMessage().split())
    head, _, body = text.partition(NO_REWARD_WARNING)
    row, sep, rest = body.partition(" Please ensure")
    row = row if len(row) <= ROW_CHARACTERS else row[: ROW_CHARACTERS - 3] + "..."
    if unscored >= total:
        what = (f"none of the rollout's {total} completions has a reward: their advantages are 0 and nothing is "
                "learned from this rollout; training goes on, as in TRL")
    else:
        what = f"{unscored} of the rollout's {total} completions have no reward (advantage 0); the others train"
    record.msg = f"{head}{NO_REWARD_WARNING} {row.strip()} ({what}).{(' Please ensure' + rest) if sep else ''}"
    record.args = None
    logging.getLogger(TRL_LOGGER).handle(record)
