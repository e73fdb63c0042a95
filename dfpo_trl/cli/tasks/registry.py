"""The task and reward registries, one style: register by name, get by name or by import path ``module:name``.

Tasks: ``register_task``/``get_task``; rewards: ``register_reward``/``get_reward``; an import path
``package.module:name`` is accepted wherever a name is.

A task is registered as a factory ``factory(**options) -> Task``; a reward as a factory ``factory() -> reward
function``, so that a reward whose library is slow to import (TRL's) is imported only when a run asks for it. A
name that is neither registered nor an import path is a ``ValueError`` listing the registered names and the
closest one.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ...config.rules import unknown_name
from ...rewards import SafeReward, safe_reward
from .base import RewardFunc, Task

TaskFactory = Callable[..., Task]
RewardFactory = Callable[[], RewardFunc]

TASKS: dict[str, TaskFactory] = {}
REWARDS: dict[str, RewardFactory] = {}


def register_task(name: str, factory: TaskFactory) -> None:
    """Make ``get_task(name, **options)`` build ``factory(**options)``."""
    TASKS[name] = factory


def register_reward(name: str, factory: RewardFactory) -> None:
    """Make ``get_reward(name)`` return ``factory()`` (wrapped by :func:`safe_reward`, logged by TRL as ``name``)."""
    REWARDS[name] = factory


def get_task(name: str, **options: Any) -> Task:
    """The task registered as ``name`` built with ``options`` (e.g. ``dataset=`` for ``math``), or what the import
    path ``package.module:factory`` names: a task object as it is, any other callable called with ``options``."""
    if name in TASKS:
        return TASKS[name](**options)
    if is_import_path(name):
        factory = import_object(name)
        # A task class also has build_dataset: it is a factory; an instance with build_dataset is the task itself.
        ready = hasattr(factory, "build_dataset") and not isinstance(factory, type)
        return factory if ready or not callable(factory) else factory(**options)
    raise ValueError(_unknown(f"unknown task {name!r}; known tasks", name, TASKS, "module:factory"))


def get_reward(name: str) -> SafeReward:
    """The reward function registered as ``name``, or the one the import path ``package.module:function`` names,
    wrapped so that a failure names the function and the completion index."""
    if name in REWARDS:
        return safe_reward(REWARDS[name](), name)
    if is_import_path(name):
        func = import_object(name)
        if not callable(func):
            raise ValueError(f"reward function {name!r} is not callable")
        return safe_reward(func)
    raise ValueError(_unknown(f"unknown reward function {name!r}; known", name, REWARDS, "module:function"))


def is_import_path(name: str) -> bool:
    """Whether ``name`` is written as an import path (``package.module:name`` or ``package.module.name``)."""
    return ":" in name or "." in name


def import_object(path: str) -> Any:
    """``package.module:name`` or ``package.module.name`` → the object; the working directory is importable."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path; expected 'package.module:name'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no {attr!r} (from {path!r})") from None


def _unknown(head: str, name: str, registry: dict[str, Any], path_form: str) -> str:
    return unknown_name(head, name, registry, path_form)
