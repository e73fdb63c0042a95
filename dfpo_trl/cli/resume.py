"""What ``dfpo-train`` does for checkpoints and resuming beyond the trainer (docs/source/guides/cli.md, "Resume").

``--save_steps N`` on the command line means "save every N steps": with a recipe whose ``save_strategy`` is
``"no"`` (the CPU recipe's) it used to write nothing, silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import logger
from .args import RecipeError

__all__ = ["imply_save_strategy", "save_strategy_problem"]


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
