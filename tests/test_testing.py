"""``dfpo_trl.testing``: its stable names, builders that depend on the seed alone, and a ``DFPOCallback`` that sees
every micro-step's objective exactly as the loss uses it (docs/source/contributing.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trl import GRPOTrainer

import dfpo_trl.testing as testing
from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.testing import DFPOCallback, record_row_weights, tiny_model, tiny_trainer, write_tiny_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def test_all_is_the_stable_list() -> None:
    """A change to the stable names is a deliberate one: this list and docs/source/contributing.md change together."""
    assert testing.__all__ == [
        "WORDS",
        "DFPOCallback",
        "addition_dataset",
        "hand_batch",
        "last_digit_reward",
        "observe_micro_steps",
        "random_batch",
        "record_pre_passes",
        "record_row_weights",
        "save_tiny_chat_model",
        "tiny_config_kwargs",
        "tiny_model",
        "tiny_tokenizer",
        "tiny_trainer",
        "with_old_logps",
        "write_tiny_recipe",
    ]
    for name in testing.__all__:
        assert getattr(testing, name) is not None


def test_the_measures_are_the_librarys_own_objects() -> None:
    """``dfpo_trl.testing.measures`` re-exports, never copies: a check through it reads what a run computes. The
    list changes with docs/source/contributing.md's table."""
    import importlib

    from dfpo_trl.testing import measures

    homes = {
        "dfpo_trl.objectives.weights": ["loss_mask", "post_clip_weights", "sequence_log_ratio", "sign_aware_post_clip"],
        "dfpo_trl.groups.ids": ["WHOLE_GROUPS_KEY", "consecutive_group_ids", "group_index"],
        "dfpo_trl.groups.prepass_schedule": ["pre_pass_rows"],
        "dfpo_trl.metrics.curves": ["jitter2", "steps_to_threshold"],
        "dfpo_trl.metrics.drift_meter": ["DriftMeterCallback"],
        "dfpo_trl.metrics.drift": ["completion_log_probs", "end_token_ids", "equivalent_set_stats",
                                   "summarise_equivalent_sets"],
        "dfpo_trl.trl_hooks.sync_watchdog": ["STALL_EXIT_CODE", "SyncWatchdog", "streamed_size"],
        "dfpo_trl.profiling": ["PROFILE_LABELS"],
    }
    assert sorted(measures.__all__) == sorted(name for names in homes.values() for name in names)
    for module, names in homes.items():
        for name in names:
            assert getattr(measures, name) is getattr(importlib.import_module(module), name), name
    documented = (Path(__file__).resolve().parents[1] / "docs" / "source" / "contributing.md").read_text()
    assert all(f"`{name}" in documented for name in measures.__all__)


def test_the_tiny_model_depends_on_its_seed_alone() -> None:
    torch.manual_seed(123)  # whatever the global generator held before
    a, b, c = tiny_model(0).state_dict(), tiny_model(0).state_dict(), tiny_model(1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    tied = tiny_model(tied=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tiny_model().lm_head.weight is not tiny_model().model.embed_tokens.weight


def test_the_tiny_recipe_is_the_command_line_that_runs_it(tmp_path: Any) -> None:
    """The recipe's path first, then the model and output_dir flags for those given; a change goes into the recipe,
    and a change to None drops the field, which then keeps its default. ``dfpo-train`` reads it as written."""
    from dfpo_trl.cli.parser import parse_args

    recipe = str(tmp_path / "recipe.yaml")
    assert write_tiny_recipe(tmp_path) == [recipe]
    (tmp_path / "model").mkdir()  # a local model path must exist: dfpo-train refuses a missing one before torch
    argv = write_tiny_recipe(tmp_path, tmp_path / "model", tmp_path / "out", max_steps=3, temperature=None)
    assert argv == [recipe, "--model_name_or_path", str(tmp_path / "model"), "--output_dir", str(tmp_path / "out")]
    script_args, args, model_args = parse_args(argv)
    assert (model_args.model_name_or_path, args.output_dir) == (str(tmp_path / "model"), str(tmp_path / "out"))
    assert (args.max_steps, args.num_generations, args.per_device_train_batch_size, args.steps_per_generation) == (
        3, 4, 4, 2)  # fmt: skip
    assert (args.group_transform, args.importance_sampling_level, args.use_cpu, args.seed) == (
        "min_replace", "sequence", True, 0)  # fmt: skip
    assert (script_args.train_size, script_args.eval_size) == (16, 4)
    assert args.temperature == DFPOConfig.__dataclass_fields__["temperature"].default


def test_the_callback_sees_every_micro_step_as_the_loss_uses_it(tmp_path: Any) -> None:
    """Two optimizer steps of two micro-steps each: four events, in order, each handing over the very advantages
    tensor TRL's loss then reads (DFPO's rewrite of the rollout's) and the weights the helper records."""

    class Seen(DFPOCallback):
        def __init__(self) -> None:
            self.steps: list[Any] = []
            self.global_steps: list[int] = []

        def on_micro_step(self, args: Any, state: Any, control: Any, *, step: Any, **kwargs: Any) -> None:
            self.steps.append(step)
            self.global_steps.append(state.global_step)

    class ReadByTRL(GRPOTrainer):
        """Below DFPOTrainer in the MRO: keeps the advantages TRL's own loss reads, after DFPO's rewrite."""

        read: list[torch.Tensor] = []

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            loss = super()._compute_loss(model, inputs)
            self.read.append(inputs["advantages"])  # DFPO rewrites it right after TRL's policy forward, in there
            return loss

    class Reading(DFPOTrainer, ReadByTRL):
        pass

    seen = Seen()
    trainer = tiny_trainer(
        Reading, DFPOConfig, output_dir=str(tmp_path), max_steps=2, importance_sampling_level="sequence",
        epsilon=3e-2, epsilon_high=4e-2, group_transform="min_replace", gradient_accumulation_steps=2,
        steps_per_generation=4,
    )  # fmt: skip
    trainer.add_callback(seen)
    weights = record_row_weights(trainer)
    trainer.train()
    assert len(seen.steps) == 4 and seen.global_steps == [0, 0, 1, 1]
    assert len(weights) == 4
    assert len(trainer.read) == 4
    for step, used, read in zip(seen.steps, weights, trainer.read, strict=True):
        assert step.values.weights is used  # the helper and a callback of one's own see the same objects
        assert step.loss_inputs.advantages is read  # what TRL's loss read, this very tensor
    trainer.remove_callback(seen)
    assert seen not in trainer.callback_handler.callbacks
