"""What a run measures while it trains, besides held-out accuracy and drift: reward-curve metrics, form shares.

The training-reward curve's EMA, Jitter₂ and steps to threshold; the reward wrapper that logs which equivalent form
each fully correct completion takes. The equivalent-solution drift meter is the library's
(:class:`dfpo_trl.metrics.drift_meter.DriftMeterCallback`).
All work with any ``transformers.Trainer`` (so with ``DFPOTrainer`` and TRL's ``GRPOTrainer``); ``report_to``
backends are untouched. The drift meter also logs through a metric store (``DFPOTrainer.dfpo_metrics``) when given
one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..metrics import curves
from .resume import RUN_RECORD

__all__ = ["CheckpointRecord", "CurveMetricsCallback", "FormShareReward"]

logger = logging.getLogger(__name__)

# The training-reward curve: one point per optimizer step when DFPOTrainer logs it, else TRL's per-rollout mean.
STEP_REWARD_KEYS = ("step_reward", "reward")


class FormShareReward:
    """A task's correctness reward, returned unchanged, that also logs which equivalent form each fully correct
    completion is: ``drift/form_share/<form>`` (and ``drift/form_share/other`` for full-credit completions of no
    listed form), one 0/1 value per such completion through TRL's ``log_metric`` reward argument, so TRL's
    pooling (sum over processes / count) gives each form's exact share among the step's correct completions.

    ``task`` is an :class:`~dfpo_trl.cli.tasks.EquivalentFormsTask`; ``full_credit`` the reward of a fully correct
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
        # a step whose rollout no reward scored logs None (TRL's NaN mean): no point of the curve
        rows = [row for row in state.log_history if isinstance(row.get(key), (int, float)) and row[key] == row[key]]
        if not rows:
            self.results["reward_curve"] = key
            return
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


class CheckpointRecord(TrainerCallback):
    """Writes into each checkpoint what a resumed ``dfpo-train`` run needs to continue and report like the run it
    continues (``dfpo_run.json`` beside ``trainer_state.json``, process 0): the save settings, which the resumed run
    takes unless its command line gives them again (resume.py), and the held-out points measured so far."""

    def __init__(self, heldout_cb: Any = None) -> None:
        self.heldout_cb = heldout_cb

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not state.is_world_process_zero or not folder.is_dir():
            return
        strategy = args.save_strategy
        record = {
            "save_strategy": str(getattr(strategy, "value", strategy)),
            "save_steps": args.save_steps,
            "heldout": self.heldout_cb.checkpoint_record(state.global_step) if self.heldout_cb is not None else None,
        }
        partial = folder / f".{RUN_RECORD}.tmp"
        partial.write_text(json.dumps(record, indent=1) + "\n")
        partial.replace(folder / RUN_RECORD)

