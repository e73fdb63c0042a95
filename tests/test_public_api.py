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
    """A change to the stable names is a deliberate one: this list and the API reference change together. The root
    holds the library's names only; the program's are dfpo_trl.cli's."""
    assert dfpo_trl.__all__ == [
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
    for name in dfpo_trl.__all__:
        assert getattr(dfpo_trl, name) is not None


def test_cli_all_is_the_programs_stable_list() -> None:
    import dfpo_trl.cli

    assert dfpo_trl.cli.__all__ == [
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
    assert not set(dfpo_trl.cli.__all__) & set(dfpo_trl.__all__)


def test_each_public_name_is_its_modules_own_object() -> None:
    """The roots re-export, they do not wrap: ``dfpo_train`` is the program ``dfpo-train`` runs, and each other name
    is the object of the module that defines it."""
    import dfpo_trl.cli as cli
    from dfpo_trl import rewards
    from dfpo_trl.cli import embedded, evaluation, main, parser, plotting, tasks
    from dfpo_trl.cli.tasks import registry
    from dfpo_trl.transforms import registry as transforms

    assert cli.dfpo_train is main.main
    assert cli.parse_recipe is parser.parse_recipe
    assert cli.embedded_model_path is embedded.embedded_model_path
    assert cli.HeldoutAccuracyCallback is evaluation.HeldoutAccuracyCallback
    assert cli.greedy_accuracy is evaluation.greedy_accuracy
    assert cli.plot_metrics is plotting.plot_metrics
    assert dfpo_trl.get_transform is transforms.get_transform
    assert (cli.get_task, cli.register_task, cli.get_reward, cli.register_reward) == (
        registry.get_task, registry.register_task, registry.get_reward, registry.register_reward)
    for name in ("Task", "EquivalentFormsTask", "TwoFormsTask", "TwoFormsReward"):
        assert getattr(cli, name) is getattr(tasks, name), name
    assert dfpo_trl.safe_reward is rewards.safe_reward is tasks.safe_reward
    assert dfpo_trl.RewardFunc is rewards.RewardFunc


def test_the_programs_old_root_names_warn_and_resolve() -> None:
    """Before 0.1.0 the program's names were importable from the root: they still are, with a FutureWarning that
    names the new import (the changelog's entry)."""
    import pytest

    import dfpo_trl.cli as cli

    for name in dfpo_trl._MOVED_TO_CLI:
        dfpo_trl.__dict__.pop(name, None)
        with pytest.warns(FutureWarning, match=rf"from dfpo_trl\.cli import {name}"):
            assert getattr(dfpo_trl, name) is getattr(cli, name)
    assert set(dfpo_trl._MOVED_TO_CLI) <= set(cli.__all__)
    with pytest.raises(AttributeError):
        dfpo_trl.no_such_name  # noqa: B018
