"""Validation of each ``DFPOConfig`` field on its own: one rule per field (``FIELD_RULES``); the rules between
fields, checked after these, are in :mod:`dfpo_trl.config_combinations`.

Every message names the field, the rule and the fix. TRL and transformers accept many bad values silently (a
negative clip range, a zero temperature) and fail, if at all, minutes later inside a rollout or the loss, so the
TRL fields DFPO relies on have a rule here too.
"""

from __future__ import annotations

from typing import Any

from .delta.weights import DELTA_RULES
from .objectives.transform_math import (
    SCALE_FACTOR_FIX,
    SCALE_FACTOR_RULE,
    TRUNCATE_FLOOR_FIX,
    TRUNCATE_FLOOR_RULE,
    valid_scale_factor,
    valid_truncate_floor,
)
from .objectives.transforms import TRANSFORMS, registered_transforms
from .options import (
    CANCELLATION_TARGETS,
    ENERGY_FORMS,
    GROUP_LAYOUTS,
    ONE_SIDED_POLICIES,
    TOKEN_WEIGHTINGS,
    TRANSFORM_GRADIENTS,
)
from .rules import FieldRule, finite, integer, one_of, optional, problems, quoted

__all__ = ["FIELD_RULES", "check_fields"]



def registered_transform(value: Any, _: Any) -> bool:
    """A name in the transform registry as it is now (built-ins and dfpo_trl.register_transform's)."""
    return isinstance(value, str) and value in TRANSFORMS


def _transform_fix(_value: Any, _config: Any) -> str:
    return (
        f"use one of {quoted(registered_transforms(), ', ')}, or register the transform first with "
        "dfpo_trl.register_transform (in dfpo-train: --plugins MODULE, docs/extending.md)"
    )


def _positive_integer(name: str) -> FieldRule:
    return FieldRule(name, lambda v, _: integer(v) and v >= 1, "must be an integer >= 1", f"set {name} >= 1")


FIELD_RULES: tuple[FieldRule, ...] = (
    # ---- TRL's fields that DFPO relies on
    FieldRule(
        "epsilon", lambda v, _: finite(v) and 0 < v <= 1,
        "is out of range: the clip range [1 - epsilon, 1 + epsilon_high] needs 0 < epsilon <= 1",
        "GSPO and DFPO use 3e-4, token-level GRPO 0.2",
    ),
    FieldRule(
        "epsilon_high", optional(lambda v, _: finite(v) and v > 0),
        "is out of range: the upper clip bound 1 + epsilon_high needs epsilon_high > 0",
        "GSPO and DFPO use 4e-4, DAPO 0.28, or leave it unset (= epsilon)",
    ),
    FieldRule(
        "delta", optional(lambda v, _: finite(v) and v > 1),
        "is out of range: the two-sided clip bound on the ratio must exceed 1 (at 1 or below it clips on-policy "
        "tokens)", "TRL recommends more than 1 + epsilon_high, or leave it unset (None)",
    ),
    _positive_integer("per_device_train_batch_size"),
    _positive_integer("gradient_accumulation_steps"),
    _positive_integer("num_iterations"),
    FieldRule(
        "steps_per_generation", optional(lambda v, _: integer(v) and v >= 1),
        "must be an integer >= 1", "set it >= 1, or leave it unset (= gradient_accumulation_steps)",
    ),
    FieldRule(
        "num_generations", optional(lambda v, _: integer(v) and v >= 2),
        "must be an integer >= 2: a group needs at least 2 completions per prompt for group-relative advantages "
        "and in-group transforms", "set num_generations >= 2",
    ),
    FieldRule(
        "max_completion_length", optional(lambda v, _: integer(v) and v >= 1),
        "must be an integer >= 1 (tokens per completion)", "e.g. 16 for the arithmetic task",
    ),
    FieldRule(
        "temperature", lambda v, _: finite(v) and v > 0,
        "must be > 0 (sampling divides the logits by it, and the log-probs use it too)", "use 1.0 or e.g. 0.6",
    ),
    FieldRule("top_p", lambda v, _: finite(v) and 0 < v <= 1, "must be in (0, 1]", "use 1.0 to keep all tokens"),
    FieldRule("top_k", lambda v, _: integer(v) and v >= 0, "must be >= 0", "use 0 to disable top-k"),
    FieldRule("beta", lambda v, _: finite(v) and v >= 0, "must be >= 0 (KL coefficient)", "use 0.0 for no KL"),
    FieldRule(
        "learning_rate", lambda v, _: finite(v) and v > 0,
        "must be > 0", "e.g. 5e-5 for the CPU main job, 1e-6 for large models",
    ),
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
)


def check_fields(config: Any) -> None:
    """Every field's rule, all problems reported at once (the rules between fields come after, in
    :mod:`dfpo_trl.config_combinations`)."""
    found = problems(FIELD_RULES, config)
    if found:
        raise ValueError("invalid value(s): " + " | ".join(found) + ".")
