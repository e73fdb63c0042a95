"""Each default lives once: the math functions' defaults are ``DFPOConfig``'s, so calling the math without an option
computes what a default config trains with."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest

from dfpo_trl.config import DFPOConfig
from dfpo_trl.delta.weights import _token_weights as token_weights
from dfpo_trl.delta.weights import _token_weights_from_hidden as token_weights_from_hidden
from dfpo_trl.objectives.cancellation import balance_group_weights
from dfpo_trl.transforms.builtins import scale, truncate_rebalance

CONFIG_DEFAULTS = {f.name: f.default for f in fields(DFPOConfig)}

#: (math function, its parameter, the config field whose default it must share).
TIED = [
    (scale, "factor", "transform_scale"),
    (truncate_rebalance, "floor", "transform_truncate_floor"),
    (balance_group_weights, "scale_factor", "transform_scale"),
    (balance_group_weights, "truncate_floor", "transform_truncate_floor"),
    *(
        (function, option, f"delta_{option}")
        for function in (token_weights, token_weights_from_hidden)
        for option in ("lambda_min", "lambda_max", "refine_steps", "gamma", "gamma_update", "zero_advantage",
                       "assignment", "contrast")
    ),
]


@pytest.mark.parametrize(("function", "parameter", "field"), TIED,
                         ids=[f"{f.__name__}.{p}" for f, p, _ in TIED])
def test_math_default_is_the_configs(function: Callable[..., Any], parameter: str, field: str) -> None:
    default = inspect.signature(function).parameters[parameter].default
    assert default is not inspect.Parameter.empty, f"{function.__name__}({parameter}) has no default"
    assert type(default) is type(CONFIG_DEFAULTS[field]) and default == CONFIG_DEFAULTS[field], (
        f"{function.__name__}({parameter}={default!r}) but DFPOConfig.{field} defaults to {CONFIG_DEFAULTS[field]!r}"
    )


def test_a_default_config_reads_the_same_values() -> None:
    """The built config (after its own normalisation, e.g. ``read_gamma``) still holds the math's defaults."""
    config = DFPOConfig(output_dir="unused", report_to="none")
    assert config.transform_scale == inspect.signature(scale).parameters["factor"].default
    assert config.delta_gamma == inspect.signature(token_weights).parameters["gamma"].default
