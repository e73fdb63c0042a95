"""What ``dfpo-train`` does for checkpoints and resuming beyond the trainer (docs/source/guides/cli.md, "Resume").

``--save_steps N`` on the command line means "save every N steps": with a recipe whose ``save_strategy`` is
``"no"`` (the CPU recipe's) it used to write nothing, silently. A resumed run takes the save settings (and
``logging_steps``, ``eval_steps``) of the run it continues, from the checkpoint, unless its command line gives them
again: the same command resumed from a checkpoint saved nothing more, and transformers warned in raw lines that
its values did not match the checkpoint's. Standard library only (the fast checks read it before torch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import logger
from .args import RecipeError

__all__ = ["RUN_RECORD", "checkpoint_settings", "imply_save_strategy", "read_run_record", "save_strategy_problem"]

#: What dfpo-train writes into each checkpoint beside trainer_state.json (cli/callbacks.py's CheckpointRecord).
RUN_RECORD = "dfpo_run.json"
# The fields transformers compares with the checkpoint's trainer_state.json on resume (trainer_utils'
# compare_trainer_and_checkpoint_args), which a resumed run takes from there unless its command line gives them.
CHECKPOINT_STEPS = ("save_steps", "logging_steps", "eval_steps")


def _flag_value(parser: Any, name: str, args: Sequence[str]) -> str | None:
    """The value of field ``name`` on the command line ``args`` (``--name v`` or ``--name=v``), None when absent."""
    flags = {o for a in parser._actions if a.dest == name for o in a.option_strings}
    for i, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in flags:
            return value if equals else (args[i + 1] if i + 1 < len(args) else "")
    return None


def imply_save_strategy(parser: Any, args: Sequence[str]) -> list[str]:
    """``args`` with ``--save_strategy steps`` added when the command line sets ``save_steps`` but not
    ``save_strategy`` (the recipe's ``save_strategy`` gives way); a command line setting both, the strategy to
    ``no``, is refused: it would save nothing."""
    steps = _flag_value(parser, "save_steps", args)
    if steps is None:
        return list(args)
    strategy = _flag_value(parser, "save_strategy", args)
    if strategy is None:
        logger.info("--save_steps %s on the command line: a checkpoint every %s steps (save_strategy: steps)",
                    steps, steps)
        return [*args, "--save_strategy", "steps"]
    problem = save_strategy_problem(steps, strategy)
    if problem is not None:
        raise RecipeError(problem)
    return list(args)


def save_strategy_problem(steps: str, strategy: str) -> str | None:
    """``--save_steps`` and ``--save_strategy no`` both on the command line: it would save nothing (the fast checks
    before torch say it in these words too)."""
    if strategy.strip("'\"").lower() != "no":
        return None
    return (f"--save_steps {steps} with --save_strategy {strategy} on the command line saves no checkpoint: drop "
            "--save_strategy (--save_steps alone saves every that many steps).")


def read_run_record(checkpoint: str | Path) -> dict[str, Any]:
    """The checkpoint's ``dfpo_run.json`` ({} for a checkpoint without one, written by another trainer)."""
    try:
        record = json.loads((Path(checkpoint) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def checkpoint_settings(checkpoint: str | Path) -> dict[str, Any]:
    """The settings a resumed run takes from ``checkpoint`` unless its command line gives them: ``save_steps``,
    ``logging_steps`` and ``eval_steps`` as its ``trainer_state.json`` holds them (what transformers compares), and
    the save strategy from dfpo-train's record ("steps" for a checkpoint without one: it was saved, so the run saved;
    by steps, as nearly every run does)."""
    try:
        state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        state = {}
    found: dict[str, Any] = {"save_strategy": read_run_record(checkpoint).get("save_strategy", "steps")}
    found.update({name: state[name] for name in CHECKPOINT_STEPS if isinstance(state.get(name), (int, float))})
    return found


def resumed_settings(args: Any, checkpoint: str, given: Callable[[str], bool]) -> tuple[dict[str, Any], list[str]]:
    """The checkpoint's save strategy and steps (:func:`checkpoint_settings`) that ``args`` should take, where the
    command line does not give them and they differ, and the ones the command line changes (``--name value (the
    checkpoint's run: v)``), each said in one line by the caller. A recipe's value does not count as given: the CPU
    recipe's ``save_strategy: "no"`` would save nothing more."""
    taken, changed = {}, []
    for name, value in checkpoint_settings(checkpoint).items():
        current = getattr(args, name, None)
        current = getattr(current, "value", current)
        if current is None or str(current) == str(value):
            continue
        if given(name):
            changed.append(f"--{name} {current} (the checkpoint's run: {value})")
        else:
            taken[name] = value
    return taken, changed

