"""Validation of each ``DFPOConfig`` field on its own: one rule per field (``FIELD_RULES``); the rules between
fields, checked after these, are in :mod:`dfpo_trl.config_combinations`.

Every message names the field, the rule and the fix. TRL and transformers accept many bad values silently (a
negative clip range, a zero temperature) and fail, if at all, minutes later inside a rollout or the loss, so the
TRL fields DFPO relies on have a rule here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .delta import GAMMA_RULES, GAMMA_UPDATES, SCOPES, ZERO_ADVANTAGE_RULES
from .objectives.cancellation import CANCELLATION_TARGETS, ONE_SIDED_POLICIES
from .objectives.transforms import TRANSFORMS, registered_transforms

if TYPE_CHECKING:
    from .config import DFPOConfig

TRANSFORM_GRADIENTS = ("ratio", "score")
# docs/layouts.md: what group_layout may force ("auto": the cheapest exact layout for the batch sizes).
GROUP_LAYOUTS = ("auto", "redistributed", "pre_pass")
# TRL loss types whose policy term is TRL's clipped surrogate -min(r A, clip(r) A); DFPO rewrites only those.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
TOKEN_WEIGHTINGS = ("none", "delta")
# eq. 24's readings (docs/metrics.md): the norm of each token type's summed LM-head gradient row, or per position.
ENERGY_FORMS = ("aggregate", "per_position")
# Token-level clipped loss types DelTA weights, each with a known normalisation domain (delta_trainer).
DELTA_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

Check = Callable[[Any, "DFPOConfig"], bool]


def finite(x: Any) -> bool:
    """A real number (not a bool) that is neither infinite nor NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def one_of(choices: tuple[Any, ...]) -> Check:
    return lambda value, _: value in choices


def optional(check: Check) -> Check:
    """``check``, or unset (``None``)."""
    return lambda value, config: value is None or check(value, config)


def quoted(choices: tuple[str, ...], last: str = " or ") -> str:
    """``'a', 'b' or 'c'`` (``last=", "``: ``'a', 'b', 'c'``)."""
    *names, final = [repr(c) for c in choices]
    return ", ".join(names) + last + final if names else final


@dataclass(frozen=True)
class FieldRule:
    """The rule of one field: ``check(value, config)``, else the message ``{field}={value!r} {rule}; {fix}``
    (``rule`` and ``fix`` may depend on the value and the config, or on what is registered when it runs)."""

    field: str
    check: Check
    rule: str | Callable[[Any, DFPOConfig], str]
    fix: str | Callable[[Any, DFPOConfig], str]

    def problem(self, config: DFPOConfig) -> str | None:
        value = getattr(config, self.field)
        if self.check(value, config):
            return None
        rule = self.rule(value, config) if callable(self.rule) else self.rule
        fix = self.fix(value, config) if callable(self.fix) else self.fix
        return f"{self.field}={value!r} {rule}; {fix}"


def registered_transform(value: Any, _: DFPOConfig) -> bool:
    """A name in the transform registry as it is now (built-ins and dfpo_trl.register_transform's)."""
    return isinstance(value, str) and value in TRANSFORMS


def _transform_fix(_value: Any, _config: DFPOConfig) -> str:
    return (
        f"use one of {quoted(registered_transforms(), ', ')}, or register the transform first with "
        "dfpo_trl.register_transform (in dfpo-train: --plugins MODULE, docs/extending.md)"
    )


def _positive_integer(name: str) -> FieldRule:
    return FieldRule(name, lambda v, _: integer(v) and v >= 1, "must be an integer >= 1", f"set {name} >= 1")


def _gamma_rule(value: Any, _: DFPOConfig) -> str:
    if value is None:
        return "is no longer accepted (it meant the adaptive mean-|margin| gamma)"
    return "is not valid: it must be 'std', 'mean_abs' or a finite number > 0 (a fixed gamma)"


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
    FieldRule(
        "transform_scale", lambda v, _: finite(v) and v > 0,
        "must be a finite number > 0 (the factor κ of the 'scale' ablation: 0 drops every update, a negative κ "
        "reverses it)", "the paper uses 0.5",
    ),
    FieldRule(
        "transform_truncate_floor", lambda v, _: finite(v) and 0 < v < 1,
        "must be in (0, 1) (a floor far below the weights, which are 1 on-policy: a floor >= 1 would replace "
        "them)", "the default is 1e-6",
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
    FieldRule(
        "delta_lambda_min",
        lambda v, c: finite(v) and (not finite(c.delta_lambda_max) or 0 < v <= c.delta_lambda_max),
        lambda _, c: f"with delta_lambda_max={c.delta_lambda_max!r} must be a finite number with "
        "0 < delta_lambda_min <= delta_lambda_max (the weights multiply advantages and must stay positive)",
        "the paper uses 0.8 and 1.2",
    ),
    FieldRule("delta_lambda_max", lambda v, _: finite(v), "must be a finite number", "the paper uses 0.8 and 1.2"),
    FieldRule(
        "delta_refine_steps", lambda v, _: integer(v) and v >= 0, "must be an integer >= 0", "the paper uses 1"
    ),
    FieldRule(
        "delta_gamma", lambda v, _: v in GAMMA_RULES or finite(v) and v > 0, _gamma_rule,
        "use 'std' (the authors' released code, the default), 'mean_abs' (the former rule) or a fixed number > 0",
    ),
    FieldRule("delta_gamma_update", one_of(GAMMA_UPDATES), "is not valid", f"use {quoted(GAMMA_UPDATES)}"),
    FieldRule("delta_zero_advantage", one_of(ZERO_ADVANTAGE_RULES), "is not valid",
              f"use {quoted(ZERO_ADVANTAGE_RULES)}"),
    FieldRule("delta_scope", one_of(SCOPES), "is not valid", f"use {quoted(SCOPES)}"),
    FieldRule("delta_assignment", one_of(("soft", "hard")), "is not valid", "use 'soft' or 'hard'"),
    FieldRule("delta_contrast", one_of(("opposite", "within")), "is not valid", "use 'opposite' or 'within'"),
)


def read_delta_gamma(gamma: Any) -> Any:
    """A fixed delta_gamma given as a numeric string (the command line) or an int becomes a float."""
    if isinstance(gamma, str) and gamma not in GAMMA_RULES:
        try:
            return float(gamma)
        except ValueError:
            return gamma
    if integer(gamma):
        return float(gamma)
    return gamma


def check_fields(config: DFPOConfig) -> None:
    """Every field's rule, all problems reported at once (the rules between fields come after, in
    :mod:`dfpo_trl.config_combinations`)."""
    problems = [p for rule in FIELD_RULES if (p := rule.problem(config)) is not None]
    if problems:
        raise ValueError("invalid value(s): " + " | ".join(problems) + ".")
