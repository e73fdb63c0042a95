"""The one step timer of the benchmarks: wall time of every optimizer step, CUDA synchronised at both ends, with the
time spent inside the trainer calls a script wraps (rollout, generation, weight sync) as that step's parts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a wall-clock reading covers it (nothing on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepClock(TrainerCallback):
    """Per optimizer step after ``warmup`` steps: ``{"total_s": wall time, <part>: seconds in the wrapped calls}``.

    ``timed(part, call)`` wraps a bound method (set it back on the trainer); a part never called in a step is absent
    from that step's record."""

    def __init__(self, warmup: int = 0) -> None:
        self.warmup = warmup
        self.steps: list[dict[str, float]] = []
        self._start = 0.0
        self._parts: dict[str, float] = {}

    def timed(self, part: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            synchronize()
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                synchronize()
                self._parts[part] = self._parts.get(part, 0.0) + time.perf_counter() - start
        return run

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        synchronize()
        self._parts = {}
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        synchronize()
        total = time.perf_counter() - self._start
        if state.global_step > self.warmup:
            self.steps.append({"total_s": total, **self._parts})
