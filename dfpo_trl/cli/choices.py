"""The closed options of ``dfpo-train``'s fields (a value from a fixed list): matched without regard to case, ``-`` or
``_``, and a misspelt one refused with the nearest value (docs/source/guides/cli.md, "What it refuses, and how").

A YAML recipe's ``group_transform: MIN_REPLACE`` or ``lr_scheduler_type: Cosine`` means the one option it can mean,
so it is read as ``min_replace`` and ``cosine``; ``min_replase`` means nothing and is refused with "did you mean
'min_replace'?". The options: every field argparse knows a list for (DFPO's ``Literal`` fields, transformers'
``Enum`` ones), the transforms registered (``group_transform``), and the values TRL 1.16 documents for its own string
fields (:data:`TRL_STRING_OPTIONS`), which its parser takes as free text. Only the command line reads them:
``DFPOConfig`` in Python keeps exact names (a typo in code is refused, with the nearest name). Standard library only.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["TRL_STRING_OPTIONS", "canonical", "choice_problem", "did_you_mean", "set_flag_value", "spelling"]

# The values TRL 1.16's GRPOConfig documents for string fields its parser takes as free text (their help texts).
TRL_STRING_OPTIONS: dict[str, tuple[str, ...]] = {
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "importance_sampling_level": ("token", "sequence"),
    "vllm_mode": ("server", "colocate"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
}


def spelling(value: Any) -> str:
    """How two spellings of an option compare: without case, surrounding spaces, or ``-`` against ``_``."""
    return str(value).strip().lower().replace("-", "_")


def canonical(value: Any, options: Iterable[Any]) -> str | None:
    """The option ``value`` names (itself, or the one option it matches by :func:`spelling`), else None."""
    names = [str(o) for o in options]
    if str(value) in names:
        return str(value)
    matches = [o for o in names if spelling(o) == spelling(value)]
    return matches[0] if len(matches) == 1 else None


def did_you_mean(value: Any, options: Iterable[Any]) -> str:
    """``" Did you mean 'x'?"`` for the option nearest to ``value`` (difflib, by :func:`spelling`), else ""."""
    names = {spelling(o): str(o) for o in options}
    close = difflib.get_close_matches(spelling(value), list(names), n=1, cutoff=0.6)
    return f" Did you mean {names[close[0]]!r}?" if close else ""


def choice_problem(name: str, value: Any, options: Sequence[Any]) -> str:
    """The refusal of a value that is none of ``name``'s options: the options and the nearest one."""
    listed = ", ".join(repr(str(o)) for o in options)
    return f"{name}={value!r} is not one of its values ({listed}).{did_you_mean(value, options)}"


def set_flag_value(flags: list[str], option_strings: Sequence[str], value: str) -> None:
    """Replace, in place, the value the last of ``option_strings`` gives on the command line ``flags``
    (``--name value`` or ``--name=value``) with ``value``."""
    for i in range(len(flags) - 1, -1, -1):
        flag, equals, _ = flags[i].partition("=")
        if flag in option_strings:
            if equals:
                flags[i] = f"{flag}={value}"
            elif i + 1 < len(flags):
                flags[i + 1] = value
            return
