"""Trainer callbacks of the main job: held-out accuracy, reward-curve metrics, a progress bar with the reward.

All three work with any ``transformers.Trainer`` (so with ``DFPOTrainer`` and TRL's ``GRPOTrainer``) and only
read what the trainer already logs; ``report_to`` backends are untouched.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from . import metrics

logger = logging.getLogger(__name__)

__all__ = [
    "CurveMetricsCallback",
    "DFPOProgressCallback",
    "HeldoutAccuracyCallback",
    "use_dfpo_progress_bar",
]

# The training-reward curve: one point per optimizer step when DFPOTrainer logs it, else TRL's per-rollout mean.
STEP_REWARD_KEYS = ("step_reward", "reward")
# Logged keys shown in the progress bar's postfix, with their short names, when present.
POSTFIX_KEYS = (
    ("step_reward", "reward"),
    ("reward", "reward"),
    ("entropy", "entropy"),
    ("transform/phi_min", "phi_min"),
    ("cancellation/shared_prefix_residual", "shared_res"),
)


class HeldoutAccuracyCallback(TrainerCallback):
    """Greedy accuracy on a fixed held-out set at the start and at the end of ``train()``.

    Runs on every process with the same problems (greedy decoding is deterministic, and under DeepSpeed ZeRO-3
    every rank must take part in ``generate``); only the main process prints. Results are in ``self.results``:
    ``{"n", "before", "after", "before_seconds", "after_seconds"}``.
    """

    def __init__(
        self,
        task: Any,
        problems: Any,
        max_new_tokens: int = 32,
        batch_size: int = 32,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.task = task
        self.problems = problems
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs
        self.results: dict[str, Any] = {"n": len(problems), "before": None, "after": None}

    def _measure(self, when: str, state: Any, model: Any, processing_class: Any) -> None:
        from .tasks import greedy_accuracy

        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        start = time.monotonic()
        accuracy = greedy_accuracy(
            model,
            tokenizer,
            self.problems,
            self.task,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        seconds = time.monotonic() - start
        self.results[when] = accuracy
        self.results[f"{when}_seconds"] = round(seconds, 1)
        if state.is_world_process_zero:
            # tqdm.write: printed above an open progress bar instead of glued to its end.
            tqdm.write(
                f"held-out greedy accuracy {when} training: {accuracy:.3f} ({len(self.problems)} problems, "
                f"{seconds:.0f} s)"
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._measure("before", state, kwargs["model"], kwargs.get("processing_class"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._measure("after", state, kwargs["model"], kwargs.get("processing_class"))


class CurveMetricsCallback(TrainerCallback):
    """The training-reward curve summarised at train end: its EMA, Jitter₂ (eq. 20) and compute-to-threshold (eq. 19).

    The curve is ``step_reward`` (one point per optimizer step: the mean reward of the completions it trained on,
    logged by ``DFPOTrainer``) when logged, else ``reward`` (TRL's, once per rollout). ``self.results``:
    ``reward_curve`` (the key used), ``reward_ema_first``, ``reward_ema_last``, ``reward_ema_peak`` (EMA with
    ``alpha``), ``reward_jitter2`` (None for fewer than 3 points), ``reward_threshold`` and ``steps_to_threshold``
    (the optimizer step at which the EMA first reaches the threshold, or None).
    """

    def __init__(self, threshold: float = 0.6, alpha: float = 0.3, keys: tuple[str, ...] = STEP_REWARD_KEYS) -> None:
        self.threshold = threshold
        self.alpha = alpha
        self.keys = keys
        self.results: dict[str, Any] = {
            "reward_curve": None,
            "reward_ema_alpha": alpha,
            "reward_ema_first": None,
            "reward_ema_last": None,
            "reward_ema_peak": None,
            "reward_threshold": threshold,
            "steps_to_threshold": None,
            "reward_jitter2": None,
        }

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        key = next((k for k in self.keys if any(k in row for row in state.log_history)), None)
        if key is None:
            return
        rows = [row for row in state.log_history if key in row]
        curve = [float(row[key]) for row in rows]
        smooth = metrics.ema(curve, alpha=self.alpha)
        self.results.update(
            reward_curve=key,
            reward_ema_first=smooth[0],
            reward_ema_last=smooth[-1],
            reward_ema_peak=max(smooth),
            reward_jitter2=metrics.jitter2(curve) if len(curve) >= 3 else None,
        )
        index = metrics.steps_to_threshold(curve, self.threshold, alpha=self.alpha)
        self.results["steps_to_threshold"] = None if index is None else int(rows[index].get("step", index + 1))


class DFPOProgressCallback(ProgressCallback):
    """transformers' progress bar (steps, elapsed, ETA) with the latest reward and entropy in its postfix.

    Unlike the stock bar it does not print every log dictionary: the metrics are in ``trainer.state.log_history``,
    the ``report_to`` backends and the PNG.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_train_begin(args, state, control, **kwargs)
        self.postfix: dict[str, str] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_step_end(args, state, control, **kwargs)
        # Close the bar at the last step, so what on_train_end prints (held-out accuracy) starts on its own line.
        if state.is_world_process_zero and self.training_bar is not None and state.global_step >= state.max_steps:
            self.training_bar.close()
            self.training_bar = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
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
