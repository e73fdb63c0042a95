"""The registry of in-group transforms: the built-ins and what users add with :func:`register_transform`.

Each entry (:class:`GroupTransform`) carries the properties the objective, the config checks and the metrics read:
its balance condition (:data:`BALANCE_CONDITIONS`), whether its weights stay non-negative, and its balanced form on
the clip survivors for ``cancellation_target="gradient"``. The built-ins' math, with the numerics every transform
shares (sanitised weights, advantages scaled by the group's max, float32 or float64, w's dtype out), is in
:mod:`dfpo_trl.transforms.builtins`, re-exported here; a registered function gets the same numerics around it
(docs/source/guides/custom_transform.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..precision import compute_dtype as _compute_dtype
from .builtins import (
    W_MAX,
    _check_groups,
    _sanitize_weights,
    _to_output,
    min_replace,
    min_replace_on_subset,
    orth_proj,
    positive_orth_proj,
    scale,
    truncate_rebalance,
)
from .entry import (
    BALANCE_CONDITIONS,
    BALANCE_EQUAL,
    BALANCE_NONE,
    BALANCE_ZERO_SUM,
    GroupFunction,
    GroupTransform,
    SubsetBalance,
)
from .probe import probe_problem

__all__ = [
    "BALANCE_CONDITIONS",
    "BALANCE_EQUAL",
    "BALANCE_NONE",
    "BALANCE_ZERO_SUM",
    "GROUP_TRANSFORMS",
    "TRANSFORMS",
    "GroupFunction",
    "GroupTransform",
    "SubsetBalance",
    "W_MAX",
    "balancing_transforms",
    "get_transform",
    "min_replace",
    "min_replace_on_subset",
    "not_retargetable",
    "orth_proj",
    "positive_orth_proj",
    "register_transform",
    "registered_transforms",
    "scale",
    "truncate_rebalance",
    "unregister_transform",
]

# --------------------------------------------------------------------------------------------------
# The registry: built-in and user-registered transforms (docs/source/guides/custom_transform.md)
# --------------------------------------------------------------------------------------------------

def _identity(w: torch.Tensor, advantages: torch.Tensor, _scale: float, _floor: float) -> torch.Tensor:
    _check_groups(w, advantages)
    return w  # no sanitization: GSPO exactly


_BUILTINS: dict[str, GroupTransform] = {
    t.name: t
    for t in (
        GroupTransform("none", _identity, BALANCE_NONE, "GSPO, eq. 49", builtin=True),
        GroupTransform("min_replace", lambda w, a, _s, _f: min_replace(w, a), BALANCE_EQUAL, "eq. 50",
                       subset_balance=min_replace_on_subset, builtin=True),
        GroupTransform("orth_proj", lambda w, a, _s, _f: orth_proj(w, a), BALANCE_ZERO_SUM, "eq. 18",
                       nonnegative=False, builtin=True),
        GroupTransform("positive_orth_proj", lambda w, a, _s, _f: positive_orth_proj(w, a), BALANCE_ZERO_SUM,
                       "exact QP of eq. 51", builtin=True),
        GroupTransform("truncate_rebalance", lambda w, a, _s, floor: truncate_rebalance(w, a, floor=floor),
                       BALANCE_ZERO_SUM, "eq. 52-55", builtin=True),
        GroupTransform("scale", lambda w, a, factor, _f: scale(w, a, factor=factor), BALANCE_NONE,
                       "Table 3 ablation", builtin=True),
    )
}
#: The one registry of transforms, built-in and registered (:func:`register_transform`): config validation, the
#: objective plan, the CLI help and the tests read it when they run, never a copy taken at import.
TRANSFORMS: dict[str, GroupTransform] = dict(_BUILTINS)
#: The built-in names, in the order the docs list them (the registry now: :func:`registered_transforms`).
GROUP_TRANSFORMS: tuple[str, ...] = tuple(_BUILTINS)


def balancing_transforms() -> tuple[str, ...]:
    """The registered transforms (built-in or not) that ``cancellation_target="gradient"`` can retarget, now."""
    return tuple(name for name, entry in TRANSFORMS.items() if entry.retargetable)


def not_retargetable(transform: GroupTransform) -> str:
    """Why ``cancellation_target="gradient"`` cannot use ``transform``, and what to set instead.

    Args:
        transform: a registry entry whose :attr:`~GroupTransform.retargetable` is False.

    Returns:
        The message, naming the transforms that can be retargeted now.
    """
    names = ", ".join(repr(n) for n in balancing_transforms())
    head = (f"cancellation_target='gradient' retargets a transform's balance condition, but group_transform="
            f"{transform.name!r}")
    if transform.balances:  # "equal" without its balanced form on the clip survivors
        return (f"{head} declares balances={transform.balance!r} without a subset_balance, the balanced form on the "
                "clip survivors that the gradient target needs; register one "
                f"(docs/source/guides/custom_transform.md) or use one of {names}.")
    return f"{head} has none; use one of {names}."


def registered_transforms() -> tuple[str, ...]:
    """Every name ``group_transform`` accepts now: the built-ins, then the registered ones in registration order."""
    return tuple(TRANSFORMS)


def get_transform(transform: str | GroupTransform) -> GroupTransform:
    """The registry entry of ``transform``: a registered name, or an entry, returned as it is.

    Args:
        transform: a registered name or a :class:`GroupTransform`.

    Returns:
        The entry; its ``apply(w, Â, scale_factor, truncate_floor)`` maps (num_groups, G) to (num_groups, G).
    """
    if isinstance(transform, GroupTransform):
        return transform
    entry = TRANSFORMS.get(transform) if isinstance(transform, str) else None
    if entry is None:
        raise ValueError(
            f"unknown group transform name={transform!r}; valid names: {', '.join(registered_transforms())} "
            "(register others with dfpo_trl.register_transform)"
        )
    return entry


def register_transform(
    name: str,
    fn: GroupFunction | None = None,
    *,
    balances: str,
    nonnegative: bool = True,
    subset_balance: SubsetBalance | None = None,
    source: str | None = None,
    replace: bool = False,
    check: bool = True,
) -> GroupFunction | Callable[[GroupFunction], GroupFunction]:
    """Register ``fn(w, advantages) -> s̃`` as the in-group transform ``name`` (docs/source/guides/custom_transform.md);
    returns ``fn``.

    A decorator (``@register_transform("name", balances="zero_sum")``) or a call (``register_transform("name", fn,
    balances=...)``). ``fn`` gets both (num_groups, G) tensors as the built-ins do after their sanitisation: w with
    NaN/±Inf replaced and clamped to ±:data:`W_MAX`, Â with NaN → 0, both float32 (float64 when an input is), and
    its result is cast back to w's dtype. It runs under stop-gradient (differentiated only by the
    ``transform_stop_gradient=False`` ablation), so it must be built from torch ops, with no host synchronisation.

    ``balances`` is the condition ``fn`` guarantees, one of :data:`BALANCE_CONDITIONS`: ``"none"``,
    ``"zero_sum"`` (Σ_i Â_i s̃_i = 0 for any two-sided Â) or ``"equal"`` (one weight per group). ``nonnegative``:
    s̃ ≥ 0 whenever w > 0. ``subset_balance``: the balanced form on the clip survivors for
    ``cancellation_target="gradient"`` (needed there by ``"equal"``). ``replace=True`` replaces a registered name
    or a built-in (:func:`unregister_transform` restores it). ``check`` runs ``fn`` once on a probe batch and
    refuses a declared property it breaks there; the ``transform/orth_residual`` metric shows the rest.
    """
    if fn is None:
        return lambda f: register_transform(
            name, f, balances=balances, nonnegative=nonnegative, subset_balance=subset_balance, source=source,
            replace=replace, check=check,
        )
    _check_name(name, replace)
    if not callable(fn):
        raise TypeError(f"register_transform({name!r}, fn): fn must be callable (w, advantages) -> weights, got "
                        f"{type(fn).__name__}")
    entry = GroupTransform(
        name, _user_apply(name, fn), balances, source or f"registered: {_qualified(fn)}", nonnegative,
        None if subset_balance is None else _user_subset(name, subset_balance),
    )
    _check_properties(entry, subset_balance)
    if check:
        problem = probe_problem(entry)
        if problem is not None:
            raise ValueError(f"register_transform({name!r}): {problem}")
    TRANSFORMS[name] = entry
    return fn


def unregister_transform(name: str) -> None:
    """Remove the registered transform ``name``; a built-in it replaced comes back. Built-ins stay."""
    entry = TRANSFORMS.get(name)
    if entry is None:
        raise ValueError(f"unregister_transform({name!r}): no such transform; registered: "
                         f"{', '.join(registered_transforms())}")
    if entry.builtin:
        raise ValueError(f"unregister_transform({name!r}): {name!r} is built in and cannot be removed")
    if name in _BUILTINS:
        TRANSFORMS[name] = _BUILTINS[name]
    else:
        del TRANSFORMS[name]


def _qualified(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _check_name(name: Any, replace: bool) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"register_transform: name={name!r} is not a valid name; use a Python identifier such as "
            "'median_rebalance' (it is what group_transform and --group_transform take)"
        )
    if name == "none":
        raise ValueError("register_transform: 'none' is GSPO itself (no rewrite of the loss) and cannot be replaced; "
                         "choose another name")
    existing = TRANSFORMS.get(name)
    if existing is not None and not replace:
        what = "a built-in transform" if existing.builtin else f"already registered ({existing.source})"
        raise ValueError(
            f"register_transform: {name!r} is {what}; pass replace=True to replace it (unregister_transform "
            f"restores a built-in), or choose another name"
        )


def _check_properties(entry: GroupTransform, subset_balance: Any) -> None:
    name = entry.name
    if not isinstance(entry.balance, str) or entry.balance not in BALANCE_CONDITIONS:
        raise ValueError(
            f"register_transform({name!r}): balances={entry.balance!r} is not a balance condition; use 'zero_sum' "
            "(sum_i A_i w_i = 0 for any two-sided advantages), 'equal' (one weight per group, balanced because "
            "the advantages are centred) or 'none' (no condition)"
        )
    if not isinstance(entry.nonnegative, bool):
        raise ValueError(f"register_transform({name!r}): nonnegative={entry.nonnegative!r} must be True or False")
    if subset_balance is not None and not callable(subset_balance):
        raise TypeError(f"register_transform({name!r}): subset_balance must be callable (w, a, members) -> "
                        f"weights, got {type(subset_balance).__name__}")
    if subset_balance is not None and not entry.balances:
        raise ValueError(
            f"register_transform({name!r}): subset_balance is the balanced form for cancellation_target="
            "'gradient', but balances='none' declares no balance; declare the condition or drop subset_balance"
        )


def _check_output(name: str, out: Any, w: torch.Tensor) -> None:
    """A registered function's result: a floating tensor of w's shape on w's device (no silent copies)."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise TypeError(f"group transform {name!r} must return a floating-point tensor, got "
                        f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__}")
    if out.shape != w.shape or out.device != w.device:
        raise ValueError(
            f"group transform {name!r} returned shape {tuple(out.shape)} on {out.device} for w of shape "
            f"{tuple(w.shape)} on {w.device}; it must return one weight per member, shaped (num_groups, G) like w, "
            "on w's device"
        )


def _user_apply(name: str, fn: GroupFunction) -> Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]:
    """``fn`` with the built-ins' numerics around it (module docstring): sanitised inputs, w's dtype out."""

    def apply(w: torch.Tensor, advantages: torch.Tensor, _scale: float, _floor: float) -> torch.Tensor:
        _check_groups(w, advantages)
        dtype = _compute_dtype(w, advantages)
        out = fn(_sanitize_weights(w, dtype), torch.nan_to_num(advantages.to(dtype), nan=0.0))
        _check_output(name, out, w)
        return _to_output(out, w.dtype)

    return apply


def _user_subset(name: str, fn: SubsetBalance) -> SubsetBalance:
    def subset(w: torch.Tensor, a: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        _check_groups(w, a)
        dtype = _compute_dtype(w, a)
        out = fn(_sanitize_weights(w, dtype), torch.nan_to_num(a.to(dtype), nan=0.0), members)
        _check_output(f"{name}.subset_balance", out, w)
        return _to_output(out, w.dtype)

    return subset
