"""The library's reward wrapper (``safe_reward``): reward functions whose failures name the function and the
completion that made them fail.

Reward functions follow TRL's convention ``f(prompts, completions, **kwargs) -> list[float | None]`` (``None``: not
applicable, becomes NaN in TRL). The built-in ones are callable class instances rather than closures because TRL's
asynchronous rollout workers pickle them; so are the wrappers here.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

from ._usercode import UserCodeError, defined_at, exception_text, user_frame, user_frames

# TRL's reward convention: f(prompts, completions, **columns) -> one float (or None: not applicable) per completion.
RewardFunc = Callable[..., list[float | None]]


def _one(prompts: list[Any], completions: list[Any], kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """The reward call's arguments for completion ``i`` alone: per-completion lists cut to one entry."""
    n = len(completions)
    sliced = {
        key: value[i : i + 1] if isinstance(value, (list, tuple)) and len(value) == n else value
        for key, value in kwargs.items()
    }
    return {"prompts": prompts[i : i + 1], "completions": completions[i : i + 1], **sliced}


class RewardError(UserCodeError):
    """A reward function failed (raised, or returned the wrong number of rewards, or NaN): one line naming the
    function, the user's frame (file:line), what went wrong and the completion, with its group when the trainer
    told the wrapper the group size. :meth:`said` adds the training row when the caller can find it."""

    def __init__(self, name: str, frame: str | None, problem: str, index: int | None = None, count: int = 0,
                 group_size: int | None = None, prompt: Any = None, fix: str = "") -> None:
        self.name, self.frame, self.problem, self.index, self.count = name, frame, problem, index, count
        self.group_size, self.prompt, self.fix = group_size, prompt, fix
        super().__init__(self.said())

    def said(self, row: int | None = None) -> str:
        """The one line; ``row``: the training dataset's row the failing completion's prompt came from."""
        where = f" at {self.frame}" if self.frame else ""
        if self.index is None:
            on = f"on the rollout's batch of {self.count} completions"
        else:
            on = f"on completion {self.index} of the rollout's {self.count}"
            parts = []
            if self.group_size:
                g = self.group_size
                parts.append(f"group {self.index // g}, its completion {self.index % g} of {g}")
            if row is not None:
                parts.append(f"training row {row}")
            on += f" ({'; '.join(parts)})" if parts else ""
        fix = f"; {self.fix}" if self.fix else ""
        return f"reward function {self.name!r}{where}: {self.problem} {on}{fix}"


def _located(exc: BaseException, completions: list[Any]) -> int | None:
    """The completion the user's code held when it raised: a local of one of their frames that *is* one of the
    completions (or the text of one), found without calling the function again."""
    for frame in user_frames(exc):
        values = list(frame.f_locals.values())
        for i, completion in enumerate(completions):
            texts = [completion]
            if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
                texts += [completion[-1], completion[-1].get("content")]
            if any(v is t for v in values for t in texts if t is not None and t != ""):
                return i
    return None


_RETURN_FIX = "return one float per completion, in order (None where the reward does not apply)"


class SafeReward:
    """A reward function whose exceptions and wrong returns name the function, the user's frame and the completion.

    TRL calls rewards on a whole batch, so a bare ``KeyError`` from deep inside a user's parser says
    nothing about which of the B*G completions caused it. On failure (only then, so the normal path costs
    nothing) the completion is the one the user's frame held when it raised, else the first that fails when the
    batch is re-run one completion at a time. A return of the wrong length, or NaN (which TRL would fold into a
    zero reward), is refused the same way. Picklable when the wrapped function is, as TRL's asynchronous rollout
    workers require. ``group_size`` (set by DFPOTrainer: ``num_generations``) lets the message name the group.
    """

    group_size: int | None = None

    def __init__(self, func: RewardFunc, name: str | None = None) -> None:
        self.func = func
        self.__name__ = name or _callable_name(func)
        functools.update_wrapper(self, func, assigned=("__doc__", "__module__", "__qualname__"), updated=())

    def _failed(self, exc: BaseException, i: int | None, prompts: list[Any], n: int) -> RewardError:
        return RewardError(self.__name__, user_frame(exc), f"raised {exception_text(exc)}", i, n, self.group_size,
                           prompts[i] if i is not None and i < len(prompts) else None,
                           "fix the function or drop it from reward_funcs")

    def checked(self, rewards: Any, prompts: list[Any], n: int) -> list[float | None]:
        """``rewards`` when it holds one finite float (or None) per completion, else a :class:`RewardError`."""
        frame = defined_at(self.func)
        try:
            count = len(rewards)
        except TypeError:
            raise RewardError(self.__name__, frame, f"returned a {type(rewards).__name__}, not a list,", None, n,
                              fix=_RETURN_FIX) from None
        if count != n:
            raise RewardError(self.__name__, frame, f"returned {count} rewards for {n} completions,", None, n,
                              fix=_RETURN_FIX)
        for i, value in enumerate(rewards):
            if value is None:
                continue
            try:  # what TRL's torch.tensor(...) takes: a float, an int, a bool, a 0-d tensor or numpy scalar
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number):
                said = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise RewardError(self.__name__, frame, f"returned {said}, not a finite number,", i, n,
                                  self.group_size, prompts[i] if i < len(prompts) else None, _RETURN_FIX)
        return rewards

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        try:
            rewards = self.func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with context below
            self._raise(exc, prompts, completions, kwargs)
        return self.checked(rewards, prompts, len(completions))

    def _raise(self, exc: BaseException, prompts: list[Any], completions: list[Any], kwargs: dict[str, Any]) -> None:
        i = _located(exc, completions)
        if i is not None:
            raise self._failed(exc, i, prompts, len(completions)) from exc
        for i in range(len(completions)):
            try:
                self.func(**_one(prompts, completions, kwargs, i))
            except Exception as item_exc:  # noqa: BLE001
                raise self._failed(item_exc, i, prompts, len(completions)) from item_exc
        raise self._failed(exc, None, prompts, len(completions)) from exc

    def __repr__(self) -> str:
        return f"SafeReward({self.__name__})"


class AsyncSafeReward(SafeReward):
    """:class:`SafeReward` for ``async`` reward functions (TRL gathers those concurrently)."""

    async def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        try:
            rewards = await self.func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with context below
            i = _located(exc, completions)
            if i is not None:
                raise self._failed(exc, i, prompts, len(completions)) from exc
            for i in range(len(completions)):
                try:
                    await self.func(**_one(prompts, completions, kwargs, i))
                except Exception as item_exc:  # noqa: BLE001
                    raise self._failed(item_exc, i, prompts, len(completions)) from item_exc
            raise self._failed(exc, None, prompts, len(completions)) from exc
        return self.checked(rewards, prompts, len(completions))


def _callable_name(func: Callable[..., Any]) -> str:
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: Callable[..., Any]) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def safe_reward(func: RewardFunc, name: str | None = None) -> SafeReward:
    """Wrap ``func`` so an exception at completion ``i`` re-raises as a one-line :class:`RewardError` (a
    RuntimeError) naming the function, the user's frame, the exception and completion ``i``, chained to the original;
    a return of the wrong length or a NaN is refused alike.

    Idempotent; keeps ``__name__`` (TRL logs rewards under it) and async-ness (TRL awaits async ones).
    """
    if isinstance(func, SafeReward):
        return func
    return (AsyncSafeReward if _is_async(func) else SafeReward)(func, name)
