"""Trainer callbacks of the main job: held-out accuracy, reward-curve metrics, a progress bar with the reward, and
the equivalent-solution drift meter.

All work with any ``transformers.Trainer`` (so with ``DFPOTrainer`` and TRL's ``GRPOTrainer``); ``report_to``
backends are untouched. The drift meter and the periodic held-out accuracy also log through a metric store
(``DFPOTrainer.dfpo_metrics``) when given one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from .metrics import curves as metrics
from .metrics.drift import completion_log_probs, summarise_equivalent_sets

logger = logging.getLogger(__name__)

__all__ = [
    "CurveMetricsCallback",
    "DFPOProgressCallback",
    "DriftMeterCallback",
    "FormShareReward",
    "GenerationProgress",
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
    """Greedy accuracy on a fixed held-out set at the start and at the end of ``train()``, and every ``every``
    optimizer steps when ``every`` > 0.

    Runs on every process with the same problems (greedy decoding is deterministic, and under DeepSpeed ZeRO-3
    every rank must take part in ``generate``); only the main process prints. Results are in ``self.results``:
    ``{"n", "before", "after", "before_seconds", "after_seconds", "curve"}``, ``curve`` a list of ``[step,
    accuracy]`` (step 0 = before training). With a metric store (``metrics``), the periodic values are logged as
    ``heldout/accuracy`` at their step.
    """

    def __init__(
        self,
        task: Any,
        problems: Any,
        max_new_tokens: int = 32,
        batch_size: int = 32,
        chat_template_kwargs: dict[str, Any] | None = None,
        every: int = 0,
        metrics: Any = None,
    ) -> None:
        if every < 0:
            raise ValueError(f"every must be >= 0 (0: before and after training only), got {every}")
        self.task = task
        self.problems = problems
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs
        self.every = every
        self.metrics = metrics
        self.results: dict[str, Any] = {"n": len(problems), "before": None, "after": None, "curve": []}

    def _accuracy(self, model: Any, processing_class: Any) -> tuple[float, float]:
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
        return accuracy, time.monotonic() - start

    def _record(self, step: int, accuracy: float) -> None:
        curve = self.results["curve"]
        if curve and curve[-1][0] == step:
            curve[-1][1] = accuracy
        else:
            curve.append([step, accuracy])

    def _measure(self, when: str, state: Any, model: Any, processing_class: Any) -> None:
        accuracy, seconds = self._accuracy(model, processing_class)
        self.results[when] = accuracy
        self.results[f"{when}_seconds"] = round(seconds, 1)
        self._record(state.global_step if when == "after" else 0, accuracy)
        if state.is_world_process_zero:
            # tqdm.write: printed above an open progress bar instead of glued to its end.
            tqdm.write(
                f"held-out greedy accuracy {when} training: {accuracy:.3f} ({len(self.problems)} problems, "
                f"{seconds:.0f} s)"
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._measure("before", state, kwargs["model"], kwargs.get("processing_class"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.every or state.global_step % self.every != 0 or state.global_step >= state.max_steps:
            return  # the last step is measured by on_train_end
        accuracy, seconds = self._accuracy(kwargs["model"], kwargs.get("processing_class"))
        self.results["periodic_seconds"] = round(self.results.get("periodic_seconds", 0.0) + seconds, 1)
        self._record(state.global_step, accuracy)
        if self.metrics is not None:
            self.metrics.add_mean("train", "heldout/accuracy", torch.tensor(float(accuracy), dtype=torch.float64), 1.0)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._measure("after", state, kwargs["model"], kwargs.get("processing_class"))


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
    """Equivalent-solution drift (dfpo_trl.drift, docs/metrics.md): every ``every`` optimizer steps (and before
    training), the current policy's log-probabilities of each held-out prompt's equivalent canonical completions
    (``task.equivalent_forms``), summarised as D1–D4 over the prompts.

    Logged through ``metrics`` (a metric store, e.g. ``DFPOTrainer.dfpo_metrics``) at the step measured, as
    ``drift/log_odds_abs_mean``, ``drift/log_odds_abs_std``, ``drift/log_odds_mean``, ``drift/set_entropy``,
    ``drift/set_entropy_normalised`` and ``drift/set_logp_mean``; every measurement, step 0 included, is kept in
    ``self.results["curve"]`` (``{"step", **summary}`` per measurement; ``"seconds"``: their total time).
    Log-probabilities are taken at ``temperature`` (TRL's: logits / the sampling temperature). Runs on every
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
        ).view(-1, self.num_forms)
        summary = summarise_equivalent_sets(logps)
        self.results["curve"].append({"step": step, **summary})
        self.results["seconds"] = round(self.results.get("seconds", 0.0) + time.monotonic() - start, 2)
        self._last_step = step
        return summary

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._measure(state.global_step, kwargs["model"], kwargs.get("processing_class"))

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
        super().on_train_begin(args, state, control, **kwargs)
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
            max_new = getattr(config, "max_new_tokens", None)
            if max_new is None:
                max_new = max(int(getattr(config, "max_length", 0) or 0) - prompt_length, 0)
            eos = getattr(config, "eos_token_id", None)
            eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
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
        text = f"generating: token {token}/{max_new_tokens}, {done}/{total} completions done"
        self.training_bar.set_description_str(text, refresh=True)

    def _stop_following_generation(self) -> None:
        model, self._generating_model = getattr(self, "_generating_model", None), None
        if model is not None and "generate" in vars(model):
            del model.generate  # the class's own method again

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
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
