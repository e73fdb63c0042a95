"""dfpo-trl: token-gradient-cancellation-aware RL objectives (DFPO, GRPO-fix, DelTA) for Hugging Face TRL.

The public names are imported on first use (PEP 562), so that ``dfpo-train --help`` and its input errors, which
import ``dfpo_trl.app`` and so this package, answer in a fraction of a second instead of the seconds torch, TRL and
transformers take to import (docs/source/guides/cli.md). The first public name taken from here (``from dfpo_trl import
DFPOConfig``) imports the trainer, and with it the checks of every TRL touch point (``trl_hooks/compat.py``).

The import graph's layers, lowest first (tests/test_layering.py checks them and that no two packages import each
other, even through others): ``precision`` (the compute dtype) and ``profiling`` (the profiler labels);
``transforms`` (the in-group transforms and their registry); ``config`` (``DFPOConfig``, each option's values, every
rule a value must meet, the method a config trains with); ``objectives`` (the objective as pure math) and
``trl_hooks`` (the few places DFPO touches TRL); ``metrics``, ``groups`` and ``tasks``; ``delta`` (DelTA's weights,
which read the groups' ids and log metrics); ``trainer`` wires them into TRL; ``testing`` (the tiny builders and the
trainer's observers, public) and ``app`` (the ``dfpo-train`` program) sit on top (docs/source/concepts/architecture.md
has the map).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._quiet import silence_library_deprecations

if TYPE_CHECKING:
    from .app.embedded import embedded_model_path
    from .app.evaluation import HeldoutAccuracyCallback
    from .app.main import main as dfpo_train
    from .app.parser import parse_recipe
    from .app.plotting import plot_metrics
    from .config import DFPOConfig
    from .tasks import (
        EquivalentFormsTask,
        RewardFunc,
        Task,
        TwoFormsReward,
        TwoFormsTask,
        get_reward,
        get_task,
        register_reward,
        register_task,
        safe_reward,
    )
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
    "register_task": (".tasks", "register_task"),
    "get_task": (".tasks", "get_task"),
    "register_reward": (".tasks", "register_reward"),
    "get_reward": (".tasks", "get_reward"),
    "Task": (".tasks", "Task"),
    "EquivalentFormsTask": (".tasks", "EquivalentFormsTask"),
    "RewardFunc": (".tasks", "RewardFunc"),
    "safe_reward": (".tasks", "safe_reward"),
    "TwoFormsTask": (".tasks", "TwoFormsTask"),
    "TwoFormsReward": (".tasks", "TwoFormsReward"),
    "embedded_model_path": (".app.embedded", "embedded_model_path"),
    "HeldoutAccuracyCallback": (".app.evaluation", "HeldoutAccuracyCallback"),
    "plot_metrics": (".app.plotting", "plot_metrics"),
    "dfpo_train": (".app.main", "main"),
    "parse_recipe": (".app.parser", "parse_recipe"),
}

# The stable public API (docs/source/concepts/architecture.md, "Stable names"): every other name in dfpo_trl's modules
# is internal, except dfpo_trl.testing's own lists.
__all__ = [
    "DFPOConfig",
    "DFPOTrainer",
    "TRLCompatibilityError",
    "UntestedTRLWarning",
    "register_transform",
    "registered_transforms",
    "unregister_transform",
    "get_transform",
    "register_task",
    "get_task",
    "register_reward",
    "get_reward",
    "Task",
    "EquivalentFormsTask",
    "RewardFunc",
    "safe_reward",
    "TwoFormsTask",
    "TwoFormsReward",
    "embedded_model_path",
    "HeldoutAccuracyCallback",
    "plot_metrics",
    "dfpo_train",
    "parse_recipe",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first read, and keep the name here."""
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
