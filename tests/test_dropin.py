"""DFPOTrainer as a drop-in for trl.GRPOTrainer: default config, same run with DFPO off."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_no_args_builds_a_default_config_named_after_the_model(tmp_path, monkeypatch, gpu_recipes_parse_here):
    """As GRPOTrainer builds GRPOConfig(f"{model_name}-GRPO"), DFPOTrainer builds DFPOConfig(f"{model_name}-DFPO").
    (The default config asks for bf16, which this CPU machine lacks: the fixture lets it parse.)"""
    monkeypatch.chdir(tmp_path)
    model = tiny_model()
    model.config._name_or_path = "tiny-org/tiny-llama"
    trainer = DFPOTrainer(model=model, reward_funcs=last_digit_reward, train_dataset=addition_dataset(),
                          processing_class=tiny_tokenizer())
    assert type(trainer.args) is DFPOConfig
    assert trainer.args.output_dir == "tiny-llama-DFPO"
    assert trainer.args.group_transform == "none"


def test_positional_arguments_are_read_by_name():
    config = DFPOConfig(output_dir="/tmp/dfpo-test-out", use_cpu=True, report_to="none", per_device_train_batch_size=4,
                        num_generations=4)
    trainer = DFPOTrainer(tiny_model(), last_digit_reward, config, addition_dataset(),
                          processing_class=tiny_tokenizer())
    assert trainer.args is config


def test_a_grpo_config_is_refused_with_the_fix():
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="DFPOConfig"):
        DFPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward, args=GRPOConfig("/tmp/x", use_cpu=True),
                    train_dataset=addition_dataset(), processing_class=tiny_tokenizer())


# Layouts of TRL's buffer, each trained ≥ 4 optimizer steps by both trainers from the same seed.
LAYOUTS = {
    # whole groups in every micro-batch (the layout DFPO's transforms use when they are on)
    "whole_groups": dict(per_device_train_batch_size=4, num_generations=2, steps_per_generation=2),
    # the report: G = 3, whole groups per micro-batch, two micro-batches a rollout, bnpo
    "issue_report": dict(per_device_train_batch_size=3, num_generations=3, steps_per_generation=2, loss_type="bnpo"),
    # GSPO with whole groups: the sequence-level path that the mechanism metrics read
    "whole_groups_gspo": dict(per_device_train_batch_size=4, num_generations=2, steps_per_generation=4,
                              importance_sampling_level="sequence", loss_type="grpo"),
    # groups spread over the micro-steps of one optimizer step
    "groups_over_micro_steps": dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=2,
                                    gradient_accumulation_steps=2),
    # steps_per_generation > 1 with a per-device batch that is not a multiple of G
    "not_a_multiple": dict(per_device_train_batch_size=3, num_generations=2, steps_per_generation=2),
}
COMPARED = ("loss", "reward", "reward_std", "grad_norm", "completions/mean_length", "entropy", "clip_ratio/region_mean")


def train_side_by_side(trainer_cls: type, config_cls: type, **settings: Any):
    args = config_cls(**base_args(max_steps=4, temperature=1.5, learning_rate=0.05, **settings))
    trainer = trainer_cls(model=tiny_model(0), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    trainer.train()
    return trainer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dfpo_off_is_the_same_run_as_grpo_trainer(layout):
    """Same seed, no DFPO option: the same parameters bit for bit and the same logged rewards and losses after 4
    optimizer steps, in every layout (DFPO must neither reorder TRL's micro-batches nor draw from its RNG)."""
    ours = train_side_by_side(DFPOTrainer, DFPOConfig, **LAYOUTS[layout])
    theirs = train_side_by_side(GRPOTrainer, GRPOConfig, **LAYOUTS[layout])
    assert ours.state.global_step == theirs.state.global_step == 4
    logged = [[{k: h[k] for k in COMPARED if k in h} for h in t.state.log_history if "loss" in h]
              for t in (ours, theirs)]
    assert len(logged[0]) == 4 and any("reward" in h for h in logged[0])
    assert logged[0] == logged[1]
    mine, reference = ours.model.state_dict(), theirs.model.state_dict()
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)


