"""DFPOTrainer as a drop-in for trl.GRPOTrainer (issue #11): default config, same run with DFPO off."""

from __future__ import annotations

import pytest
from tiny import addition_dataset, last_digit_reward, tiny_model, tiny_tokenizer

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
