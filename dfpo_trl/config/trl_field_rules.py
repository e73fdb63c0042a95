"""The rules of TRL's fields that DFPO relies on (``TRL_FIELD_RULES``, the first part of ``DFPOConfig``'s
``FIELD_RULES``): TRL and transformers accept many bad values silently (a negative clip range, a zero temperature)
and fail, if at all, minutes later inside a rollout or the loss.

Standard library only (like :mod:`dfpo_trl.config.rules`): ``dfpo-train`` checks a command line's values against these
rules before it imports torch, transformers and TRL (``dfpo_trl/cli/values.py``), so a bad value costs a second.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from .rules import Check, FieldRule, finite, integer, optional

__all__ = ["TRL_FIELD_RULES", "launched_processes", "whole_groups_problem"]


def _numeric(name: str, check: Check, rule: str, fix: str, kind: str = "a number") -> FieldRule:
    """A rule on a numeric field whose message says the value must be a number when it is not one (a list, a
    string), that NaN and infinity are not finite numbers (``float("nan")`` is a float: "not a float" said
    nothing), and ``rule`` when it is one out of range."""

    def said(value: Any, _: Any) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            return f"is {'NaN' if math.isnan(value) else 'infinite'}, not a finite number"
        number = integer(value) if kind == "an integer" else finite(value)
        return rule if number or value is None else f"must be {kind}, not a {type(value).__name__}"

    return FieldRule(name, check, said, fix)


def _positive_integer(name: str) -> FieldRule:
    return _numeric(name, lambda v, _: integer(v) and v >= 1, "must be an integer >= 1", f"set {name} >= 1",
                    "an integer")


TRL_FIELD_RULES: tuple[FieldRule, ...] = (
    _numeric(
        "epsilon", lambda v, _: finite(v) and 0 < v <= 1,
        "is out of range: the clip range [1 - epsilon, 1 + epsilon_high] needs 0 < epsilon <= 1",
        "GSPO and DFPO use 3e-4, token-level GRPO 0.2",
    ),
    _numeric(
        "epsilon_high", optional(lambda v, _: finite(v) and v > 0),
        "is out of range: the upper clip bound 1 + epsilon_high needs epsilon_high > 0",
        "GSPO and DFPO use 4e-4, DAPO 0.28, or leave it unset (= epsilon)",
    ),
    _numeric(
        "delta", optional(lambda v, _: finite(v) and v > 1),
        "is out of range: the two-sided clip bound on the ratio must exceed 1 (at 1 or below it clips on-policy "
        "tokens)", "TRL recommends more than 1 + epsilon_high, or leave it unset (None)",
    ),
    _positive_integer("per_device_train_batch_size"),
    _positive_integer("gradient_accumulation_steps"),
    _positive_integer("num_iterations"),
    _numeric(
        "steps_per_generation", optional(lambda v, _: integer(v) and v >= 1),
        "must be an integer >= 1", "set it >= 1, or leave it unset (= gradient_accumulation_steps)", "an integer",
    ),
    _numeric(
        "num_generations", optional(lambda v, _: integer(v) and v >= 2),
        "must be an integer >= 2: a group needs at least 2 completions per prompt for group-relative advantages "
        "and in-group transforms", "set num_generations >= 2", "an integer",
    ),
    _numeric(
        "max_completion_length", optional(lambda v, _: integer(v) and v >= 1),
        "must be an integer >= 1 (tokens per completion)", "e.g. 16 for the arithmetic task", "an integer",
    ),
    _numeric(
        "temperature", lambda v, _: finite(v) and v > 0,
        "must be > 0 (sampling divides the logits by it, and the log-probs use it too)", "use 1.0 or e.g. 0.6",
    ),
    _numeric("top_p", lambda v, _: finite(v) and 0 < v <= 1, "must be in (0, 1]", "use 1.0 to keep all tokens"),
    _numeric("top_k", lambda v, _: integer(v) and v >= 0, "must be >= 0", "use 0 to disable top-k", "an integer"),
    _numeric("beta", lambda v, _: finite(v) and v >= 0, "must be >= 0 (KL coefficient)", "use 0.0 for no KL"),
    _numeric(
        "learning_rate", lambda v, _: finite(v) and v > 0,
        "must be > 0", "e.g. 2e-6 as recipes/smollm2_cpu.yaml (the CPU main job) sets it, 1e-6 for large models",
    ),
)


def whole_groups_problem(values: Mapping[str, Any], processes: int) -> str | None:
    """TRL's rule that a rollout (``generation_batch_size``, here computed as TRL does from the per-device batch,
    the processes and ``steps_per_generation``) holds whole groups of ``num_generations``, said with the fields a
    user sets and the nearest values that fix it; None when it holds or TRL computes it otherwise. The rule's one
    owner, for ``DFPOConfig`` and ``dfpo-train``'s check before torch alike (TRL's bare message named no fix)."""
    batch, generations = values["per_device_train_batch_size"], values["num_generations"]
    steps = values["steps_per_generation"] or values["gradient_accumulation_steps"]
    if values["generation_batch_size"] is not None or not all(
        isinstance(v, int) and v >= 1 for v in (batch, generations, steps)
    ):
        return None
    rollout = batch * processes * steps
    if rollout % generations == 0:
        return None
    step = generations // math.gcd(generations, processes * steps)  # per_device_train_batch_size must be a multiple
    lower, upper = (batch // step) * step, (batch // step + 1) * step
    batches = " or ".join(str(b) for b in (lower, upper) if b >= 1)
    divisors = [d for d in range(2, rollout + 1) if rollout % d == 0]
    near = sorted(divisors, key=lambda d: (abs(d - generations), d))[:2]
    alternative = f", or num_generations to a divisor of {rollout} (e.g. {' or '.join(map(str, sorted(near)))})"
    which = "steps_per_generation" if values["steps_per_generation"] else "gradient_accumulation_steps"
    return (
        f"a rollout of per_device_train_batch_size {batch} x {processes} process{'es' if processes > 1 else ''} x "
        f"{which} {steps} = "
        f"{rollout} completions does not hold whole groups of num_generations {generations} (TRL: "
        f"generation_batch_size must be divisible by num_generations); set per_device_train_batch_size to a "
        f"multiple of {step} (e.g. {batches}){alternative if near else ''}"
    )


def launched_processes() -> int | None:
    """The processes this run is one of: ``WORLD_SIZE`` (set by accelerate launch, torchrun, deepspeed), else 1; None
    when another launcher (Slurm, MPI) started several processes without it: then TRL counts them, not this."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    others = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    return None if any(os.environ.get(name, "1") not in ("", "1") for name in others) else 1
