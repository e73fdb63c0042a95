"""The package root's public surface: TRL's own trainer signature, the compatibility error and warning, and a short
``__all__`` (docs/source/concepts/architecture.md, "Stable names")."""

from __future__ import annotations

import inspect
import subprocess
import sys

import trl

import dfpo_trl
from dfpo_trl.trl_hooks import compat


def test_trainer_shows_grpo_trainers_signature() -> None:
    """help() and IDEs read these: the same parameters, kinds, defaults and annotations as the installed TRL's."""
    ours = inspect.signature(dfpo_trl.DFPOTrainer)
    theirs = inspect.signature(trl.GRPOTrainer)
    assert list(ours.parameters.values()) == list(theirs.parameters.values())
    assert list(ours.parameters)[:2] == ["model", "reward_funcs"]
    assert inspect.signature(dfpo_trl.DFPOTrainer.__init__) == inspect.signature(trl.GRPOTrainer.__init__)


def test_compatibility_error_and_warning_are_exported() -> None:
    assert dfpo_trl.TRLCompatibilityError is compat.TRLCompatibilityError
    assert dfpo_trl.UntestedTRLWarning is compat.UntestedTRLWarning
    assert issubclass(dfpo_trl.TRLCompatibilityError, ImportError)
    assert issubclass(dfpo_trl.UntestedTRLWarning, UserWarning)


def test_error_imports_without_the_trainer() -> None:
    """The error can be imported to catch it, even where the TRL check would fail: it does not import the trainer."""
    code = (
        "import sys; from dfpo_trl import TRLCompatibilityError, UntestedTRLWarning; "
        "print('dfpo_trl.trainer' in sys.modules, 'dfpo_trl.trl_hooks.compat' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_root_all_is_the_stable_list() -> None:
    """A change to the stable names is a deliberate one: this list and docs/source/concepts/architecture.md change
    together."""
    assert dfpo_trl.__all__ == [
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
    for name in dfpo_trl.__all__:
        assert getattr(dfpo_trl, name) is not None


def test_each_root_name_is_the_librarys_own_object() -> None:
    """The root re-exports, it does not wrap: ``dfpo_train`` is the program ``dfpo-train`` runs, and each other name is
    the object of the module that defines it."""
    from dfpo_trl import tasks
    from dfpo_trl.app import embedded, evaluation, main, parser, plotting
    from dfpo_trl.tasks import registry
    from dfpo_trl.transforms import registry as transforms

    assert dfpo_trl.dfpo_train is main.main
    assert dfpo_trl.parse_recipe is parser.parse_recipe
    assert dfpo_trl.embedded_model_path is embedded.embedded_model_path
    assert dfpo_trl.HeldoutAccuracyCallback is evaluation.HeldoutAccuracyCallback
    assert dfpo_trl.plot_metrics is plotting.plot_metrics
    assert dfpo_trl.get_transform is transforms.get_transform
    assert (dfpo_trl.get_task, dfpo_trl.register_task, dfpo_trl.get_reward, dfpo_trl.register_reward) == (
        registry.get_task, registry.register_task, registry.get_reward, registry.register_reward)
    for name in ("Task", "EquivalentFormsTask", "RewardFunc", "safe_reward", "TwoFormsTask", "TwoFormsReward"):
        assert getattr(dfpo_trl, name) is getattr(tasks, name), name
