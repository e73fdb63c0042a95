"""DelTA's options and their one rule each (:data:`DELTA_RULES`), under ``DFPOConfig``'s field names: the config
checks them once when it is built (:mod:`dfpo_trl.config.checks`), and DelTA's public functions
(:mod:`dfpo_trl.delta.weights`) apply the same rules to their keyword arguments. Standard library only.
"""

from __future__ import annotations

from typing import Any

from .options import ASSIGNMENTS, CONTRASTS, GAMMA_RULES, GAMMA_UPDATES, SCOPES, ZERO_ADVANTAGE_RULES
from .rules import FieldRule, finite, integer, one_of, quoted

__all__ = [
    "DELTA_GAMMA_DEFAULT",
    "DELTA_LAMBDA_MAX_DEFAULT",
    "DELTA_LAMBDA_MIN_DEFAULT",
    "DELTA_REFINE_STEPS_DEFAULT",
    "DELTA_RULES",
    "read_gamma",
]

#: DelTA's defaults (the authors' released code), here once: ``DFPOConfig``'s ``delta_lambda_min``,
#: ``delta_lambda_max``, ``delta_refine_steps`` and ``delta_gamma`` and the math of ``delta/weights.py`` both read them.
DELTA_LAMBDA_MIN_DEFAULT: float = 0.8
DELTA_LAMBDA_MAX_DEFAULT: float = 1.2
DELTA_REFINE_STEPS_DEFAULT: int = 1
DELTA_GAMMA_DEFAULT: str = "std"


def read_gamma(gamma: Any) -> Any:
    """A fixed ``delta_gamma`` given as a numeric string (the command line) or an int becomes a float.

    Args:
        gamma: ``delta_gamma`` as given (a rule's name, a number, or a numeric string).

    Returns:
        The rule's name, or the fixed γ as a float (anything else unchanged, for the rule to refuse).
    """
    if isinstance(gamma, str) and gamma not in GAMMA_RULES:
        try:
            return float(gamma)
        except ValueError:
            return gamma
    if integer(gamma):
        return float(gamma)
    return gamma


def _gamma_rule(value: Any, _: Any) -> str:
    if value is None:
        return "is no longer accepted (it meant the adaptive mean-|margin| gamma)"
    return "is not valid: it must be 'std', 'mean_abs' or a finite number > 0 (a fixed gamma)"


#: DelTA's options and their one rule each, under the config's field names; DelTA's functions take the same
#: options as keyword arguments without the ``delta_`` prefix and apply these rules to them.
DELTA_RULES: tuple[FieldRule, ...] = (
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
    FieldRule("delta_assignment", one_of(ASSIGNMENTS), "is not valid", f"use {quoted(ASSIGNMENTS)}"),
    FieldRule("delta_contrast", one_of(CONTRASTS), "is not valid", f"use {quoted(CONTRASTS)}"),
)
