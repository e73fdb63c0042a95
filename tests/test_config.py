"""DFPOConfig refuses bad input with a message that names the field and the fix."""

from __future__ import annotations

import pytest
from tiny import base_args

from dfpo_trl import DFPOConfig

SEQ = dict(importance_sampling_level="sequence", loss_type="grpo")


def config(**overrides):
    return DFPOConfig(**base_args(**overrides))


def test_defaults_are_trl_defaults_plus_dfpo_fields():
    cfg = config()
    assert cfg.group_transform == "none" and cfg.transform_gradient == "ratio" and cfg.transform_stop_gradient
    assert not cfg.symmetric_clip and not cfg.sequence_rewrite_active


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(**SEQ, group_transform="minreplace"), r"group_transform=.minreplace. is not a DFPO transform"),
        (dict(group_transform="min_replace"), r"needs importance_sampling_level='sequence'"),
        (dict(**SEQ, transform_gradient="grad"), r"transform_gradient='grad' is not valid"),
        (dict(**SEQ, num_generations=1, per_device_train_batch_size=1), r"num_generations=1.*num_generations >= 2"),
        (dict(importance_sampling_level="sequence", loss_type="cispo", group_transform="orth_proj"),
         r"loss_type='cispo' does not use.*'dapo'"),
        (dict(**SEQ, group_transform="scale", transform_scale=0.0), r"transform_scale must be > 0"),
        (dict(**SEQ, group_transform="truncate_rebalance", transform_truncate_floor=-1.0),
         r"transform_truncate_floor must be > 0"),
        (dict(**SEQ, transform_gradient="score", transform_stop_gradient=False),
         r"transform_stop_gradient=False .* does not apply to transform_gradient='score'"),
        (dict(**SEQ, symmetric_clip=True), r"symmetric_clip=True .* token-level.*importance_sampling_level='token'"),
        (dict(symmetric_clip=True, loss_type="sapo"), r"loss_type='sapo' does not use"),
        (dict(symmetric_clip=True, loss_type="luspo"), r"cannot be combined with loss_type=.luspo."),
        (dict(symmetric_clip=True, beta=0.1), r"beta != 0 and use_bias_correction_kl=True"),
        (dict(**SEQ, transform_gradient="score", off_policy_mask_threshold=0.5), r"off_policy_mask_threshold"),
    ],
)
def test_bad_input_is_refused_with_a_named_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_symmetric_clip_with_kl_is_fine_without_bias_correction():
    cfg = config(symmetric_clip=True, beta=0.1, use_bias_correction_kl=False)
    assert cfg.symmetric_clip


def test_trainer_refuses_a_plain_grpo_config():
    from tiny import make_trainer
    from trl import GRPOConfig

    from dfpo_trl import DFPOTrainer

    with pytest.raises(TypeError, match="DFPOConfig"):
        make_trainer(DFPOTrainer, GRPOConfig)


def test_every_registered_transform_is_validated_and_documented():
    """One registry (dfpo_trl.transforms.TRANSFORMS) feeds config validation, the trainer and the docs: every
    registered name is accepted by DFPOConfig and listed in its docstring and in the README's field table."""
    from pathlib import Path

    from dfpo_trl.transforms import TRANSFORMS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `group_transform` |"))
    docstring = DFPOConfig.__doc__.split("group_transform (")[1].split("transform_scale (")[0]
    for name in TRANSFORMS:
        assert f"`{name}`" in row, name
        assert f'`"{name}"`' in docstring, name
        DFPOConfig(output_dir="/tmp/x", use_cpu=True, group_transform=name, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="is not a DFPO transform"):
        DFPOConfig(output_dir="/tmp/x", use_cpu=True, group_transform="not_registered")
