"""What a run measures while it trains, besides held-out accuracy: reward-curve metrics, drift, form shares.

The training-reward curve's EMA, Jitter₂ and steps to threshold; the equivalent-solution drift meter; the reward
wrapper that logs which equivalent form each fully correct completion takes.
All work with any ``transformers.Trainer`` (so with ``DFPOTrainer`` and TRL's ``GRPOTrainer``); ``report_to``
backends are untouched. The drift meter also logs through a metric store (``DFPOTrainer.dfpo_metrics``) when given
one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import TrainerCallback

from ..metrics import curves
from ..metrics.drift import completion_log_probs, end_token_ids, end_token_mismatch, summarise_equivalent_sets

__all__ = ["CurveMetricsCallback", "DriftMeterCallback", "FormShareReward"]

logger = logging.getLogger(__name__)

# The training-reward curve: one point per optimizer step when DFPOTrainer logs it, else TRL's per-rollout mean.
STEP_REWARD_KEYS = ("step_reward", "reward")


class FormShareReward:
    """A task's correctness reward, returned unchanged, that also logs which equivalent form each fully correct
    completion is: ``drift/form_share/<form>`` (and ``drift/form_share/other`` for full-credit completions of no
    listed form), one 0/1 value per such completion through TRL's ``log_metric`` reward argument, so TRL's
    pooling (sum over processes / count) gives each form's exact share among the step's correct completions.

    ``task`` is an :class:`~dfpo_trl.tasks.EquivalentFormsTask`; ``full_credit`` the reward of a fully correct
    completion. Keeps the wrapped function's ``__name__`` (TRL logs rewards under it); picklable when it is.
    """

    def __init__(self, reward: Any, task: Any, full_credit: float = 1.0) -> None:
        self.reward = reward
        self.task = task
        self.full_credit = full_credit
        self.__name__ = getattr(reward, "__name__", type(reward).__name__)

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        rewards = self.reward(prompts=prompts, completions=completions, **kwargs)
        log_metric = kwargs.get("log_metric")
        if log_metric is None:
            return rewards
        n = len(completions)
        columns = {k: v for k, v in kwargs.items() if isinstance(v, (list, tuple)) and len(v) == n}
        names = [*self.task.form_names, "other"]
        for i, (completion, reward) in enumerate(zip(completions, rewards, strict=True)):
            if reward is None or reward < self.full_credit:
                continue
            form = self.task.form_of(completion, {k: v[i] for k, v in columns.items()})
            chosen = len(names) - 1 if form is None else form
            for k, name in enumerate(names):
                log_metric(f"drift/form_share/{name}", 1.0 if k == chosen else 0.0)
        return rewards

    def __repr__(self) -> str:
        return f"FormShareReward({self.__name__})"


class DriftMeterCallback(TrainerCallback):
    """Equivalent-solution drift (dfpo_trl.metrics.drift, docs/source/concepts/metrics.md): every ``every`` optimizer
    steps (and before training), the current policy's log-probabilities of each held-out prompt's equivalent canonical
    completions (``task.equivalent_forms``), summarised as D1–D4 over the prompts.

    Logged through ``metrics`` (a metric store, e.g. ``DFPOTrainer.dfpo_metrics``) at the step measured, as
    ``drift/log_odds_abs_mean``, ``drift/log_odds_abs_std``, ``drift/log_odds_mean``, ``drift/set_entropy``,
    ``drift/set_entropy_normalised`` and ``drift/set_logp_mean``; every measurement, step 0 included, is kept in
    ``self.results["curve"]`` (``{"step", **summary}`` per measurement; ``"seconds"``: their total time).
    Log-probabilities are taken at ``temperature`` (TRL's: logits / the sampling temperature); a canonical completion
    ends with any of the end tokens TRL stops at (:func:`~dfpo_trl.metrics.drift.end_token_ids`). When the tokenizer's
    end token is not the model's own (generation config), it warns once at train begin and goes on: its number
    stays right, the run's completions end at the wrong token (``self.results["end_token_warning"]``). Runs on every
    process (a ZeRO-3 forward is collective); every process computes the same numbers.
    """

    def __init__(
        self,
        task: Any,
        problems: Any,
        every: int,
        temperature: float = 1.0,
        batch_size: int = 32,
        chat_template_kwargs: dict[str, Any] | None = None,
        metrics: Any = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 optimizer steps, got {every}")
        rows = [dict(row) for row in problems]
        if not rows:
            raise ValueError("the drift meter needs at least one held-out problem")
        self.task = task
        self.every = every
        self.temperature = temperature
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs
        self.metrics = metrics
        forms = [task.equivalent_forms(row) for row in rows]
        self.num_forms = len(task.form_names)
        if any(len(f) != self.num_forms for f in forms) or self.num_forms < 2:
            raise ValueError(f"task {task.name!r} must give {len(task.form_names)} >= 2 forms for every problem")
        self.prompts = [row["prompt"] for row in rows for _ in range(self.num_forms)]
        self.completions = [text for per_row in forms for text in per_row]
        self.results: dict[str, Any] = {
            "every": every, "n": len(rows), "forms": list(task.form_names), "temperature": temperature, "curve": [],
        }
        self._last_step: int | None = None

    def _measure(self, step: int, model: Any, processing_class: Any) -> dict[str, float]:
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        start = time.monotonic()
        logps = completion_log_probs(
            model, tokenizer, self.prompts, self.completions, temperature=self.temperature,
            batch_size=self.batch_size, chat_template_kwargs=self.chat_template_kwargs,
            end_ids=end_token_ids(tokenizer, model),
        ).view(-1, self.num_forms)
        summary = summarise_equivalent_sets(logps)
        self.results["curve"].append({"step": step, **summary})
        self.results["seconds"] = round(self.results.get("seconds", 0.0) + time.monotonic() - start, 2)
        self._last_step = step
        return summary

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        processing_class = kwargs.get("processing_class")
        warning = end_token_mismatch(getattr(processing_class, "tokenizer", processing_class), kwargs["model"])
        if warning is not None:
            logger.warning("drift meter: %s", warning)
            self.results["end_token_warning"] = warning
        self._measure(state.global_step, kwargs["model"], processing_class)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every != 0 and state.global_step < state.max_steps:
            return
        summary = self._measure(state.global_step, kwargs["model"], kwargs.get("processing_class"))
        if self.metrics is not None:
            for name, value in summary.items():
                self.metrics.add_mean("train", f"drift/{name}", torch.tensor(float(value), dtype=torch.float64), 1.0)


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
        smooth = curves.ema(curve, alpha=self.alpha)
        self.results.update(
            reward_curve=key,
            reward_ema_first=smooth[0],
            reward_ema_last=smooth[-1],
            reward_ema_peak=max(smooth),
            reward_jitter2=curves.jitter2(curve) if len(curve) >= 3 else None,
        )
        index = curves.steps_to_threshold(curve, self.threshold, alpha=self.alpha)
        self.results["steps_to_threshold"] = None if index is None else int(rows[index].get("step", index + 1))

