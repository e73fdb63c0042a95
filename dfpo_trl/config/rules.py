"""The shape of a validation rule (:class:`FieldRule`) and its small predicates, shared by the modules that own a
field's rule: :mod:`dfpo_trl.config.checks` (DFPO's fields), :mod:`dfpo_trl.config.trl_field_rules` (TRL's) and
:mod:`dfpo_trl.config.delta_rules` (DelTA's). Standard library only, like those two: ``dfpo-train`` reads them before
it imports torch.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Check", "FieldRule", "finite", "integer", "missing_column", "one_of", "optional", "problems", "quoted",
    "transform_fix", "unknown_name",
]  # fmt: skip

Check = Callable[[Any, Any], bool]  # (value, the object holding it) -> whether the value is valid


def finite(x: Any) -> bool:
    """A real number (not a bool) that is neither infinite nor NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def integer(x: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def one_of(choices: tuple[Any, ...]) -> Check:
    """The check that a value is one of ``choices``."""
    return lambda value, _: value in choices


def optional(check: Check) -> Check:
    """``check``, or unset (``None``)."""
    return lambda value, holder: value is None or check(value, holder)


def quoted(choices: tuple[Any, ...], last: str = " or ") -> str:
    """``'a', 'b' or 'c'`` (``last=", "``: ``'a', 'b', 'c'``): how messages list an option's values."""
    *names, final = [repr(c) for c in choices]
    return ", ".join(names) + last + final if names else final


@dataclass(frozen=True)
class FieldRule:
    """The rule of one field: ``check(value, holder)``, else the message ``{field}={value!r} {rule}; {fix}``
    (``rule`` and ``fix`` may depend on the value and the object holding it, or on what is registered when it runs).
    """

    field: str
    check: Check
    rule: str | Callable[[Any, Any], str]
    fix: str | Callable[[Any, Any], str]

    def problem(self, holder: Any) -> str | None:
        """The message for ``holder``'s value of the field, None when the value is valid.

        Args:
            holder: the object with the field as an attribute (a ``DFPOConfig``, or the options of a function).

        Returns:
            ``"{field}={value!r} {rule}; {fix}"``, or None.
        """
        value = getattr(holder, self.field)
        if self.check(value, holder):
            return None
        rule = self.rule(value, holder) if callable(self.rule) else self.rule
        fix = self.fix(value, holder) if callable(self.fix) else self.fix
        return f"{self.field}={value!r} {rule}; {fix}"


def problems(rules: tuple[FieldRule, ...], holder: Any) -> list[str]:
    """Every rule's message for ``holder``, in the rules' order (all problems at once).

    Args:
        rules: the rules to apply.
        holder: the object whose fields they check.

    Returns:
        The messages of the broken rules (empty when every value is valid).
    """
    return [p for rule in rules if (p := rule.problem(holder)) is not None]


def unknown_name(head: str, name: str, known: Iterable[str], path_form: str) -> str:
    """The message for a name no registry holds (a task, a reward): the registered names, the import-path form that
    also works, and the closest name. Shared by the registries and ``dfpo-train``'s checks before torch."""
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{head}: {names}, or an import path '{path_form}'.{hint}"


def transform_fix(names: Iterable[str]) -> str:
    """What to do about a ``group_transform`` no registry holds: DFPOConfig's rule and ``dfpo-train``'s check before
    torch (which reads the built-in names from its stored table) say it in these words."""
    return (
        f"use one of {quoted(tuple(names), ', ')}, or register the transform first with "
        "dfpo_trl.register_transform (in dfpo-train: --plugins MODULE, docs/source/guides/custom_transform.md)"
    )


def missing_column(column: str, field: str, available: Iterable[str]) -> str:
    """A ``math`` dataset without the column a field names: the math task's refusal after loading it, and
    ``dfpo-train``'s before torch (from the dataset's own files), in the same words, with the flag as it is spelt."""
    return (
        f"math task: column {column!r} not found; available columns: {list(available)}; set {field} (CLI: --{field}) "
        "to the dataset's column"
    )
