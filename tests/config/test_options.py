"""dfpo_trl.config.options and dfpo_trl.config.method: each option's values defined once and used by the parser, the
checks and the math; one loss-type table; one description of the method in use."""

from __future__ import annotations

from dataclasses import fields
from typing import Literal, get_args, get_origin, get_type_hints

import pytest
import torch

from dfpo_trl.config import DFPOConfig, options
from dfpo_trl.config.method import method_in_use
from dfpo_trl.delta.rollout import normalisation_domain
from dfpo_trl.objectives.cancellation import aggregation_factor
from tests.tiny import base_args


def config(**overrides):
    return DFPOConfig(**base_args(**overrides))


def test_each_closed_option_is_a_literal_that_the_parser_turns_into_choices():
    from dfpo_trl.cli.parser import make_parser

    hints = get_type_hints(DFPOConfig)
    literal = {f.name: get_args(hints[f.name]) for f in fields(DFPOConfig) if get_origin(hints[f.name]) is Literal}
    assert literal["cancellation_target"] == options.CANCELLATION_TARGETS == ("weights", "gradient")
    assert literal["delta_contrast"] == options.CONTRASTS
    parser = make_parser()
    for name, values in literal.items():
        assert tuple(parser.primary_action(name).choices) == values, name
        assert DFPOConfig.__dataclass_fields__[name].default == values[0], name  # the default is the first value
        assert all(isinstance(v, str) for v in values), name  # users pass strings; the config keeps them
    assert "group_transform" not in literal and "delta_gamma" not in literal  # open: registry / a number


def test_a_bad_choice_names_the_field_and_its_values():
    with pytest.raises(ValueError, match=r"cancellation_target='both' is not valid; use 'weights'"):
        config(cancellation_target="both")


def test_loss_type_table_agrees_with_the_math_that_reads_it():
    """The aggregation column is the factor c_i (eq. C3) the cancellation math computes; the DelTA column is where
    λ̄ averages 1."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    lengths = mask.sum(1).double()
    tokens = torch.full((2,), 5.0)
    for name, entry in options.LOSS_TYPES.items():
        factor = aggregation_factor(mask, name, None, tokens)
        expected = {
            options.AGGREGATION_SEQUENCE_MEAN: 1 / lengths,
            options.AGGREGATION_MICRO_BATCH_TOKENS: 1 / tokens.double(),
            options.AGGREGATION_CONSTANT: torch.ones(2, dtype=torch.float64),
        }[entry.aggregation]
        torch.testing.assert_close(factor.double() / factor.double()[0] * expected[0], expected, msg=name)
        if entry.delta_domain is None:
            with pytest.raises(ValueError, match=name):
                normalisation_domain(name)
        else:
            assert normalisation_domain(name) == entry.delta_domain
    assert options.DELTA_LOSS_TYPES == options.TOKEN_LEVEL_CLIPPED_LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo")
    assert options.CLIPPED_LOSS_TYPES == (*options.DELTA_LOSS_TYPES, "luspo")


@pytest.mark.parametrize(
    ("overrides", "label", "active"),
    [
        (dict(), "GRPO (loss_type=dapo)", ""),
        (dict(importance_sampling_level="sequence", loss_type="grpo"), "GSPO", ""),
        (dict(importance_sampling_level="sequence", loss_type="grpo", group_transform="min_replace",
              transform_gradient="score"), "DFPO min_replace (score form)",
         "group_transform='min_replace' with transform_gradient='score'"),
        (dict(symmetric_clip=True, token_weighting="delta", loss_type="dapo", log_energy_buckets=3),
         "GRPO-fix (symmetric clip) + DelTA", "symmetric_clip=True, token_weighting='delta', log_energy_buckets=3"),
    ],
)
def test_method_in_use_describes_the_config_once(overrides, label, active):
    cfg = config(**overrides)
    method = method_in_use(cfg)
    assert (method.label, method.active_options) == (label, active)
    assert method.active_options == active and cfg.sequence_rewrite_active == method.rewrites_sequences
