"""Tasks (a prompt dataset plus the TRL reward functions that score it) and reward functions, reachable by name.

Kept apart from the trainer so that users can add their own: anything with a ``name``, a list of ``reward_funcs``
and a ``build_dataset(split, n, seed)`` method is a :class:`Task`; :func:`register_task` makes a factory of one
reachable by name (:func:`get_task`) from the CLI and recipes, and :func:`register_reward` does the same for a
reward function (:func:`get_reward`, the recipe's ``reward_funcs``). Both also accept an import path
``package.module:name``.

Where what lives: the protocols and the splits in :mod:`.base`, the registries in :mod:`.registry`, the built-in
tasks in :mod:`.arithmetic` and :mod:`.math`; the failure-naming wrapper is the library's (:mod:`dfpo_trl.rewards`).
This module registers the built-ins, in the order ``dfpo-train --help`` lists them.
"""

from __future__ import annotations

import importlib

from ...rewards import SafeReward, safe_reward
from .arithmetic import (
    SUM_SENTENCE_LEAD,
    ArithmeticReward,
    ArithmeticTask,
    SumSentenceReward,
    SumSentenceTask,
    TwoFormsReward,
    TwoFormsTask,
    last_number,
)
from .base import HELDOUT_SPLIT, TRAIN_SPLIT, EquivalentFormsTask, RewardFunc, Task, completion_text
from .math import MathTask, MathVerifyReward
from .registry import REWARDS, TASKS, RewardFactory, get_reward, get_task, register_reward, register_task

__all__ = [
    "HELDOUT_SPLIT",
    "REWARDS",
    "SUM_SENTENCE_LEAD",
    "TASKS",
    "TRAIN_SPLIT",
    "ArithmeticReward",
    "ArithmeticTask",
    "EquivalentFormsTask",
    "MathTask",
    "MathVerifyReward",
    "RewardFunc",
    "SafeReward",
    "SumSentenceReward",
    "SumSentenceTask",
    "Task",
    "TwoFormsReward",
    "TwoFormsTask",
    "completion_text",
    "get_reward",
    "get_task",
    "last_number",
    "register_reward",
    "register_task",
    "safe_reward",
]

# TRL's named rewards (trl.rewards), imported when a run first asks for one.
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")


def _trl_reward(name: str) -> RewardFactory:
    return lambda: getattr(importlib.import_module("trl.rewards"), name)


register_task("arithmetic", ArithmeticTask)
register_task("math", MathTask)
register_task("sum_sentence", SumSentenceTask)
register_task("two_forms", TwoFormsTask)

register_reward("arithmetic_correct", ArithmeticReward)
register_reward("math_verify_correct", MathVerifyReward)
for _name in TRL_REWARDS:
    register_reward(_name, _trl_reward(_name))
