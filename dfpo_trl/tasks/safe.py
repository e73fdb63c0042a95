"""Reward functions whose failures name the function and the completion that made them fail (``safe_reward``).

Reward functions follow TRL's convention ``f(prompts, completions, **kwargs) -> list[float | None]`` (``None``: not
applicable, becomes NaN in TRL). The built-in ones are callable class instances rather than closures because TRL's
asynchronous rollout workers pickle them; so are the wrappers here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from .base import RewardFunc


def _one(prompts: list[Any], completions: list[Any], kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """The reward call's arguments for completion ``i`` alone: per-completion lists cut to one entry."""
    n = len(completions)
    sliced = {
        key: value[i : i + 1] if isinstance(value, (list, tuple)) and len(value) == n else value
        for key, value in kwargs.items()
    }
    return {"prompts": prompts[i : i + 1], "completions": completions[i : i + 1], **sliced}


def _error(name: str, where: str, exc: BaseException) -> RuntimeError:
    return RuntimeError(f"reward function '{name}' failed on {where}: {exc}")


class SafeReward:
    """A reward function whose exceptions name the function and the completion index.

    TRL calls rewards on a whole batch, so a bare ``KeyError`` from deep inside a user's parser says
    nothing about which of the B*G completions caused it. On failure (only then, so the normal path costs
    nothing) the batch is re-run one completion at a time to find the first failing index. Picklable
    when the wrapped function is, as TRL's asynchronous rollout workers require.
    """

    def __init__(self, func: RewardFunc, name: str | None = None) -> None:
        self.func = func
        self.__name__ = name or _callable_name(func)
        functools.update_wrapper(self, func, assigned=("__doc__", "__module__", "__qualname__"), updated=())

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        try:
            return self.func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with context below
            for i in range(len(completions)):
                try:
                    self.func(**_one(prompts, completions, kwargs, i))
                except Exception as item_exc:  # noqa: BLE001
                    raise _error(self.__name__, f"completion {i}", item_exc) from item_exc
            raise _error(self.__name__, f"a batch of {len(completions)} completions", exc) from exc

    def __repr__(self) -> str:
        return f"SafeReward({self.__name__})"


class AsyncSafeReward(SafeReward):
    """:class:`SafeReward` for ``async`` reward functions (TRL gathers those concurrently)."""

    async def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        try:
            return await self.func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with context below
            for i in range(len(completions)):
                try:
                    await self.func(**_one(prompts, completions, kwargs, i))
                except Exception as item_exc:  # noqa: BLE001
                    raise _error(self.__name__, f"completion {i}", item_exc) from item_exc
            raise _error(self.__name__, f"a batch of {len(completions)} completions", exc) from exc


def _callable_name(func: Callable[..., Any]) -> str:
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: Callable[..., Any]) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def safe_reward(func: RewardFunc, name: str | None = None) -> SafeReward:
    """Wrap ``func`` so an exception at completion ``i`` re-raises as
    ``RuntimeError("reward function '<name>' failed on completion <i>: <exc>")`` chained to the original.

    Idempotent; keeps ``__name__`` (TRL logs rewards under it) and async-ness (TRL awaits async ones).
    """
    if isinstance(func, SafeReward):
        return func
    return (AsyncSafeReward if _is_async(func) else SafeReward)(func, name)
