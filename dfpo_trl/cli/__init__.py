"""The ``dfpo-train`` program: a recipe in, a trained model, its summary and its figure out (``main.py`` runs it),
and its public names: the tasks and rewards a recipe names, the offline default model, the held-out evaluation,
the figure and the program itself in Python.

The library (``dfpo_trl``: the trainer, the config, the objectives and their metrics) imports nothing from here
(tests/test_layering.py checks it); this package sits on top of it. Its public names are imported on first use
(PEP 562), so that ``dfpo-train --help`` and its input errors, which import this package, answer without torch.

Its modules, in the order a run uses them: ``main`` with ``precheck``, ``paths``, ``files`` and the stored field
table (``fields``, ``field_table.json``), ``help`` and ``signals`` (``--help`` and the checks that need no torch, then
SIGTERM handled like Ctrl-C); ``train`` (the run, once those checks passed); ``args`` (the script arguments),
``plugins`` (modules imported before the recipe is checked), ``parser`` (recipe and flags into dataclasses),
``model`` (which model to load), ``data`` (task, rewards, datasets), ``tasks`` (the tasks and their rewards),
``evaluation``, ``callbacks`` and ``progress`` (what a run measures and shows while it trains), ``outputs`` and
``plotting`` (what it writes), ``resume`` (checkpoints and resuming beyond the trainer), ``embedded`` (the offline
default model).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .embedded import embedded_model_path
    from .evaluation import HeldoutAccuracyCallback, greedy_accuracy
    from .main import main as dfpo_train
    from .parser import parse_recipe
    from .plotting import plot_metrics
    from .tasks import (
        EquivalentFormsTask,
        Task,
        TwoFormsReward,
        TwoFormsTask,
        get_reward,
        get_task,
        register_reward,
        register_task,
    )

# The program's log channel: its name heads every line dfpo-train logs ("INFO dfpo_trl.cli: ...").
logger = logging.getLogger("dfpo_trl.cli")

# Each public name of the program, the module that defines it and its name there.
_PUBLIC = {
    "register_task": (".tasks", "register_task"),
    "get_task": (".tasks", "get_task"),
    "register_reward": (".tasks", "register_reward"),
    "get_reward": (".tasks", "get_reward"),
    "Task": (".tasks", "Task"),
    "EquivalentFormsTask": (".tasks", "EquivalentFormsTask"),
    "TwoFormsTask": (".tasks", "TwoFormsTask"),
    "TwoFormsReward": (".tasks", "TwoFormsReward"),
    "embedded_model_path": (".embedded", "embedded_model_path"),
    "HeldoutAccuracyCallback": (".evaluation", "HeldoutAccuracyCallback"),
    "greedy_accuracy": (".evaluation", "greedy_accuracy"),
    "plot_metrics": (".plotting", "plot_metrics"),
    "dfpo_train": (".main", "main"),
    "parse_recipe": (".parser", "parse_recipe"),
}

# The program's stable public API (docs: reference/api.md); every other name in dfpo_trl.cli's modules is internal.
__all__ = [
    "register_task",
    "get_task",
    "register_reward",
    "get_reward",
    "Task",
    "EquivalentFormsTask",
    "TwoFormsTask",
    "TwoFormsReward",
    "embedded_model_path",
    "HeldoutAccuracyCallback",
    "greedy_accuracy",
    "plot_metrics",
    "dfpo_train",
    "parse_recipe",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first read, and keep the name here."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
