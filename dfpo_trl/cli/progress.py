"""The progress bar of a run: steps, ETA, the latest reward and entropy, and the rollout's generation progress."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.trainer_callback import ProgressCallback

__all__ = [
    "DFPOProgressCallback", "GenerationProgress", "RolloutRateBar", "close_progress_bar", "elapsed_line",
    "rollout_period", "rollout_rate", "use_dfpo_progress_bar",
]  # fmt: skip

# Logged keys shown in the progress bar's postfix, with their short names, when present.
POSTFIX_KEYS = (
    ("step_reward", "reward"),
    ("reward", "reward"),
    ("entropy", "entropy"),
    ("transform/phi_min", "phi_min"),
    ("cancellation/shared_prefix_residual", "shared_res"),
    ("heldout/accuracy", "heldout"),  # the latest held-out accuracy, with eval_every
)


class GenerationProgress(LogitsProcessor):
    """Counts one ``generate`` call's decoding steps and finished completions, and reports them each step.

    A logits processor is the one hook ``generate`` calls at every new token, whatever calls ``generate`` (TRL's
    rollout included); it returns the scores unchanged, so sampling is untouched. ``report(done, total, token,
    max_new_tokens)``: completions that have emitted an end-of-sequence token, completions in the call, the token
    being generated (1-based) and the most the call generates. Counting the finished ones reads the device once
    per token, as ``generate``'s own stopping check already does.
    """

    def __init__(
        self,
        report: Callable[[int, int, int, int], None],
        prompt_length: int,
        max_new_tokens: int,
        eos_token_ids: list[int],
    ) -> None:
        self.report = report
        self.prompt_length = prompt_length
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = eos_token_ids
        self.token = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.token += 1
        generated = input_ids[:, self.prompt_length :]
        done = 0
        if self.eos_token_ids and generated.numel():
            eos = torch.tensor(self.eos_token_ids, device=generated.device)
            done = int(torch.isin(generated, eos).any(dim=1).sum())
        self.report(done, input_ids.size(0), self.token, self.max_new_tokens)
        return scores


def rollout_period(args: Any) -> int:
    """Optimizer steps per rollout: TRL generates every ``steps_per_generation × num_iterations`` micro-steps, and an
    optimizer step is ``gradient_accumulation_steps`` of them."""
    accumulation = max(int(args.gradient_accumulation_steps or 1), 1)
    per_generation = int(getattr(args, "steps_per_generation", None) or accumulation)
    return max(per_generation * int(getattr(args, "num_iterations", 1) or 1) // accumulation, 1)


def rollout_rate(step_ends: list[float], start: float, period: int) -> float | None:
    """Optimizer steps per second over the whole rollout periods done (``step_ends[i]``: when step i + 1 ended),
    or None before the first period ends. A period's first step generates (minutes on a CPU) and the others only
    train: the rate of the first step alone, or of a period's first part, would put the end far too late (11:41
    for a 5-minute job) and then hurry towards it."""
    whole = len(step_ends) // period * period
    if whole == 0 or step_ends[whole - 1] <= start:
        return None
    return whole / (step_ends[whole - 1] - start)


class RolloutRateBar(tqdm):
    """tqdm whose rate (and so its ETA) is :attr:`steps_per_second`, set from whole rollout periods; "?" while
    None."""

    steps_per_second: float | None = None

    @property
    def format_dict(self) -> dict[str, Any]:
        values = super().format_dict
        values["rate"] = self.steps_per_second or 0  # tqdm prints "?" for the time left and the rate when it is 0
        return values


class DFPOProgressCallback(ProgressCallback):
    """transformers' progress bar (steps, elapsed, ETA) with the latest reward and entropy in its postfix, and the
    rollout's generation progress in its description while the policy generates.

    Unlike the stock bar it does not print every log dictionary: the metrics are in ``trainer.state.log_history``,
    the ``report_to`` backends and the PNG. Generation (TRL's rollout with transformers' ``generate``; vLLM's
    generation runs elsewhere and is not followed) is seen through the model's ``generate``, wrapped for the
    duration of ``train()`` to add a :class:`GenerationProgress`: on a CPU the first rollout takes minutes before
    the first step, and the bar then says ``generating: token 9/16, 23/64 completions done``.
    """

    refresh_seconds = 0.2  # the least time between two redraws of the generation progress

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # ProgressCallback's bar (total: max_steps), whose time left is estimated from whole rollout periods.
        if state.is_world_process_zero:
            self.training_bar = RolloutRateBar(total=state.max_steps, dynamic_ncols=True)
        self.current_step = 0
        self._period = rollout_period(args)
        self._start = time.monotonic()
        self._step_ends: list[float] = []
        self.postfix: dict[str, str] = {}
        self._last_draw = 0.0
        self._generating_model = None
        model = kwargs.get("model")
        if state.is_world_process_zero and model is not None and callable(getattr(model, "generate", None)):
            self._follow_generation(model)

    def _follow_generation(self, model: Any) -> None:
        """Wrap ``model.generate`` (an instance attribute over the class's method, removed at train end) so that
        each call made while the bar is open reports its progress."""
        original = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if self.training_bar is None or not isinstance(input_ids, torch.Tensor):
                return original(*args, **kwargs)
            config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
            prompt_length = input_ids.size(-1)
            # a call's own max_new_tokens (the held-out evaluation passes it) over the generation config's
            max_new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
            if max_new is None:
                max_new = max(int(getattr(config, "max_length", 0) or 0) - prompt_length, 0)
            eos = getattr(config, "eos_token_id", None)
            eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
            # greedy decoding is the held-out evaluation (eval_every); TRL's rollout samples
            self._generation_label = "held-out evaluation" if kwargs.get("do_sample") is False else "generating"
            counter = GenerationProgress(self.show_generation, prompt_length, max_new, eos_ids)
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(counter)
            try:
                return original(*args, logits_processor=processors, **kwargs)
            finally:
                if self.training_bar is not None:
                    self.training_bar.set_description_str("", refresh=True)

        model.generate = generate
        self._generating_model = model

    def show_generation(self, done: int, total: int, token: int, max_new_tokens: int) -> None:
        """Put the generation's progress in the bar's description (redrawn at most every ``refresh_seconds``)."""
        if self.training_bar is None:
            return
        now = time.monotonic()
        if token > 1 and now - self._last_draw < self.refresh_seconds:
            return
        self._last_draw = now
        label = getattr(self, "_generation_label", "generating")
        text = f"{label}: token {token}/{max_new_tokens}, {done}/{total} completions done"
        self.training_bar.set_description_str(text, refresh=True)

    def _stop_following_generation(self) -> None:
        model, self._generating_model = getattr(self, "_generating_model", None), None
        if model is not None and "generate" in vars(model):
            del model.generate  # the class's own method again

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if isinstance(self.training_bar, RolloutRateBar):
            self._step_ends.append(time.monotonic())
            self.training_bar.steps_per_second = rollout_rate(self._step_ends, self._start, self._period)
        super().on_step_end(args, state, control, **kwargs)
        # Close the bar at the last step, so what on_train_end prints (held-out accuracy) starts on its own line.
        if state.is_world_process_zero and self.training_bar is not None and state.global_step >= state.max_steps:
            self.training_bar.close()
            self.training_bar = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_following_generation()
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        # Some keys are logged once per rollout (every steps_per_generation steps): keep the latest of each. The
        # first present key of a short name wins (step_reward over TRL's per-rollout reward).
        fresh: dict[str, str] = {}
        for key, short in POSTFIX_KEYS:
            if short not in fresh and isinstance(logs.get(key), (int, float)):
                fresh[short] = f"{logs[key]:.3g}"
        if fresh:
            self.postfix.update(fresh)
            self.training_bar.set_postfix(self.postfix, refresh=True)


def use_dfpo_progress_bar(trainer: Any) -> None:
    """Swap the trainer's stock progress bar for :class:`DFPOProgressCallback` (no-op with ``disable_tqdm``)."""
    if trainer.args.disable_tqdm:
        return
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(DFPOProgressCallback())


def close_progress_bar(trainer: Any) -> None:
    """End the progress bar's line, so that what follows starts on its own."""
    for callback in trainer.callback_handler.callbacks:
        bar = getattr(callback, "training_bar", None) if isinstance(callback, ProgressCallback) else None
        if bar is not None:
            bar.close()
            callback.training_bar = None


@contextmanager
def elapsed_line(text: str, enabled: bool = True, every: float = 1.0) -> Iterator[None]:
    """While the block runs, one line redrawn in place every ``every`` seconds, ``text`` and the time it has taken
    (``converting ...: 00:12``): for a phase without a progress of its own (the embedded model's conversion, whose
    library bars are off), so that the first screen never sits silent. Off with ``enabled`` False (``disable_tqdm``,
    or a process other than the first)."""
    if not enabled:
        yield
        return
    bar = tqdm(total=None, desc=text, bar_format="{desc}: {elapsed}", dynamic_ncols=True)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every):
            bar.refresh()

    thread = threading.Thread(target=tick, name="dfpo-elapsed-line", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()

