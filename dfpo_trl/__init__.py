"""dfpo-trl: token-gradient-cancellation-aware RL objectives (DFPO, GRPO-fix, DelTA) for Hugging Face TRL.

The public names are imported on first use (PEP 562), so that ``dfpo-train --help`` and its input errors, which
import ``dfpo_trl.cli`` and so this package, answer in a fraction of a second instead of the seconds torch, TRL and
transformers take to import (docs/source/guides/cli.md). The first public name taken from here (``from dfpo_trl import
DFPOConfig``) imports the trainer, and with it the checks of every TRL touch point (``trl_hooks/compat.py``).

The package is two parts. The library: ``precision`` (the compute dtype), ``profiling`` (the profiler labels),
``rewards`` (the reward wrapper that names a failing completion); ``transforms`` (the in-group transforms and their
registry); ``config`` (``DFPOConfig``, each option's values, every rule a value must meet, the method a config trains
with); ``objectives`` (the objective as pure math) and ``trl_hooks`` (the few places DFPO touches TRL); ``metrics`` and
``groups``; ``delta`` (DelTA's weights, which read the groups' ids and log metrics); ``trainer`` wires them into TRL;
``testing`` (the tiny builders and the trainer's observers, public). The program, ``cli`` (``dfpo-train``, its tasks,
recipes and outputs), sits on top and the library imports nothing from it (tests/test_layering.py checks both the
layers and that no two packages import each other, even through others).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._quiet import silence_library_deprecations

if TYPE_CHECKING:
    from .config import DFPOConfig
    from .rewards import RewardFunc, safe_reward
    from .trainer import DFPOTrainer
    from .transforms import get_transform, register_transform, registered_transforms, unregister_transform
    from .trl_hooks.errors import TRLCompatibilityError, UntestedTRLWarning

silence_library_deprecations()

# Each public name, the module that defines it and its name there.
_PUBLIC = {
    "DFPOConfig": (".config", "DFPOConfig"),
    "DFPOTrainer": (".trainer", "DFPOTrainer"),
    "TRLCompatibilityError": (".trl_hooks.errors", "TRLCompatibilityError"),
    "UntestedTRLWarning": (".trl_hooks.errors", "UntestedTRLWarning"),
    "register_transform": (".transforms", "register_transform"),
    "registered_transforms": (".transforms", "registered_transforms"),
    "unregister_transform": (".transforms", "unregister_transform"),
    "get_transform": (".transforms", "get_transform"),
    "RewardFunc": (".rewards", "RewardFunc"),
    "safe_reward": (".rewards", "safe_reward"),
}

# The program's names that were importable from here before 0.1.0 split the library from the program: they still
# resolve, with a FutureWarning naming their new home (docs: changelog.md), and leave in a later release.
_MOVED_TO_CLI = (
    "register_task", "get_task", "register_reward", "get_reward", "Task", "EquivalentFormsTask", "TwoFormsTask",
    "TwoFormsReward", "embedded_model_path", "HeldoutAccuracyCallback", "plot_metrics", "dfpo_train", "parse_recipe",
)

# The stable public API of the library (docs: reference/api.md): every other name in dfpo_trl's modules is internal,
# except the lists of dfpo_trl.testing, dfpo_trl.testing.measures and the program's, dfpo_trl.cli.
__all__ = [
    "DFPOConfig",
    "DFPOTrainer",
    "TRLCompatibilityError",
    "UntestedTRLWarning",
    "register_transform",
    "registered_transforms",
    "unregister_transform",
    "get_transform",
    "RewardFunc",
    "safe_reward",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first read, and keep the name here."""
    if name in _MOVED_TO_CLI:
        warnings.warn(
            f"dfpo_trl.{name} moved to the program's package: import it as `from dfpo_trl.cli import {name}` "
            "(the library's root keeps only the library's names since 0.1.0)",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(".cli", __name__), name)
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    if module != ".trl_hooks.errors":  # the error and warning stay importable under any TRL, to catch them
        importlib.import_module(".trainer", __name__)  # checks TRL's touch points: an incompatible TRL stops here
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
