"""Validation of each ``DFPOConfig`` field on its own: one rule per field (``FIELD_RULES``); the rules between
fields, checked after these, are in :mod:`dfpo_trl.config.combinations`.

Every message names the field, the rule and the fix. TRL and transformers accept many bad values silently (a
negative clip range, a zero temperature) and fail, if at all, minutes later inside a rollout or the loss, so the
TRL fields DFPO relies on have a rule here too.
"""

from __future__ import annotations

from typing import Any

from ..transforms import TRANSFORMS, registered_transforms
from ..transforms.builtins import (
    SCALE_FACTOR_FIX,
    SCALE_FACTOR_RULE,
    TRUNCATE_FLOOR_FIX,
    TRUNCATE_FLOOR_RULE,
    valid_scale_factor,
    valid_truncate_floor,
)
from .delta_rules import DELTA_RULES
from .options import (
    CANCELLATION_TARGETS,
    ENERGY_FORMS,
    GROUP_LAYOUTS,
    IMPORTANCE_SAMPLING_SUPPORTS,
    ONE_SIDED_POLICIES,
    TOKEN_WEIGHTINGS,
    TRANSFORM_GRADIENTS,
)
from .rules import FieldRule, finite, integer, one_of, optional, problems, quoted, transform_fix
from .trl_field_rules import TRL_FIELD_RULES

__all__ = ["FIELD_RULES", "check_fields"]



def registered_transform(value: Any, _: Any) -> bool:
    """A name in the transform registry as it is now (built-ins and dfpo_trl.register_transform's)."""
    return isinstance(value, str) and value in TRANSFORMS


def _transform_fix(_value: Any, _config: Any) -> str:
    return transform_fix(registered_transforms())


FIELD_RULES: tuple[FieldRule, ...] = (
    *TRL_FIELD_RULES,  # TRL's fields that DFPO relies on (trl_field_rules: no torch, the CLI's fast path)
    # ---- DFPO's fields, in declaration order
    FieldRule("group_transform", registered_transform, "is not a DFPO transform", _transform_fix),
    FieldRule("transform_scale", lambda v, _: valid_scale_factor(v), SCALE_FACTOR_RULE, SCALE_FACTOR_FIX),
    FieldRule(
        "transform_truncate_floor", lambda v, _: valid_truncate_floor(v), TRUNCATE_FLOOR_RULE, TRUNCATE_FLOOR_FIX
    ),
    FieldRule("transform_gradient", one_of(TRANSFORM_GRADIENTS), "is not valid", f"use {quoted(TRANSFORM_GRADIENTS)}"),
    FieldRule(
        "cancellation_target", one_of(CANCELLATION_TARGETS), "is not valid",
        "use 'weights' (the paper) or 'gradient' (balance the gradients that survive the clip)",
    ),
    FieldRule(
        "cancellation_one_sided", one_of(ONE_SIDED_POLICIES), "is not valid", f"use {quoted(ONE_SIDED_POLICIES)}"
    ),
    FieldRule(
        "group_granular_batches", one_of((None, True, False)), "is not valid", "use None (automatic), True or False"
    ),
    FieldRule("group_layout", one_of(GROUP_LAYOUTS), "is not valid", f"use one of {quoted(GROUP_LAYOUTS, ', ')}"),
    FieldRule(
        "prepass_batch_size", optional(lambda v, _: integer(v) and v >= 1),
        "must be a positive integer (rows per no-grad forward chunk of the pre-pass)",
        "set it >= 1, or None for 4 x per_device_train_batch_size",
    ),
    FieldRule(
        "log_energy_buckets", lambda v, _: integer(v) and (v == 0 or v >= 2),
        "is not valid (a single bucket's share is always 1)",
        "use 0 to turn the gradient-energy metric (eq. 24) off, or the number of frequency buckets k >= 2 (e.g. 3) "
        "to log energy/freq_bucket_0..k-1",
    ),
    FieldRule("energy_form", one_of(ENERGY_FORMS), "is not valid", f"use {quoted(ENERGY_FORMS)}"),
    FieldRule("token_weighting", one_of(TOKEN_WEIGHTINGS), "is not valid", "use 'none' or 'delta' (DelTA)"),
    # ---- DelTA's fields: their rules are DelTA's own (dfpo_trl.delta.weights), shared with its functions
    *DELTA_RULES,
    # ---- the server-mode weight sync's deadline (trl_hooks/sync_watchdog.py)
    FieldRule(
        "vllm_sync_timeout", lambda v, _: finite(v) and v >= 0, "must be a number of seconds >= 0",
        "use 0 for no limit, or more seconds than one weight sync takes (default 600)",
    ),
    # ---- vLLM: the importance-sampling ratio's support and the generation request's deadline
    FieldRule(
        "vllm_importance_sampling_support", one_of(IMPORTANCE_SAMPLING_SUPPORTS), "is not valid",
        f"use {quoted(IMPORTANCE_SAMPLING_SUPPORTS)} (the ratio against the support vLLM sampled from)",
    ),
    FieldRule(
        "vllm_generation_timeout", optional(lambda v, _: finite(v) and v >= 0), "must be a number of seconds >= 0",
        "use None (600 s + the request's tokens at 500 a second), 0 for no limit, or more seconds than one "
        "rollout's generation takes",
    ),
)


def check_fields(config: Any) -> None:
    """Every field's rule, all problems reported at once (the rules between fields come after, in
    :mod:`dfpo_trl.config.combinations`)."""
    found = problems(FIELD_RULES, config)
    if found:
        raise ValueError("invalid value(s): " + " | ".join(found) + ".")