def test_unset_pin_memory_on_a_machine_without_an_accelerator_is_the_same_run_quietly():
    """Without use_cpu on a machine without an accelerator, GRPOConfig pins the data loader's memory (transformers'
    default) and torch warns that it cannot; DFPOConfig leaves it off there. Only data loading differs: the same run
    bit for bit as GRPOTrainer's, and DFPO's without the warning (GRPO's shows the test would see it)."""
    import warnings

    if torch.accelerator.is_available():
        pytest.skip("the machine has an accelerator: unset pin memory is on, as in transformers")
    runs, warned = [], []
    for trainer_cls, config_cls in ((DFPOTrainer, DFPOConfig), (GRPOTrainer, GRPOConfig)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(train_side_by_side(trainer_cls, config_cls, use_cpu=False, **LAYOUTS["whole_groups"]))
        warned.append(any("pin_memory" in str(w.message) for w in caught))
    ours, theirs = runs
    assert (ours.args.dataloader_pin_memory, theirs.args.dataloader_pin_memory) == (False, True)
    assert warned == [False, True]
    mine, reference = ours.model.state_dict(), theirs.model.state_dict()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)
    assert [h.get("loss") for h in ours.state.log_history] == [h.get("loss") for h in theirs.state.log_history]


def rollout_stub(rows: int, group_size: int) -> dict[str, Any]:
    """A generation batch as DFPOTrainer's rollout returns it (with group and row ids), 3 completion tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 10, (rows, 3), generator=g)
    return dict(
        prompt_ids=torch.full((rows, 2), 13), prompt_mask=torch.ones(rows, 2, dtype=torch.long), completion_ids=ids,
        completion_mask=torch.ones(rows, 3, dtype=torch.long), advantages=torch.randn(rows, generator=g),
        num_items_in_batch=torch.tensor(3 * rows), group_ids=torch.arange(rows) // group_size,
        row_ids=torch.arange(rows),
    )


@pytest.mark.parametrize("forced", [None, True])
def test_group_shuffle_leaves_the_global_rng_stream_to_trl(forced):
    """Whether or not the group shuffle runs, torch's global RNG is where GRPOTrainer leaves it after a rollout:
    DFPO's shuffle draws from its own generator."""
    sizes = dict(per_device_train_batch_size=4, num_generations=2, steps_per_generation=2)
    states = []
    for trainer_cls, config_cls, extra in ((GRPOTrainer, GRPOConfig, {}),
                                           (DFPOTrainer, DFPOConfig, dict(group_granular_batches=forced))):
        trainer = trainer_cls(model=tiny_model(0), reward_funcs=last_digit_reward,
                              args=config_cls(**base_args(**sizes, **extra)), train_dataset=addition_dataset(),
                              processing_class=tiny_tokenizer())
        trainer.model.train()
        trainer._generate_and_score_completions = lambda _inputs: rollout_stub(8, 2)
        torch.manual_seed(123)
        trainer._prepare_inputs(None)
        states.append(torch.random.get_rng_state())
    expected = "group_granular" if forced else "per_sample"
    assert trainer.group_layout == expected
    assert torch.equal(states[0], states[1])


def test_forced_group_granular_batches_give_a_baseline_its_mechanism_metrics():
    """group_granular_batches=True with no DFPO option (GSPO through DFPOTrainer, as the benchmarks run their
    baseline): whole groups in every micro-batch, so the group metrics are logged at every step; the automatic
    setting keeps TRL's per-sample order instead, where they are only logged on micro-batches that happen to hold
    whole groups."""
    sizes = dict(per_device_train_batch_size=4, num_generations=2, steps_per_generation=4, max_steps=4,
                 importance_sampling_level="sequence", loss_type="grpo", temperature=1.5, learning_rate=0.05)
    trainer = DFPOTrainer(model=tiny_model(0), reward_funcs=last_digit_reward,
                          args=DFPOConfig(**base_args(**sizes, group_granular_batches=True)),
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    assert trainer.group_layout == "group_granular"
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all("asym/before" in h and "transform/phi_min" in h for h in logs)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(per_device_train_batch_size=3, num_generations=2, steps_per_generation=2, group_granular_batches=True),
         "group_granular_batches=True needs whole groups .* per_device_train_batch_size=3"),
        (dict(per_device_train_batch_size=4, num_generations=2, group_granular_batches=False,
              importance_sampling_level="sequence", group_transform="min_replace", transform_stop_gradient=False),
         "transform_stop_gradient=False .* group_granular_batches=False"),
    ],
)
def test_group_granular_batches_refuses_what_it_cannot_do(settings, message):
    with pytest.raises(ValueError, match=message):
        DFPOTrainer(model=tiny_model(0), reward_funcs=last_digit_reward, args=DFPOConfig(**base_args(**settings)),
                    train_dataset=addition_dataset(), processing_class=tiny_tokenizer())


def test_group_granular_batches_false_runs_a_transform_through_the_pre_pass():
    args = DFPOConfig(**base_args(per_device_train_batch_size=4, num_generations=2, steps_per_generation=2,
                                  importance_sampling_level="sequence", group_transform="min_replace",
                                  group_granular_batches=False))
    trainer = DFPOTrainer(model=tiny_model(0), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    assert trainer.group_layout == "pre_pass"
