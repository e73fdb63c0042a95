"""The equivalent-solution drift meter as a ``transformers`` callback: D1-D4 (docs/source/concepts/metrics.md)
measured on held-out prompts every few optimizer steps, with any ``transformers.Trainer`` (so ``DFPOTrainer`` and
TRL's ``GRPOTrainer``).

A library meter (``dfpo_trl.testing.measures`` lists it), kept apart from ``drift.py``'s pure functions because it
needs a trainer's callback events.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import TrainerCallback

from .drift import completion_log_probs, end_token_ids, end_token_mismatch, summarise_equivalent_sets

__all__ = ["DriftMeterCallback"]

logger = logging.getLogger(__name__)


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
