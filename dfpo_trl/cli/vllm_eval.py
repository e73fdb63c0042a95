"""Held-out avg@k through TRL's own evaluation (vLLM when ``use_vllm`` is on): the paper's measure, the mean
correctness over k sampled completions per held-out problem, at the run's sampling settings.

TRL's ``GRPOTrainer.evaluate`` samples ``num_generations_eval`` completions per ``eval_dataset`` row through the same
generation path as training (vLLM here), scores them with the reward functions and logs ``eval_rewards/<name>/mean``.
That logged value is a mean of per-batch means (a short last batch weighs as much as a full one), so avg@k is computed
here from the correctness reward's own values, recorded while the evaluation runs: per problem the mean of its k
rewards (``None`` left out), then the mean over problems. The callback is :class:`HeldoutAccuracyCallback` with the
measurement swapped, so the summary, the log history (``heldout/accuracy``), the curve and the figure carry avg@k
where they carry the greedy accuracy without vLLM (docs/source/concepts/decisions.md, "Held-out avg@k through vLLM").
"""

from __future__ import annotations

import math
import time
from typing import Any

from .args import RecipeError
from .evaluation import HeldoutAccuracyCallback
from .local_inputs import eval_batch_problem

__all__ = ["EvalRewardRecorder", "VLLMAvgAtKCallback", "check_eval_batch", "default_eval_batch", "eval_k",
           "rollout_rows"]


def eval_k(training_args: Any) -> int:
    """k of avg@k: TRL's ``num_generations_eval``, which TRL itself defaults to ``num_generations``."""
    return int(training_args.num_generations_eval or training_args.num_generations)


def rollout_rows(training_args: Any) -> int:
    """The rows one process sends to vLLM per training rollout: TRL's generation batch per process,
    ``per_device_train_batch_size`` x ``steps_per_generation``."""
    steps = getattr(training_args, "steps_per_generation", None) or training_args.gradient_accumulation_steps
    return int(training_args.per_device_train_batch_size) * int(steps)


def default_eval_batch(training_args: Any, problems: int, processes: int) -> int:
    """Set TRL's ``per_device_eval_batch_size``, which the user left at transformers' 8, so that each vLLM call
    carries many problems: each process's share of the held-out problems (k x ceil(problems / processes) rows), but
    no more rows than a training rollout sends (:func:`rollout_rows`, rounded down to a multiple of k and at least k).
    At the default 8 with k = 8 each call carried one problem, and 100 problems made 100 calls; the rollout's size is
    the bound because TRL runs the evaluation's generation, scoring and loss over the whole eval batch, and a batch the
    run already generates and scores in training is one the card holds. The 8B recipe on Qwen2.5-Coder-0.5B, 100
    problems x 8 of up to 256 tokens, took 31 s an evaluation at this default against 116 s at one problem per call
    (an H200, 2026-12-03; docs/source/concepts/decisions.md, "Held-out avg@k through vLLM"). Returns the batch."""
    k = eval_k(training_args)
    whole_share = k * max(1, math.ceil(problems / max(1, processes)))
    training_args.per_device_eval_batch_size = min(whole_share, k * max(1, rollout_rows(training_args) // k))
    return training_args.per_device_eval_batch_size


def check_eval_batch(training_args: Any) -> None:
    """Refuse an eval batch that would split a problem's k completions across batches or processes: TRL samples
    the k of a problem next to each other, and avg@k groups them per process batch (local_inputs.py, which the
    command line's fast checks share)."""
    problem = eval_batch_problem(training_args.per_device_eval_batch_size, eval_k(training_args))
    if problem is not None:
        raise RecipeError(problem)


class EvalRewardRecorder:
    """The correctness reward, returned unchanged, that keeps its values while ``recording`` is on (the
    evaluation). Keeps the wrapped function's ``__name__``: TRL logs rewards under it."""

    def __init__(self, reward: Any) -> None:
        self.reward = reward
        self.recording = False
        self.values: list[float | None] = []
        self.__name__ = getattr(reward, "__name__", type(reward).__name__)

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        rewards = self.reward(prompts=prompts, completions=completions, **kwargs)
        if self.recording:
            self.values.extend(None if r is None else float(r) for r in rewards)
        return rewards


def per_problem_means(values: list[float | None], k: int) -> list[float]:
    """The mean of each consecutive run of k rewards (one problem's), ``None`` left out; a problem with no scored
    completion is left out."""
    means = []
    for start in range(0, len(values), k):
        scored = [v for v in values[start : start + k] if v is not None]
        if scored:
            means.append(sum(scored) / len(scored))
    return means


class VLLMAvgAtKCallback(HeldoutAccuracyCallback):
    """:class:`HeldoutAccuracyCallback` measuring avg@k through ``trainer.evaluate()`` (TRL's eval path: the
    trainer's ``eval_dataset``, ``num_generations_eval``, vLLM when on) instead of greedy ``generate``. Set
    ``trainer`` once the trainer exists. ``results["metric"]`` is ``"avg@k"`` with k filled in."""

    def __init__(self, task: Any, problems: Any, recorder: EvalRewardRecorder, k: int, every: int = 0,
                 metrics: Any = None) -> None:
        super().__init__(task, problems, every=every, metrics=metrics)
        self.recorder = recorder
        self.k = k
        self.trainer: Any = None
        self.label = f"avg@{k}"
        self.results["metric"] = self.label

    def _accuracy(self, model: Any, processing_class: Any, shown: str | None = None) -> tuple[float, float]:
        # ``shown`` (the greedy evaluation's progress line) is not drawn: TRL's evaluate() runs its own loop
        if self.trainer is None:
            raise RuntimeError("VLLMAvgAtKCallback.trainer is not set: assign the trainer before train()")
        start = time.monotonic()
        self.recorder.values = []
        self.recorder.recording = True
        was_training = model.training
        try:
            self.trainer.evaluate()  # logs TRL's eval_* metrics (rewards, lengths) at this step
        finally:
            self.recorder.recording = False
            model.train(was_training)
        # Every process's problems (a plain gather: gather_for_metrics trims by the last dataloader's remainder).
        from accelerate.utils import gather_object

        means = gather_object(per_problem_means(self.recorder.values, self.k))
        return (sum(means) / len(means) if means else 0.0), time.monotonic() - start


def avg_at_k_callback(task: Any, heldout: Any, reward_funcs: list[Any], training_args: Any,
                      every: int) -> VLLMAvgAtKCallback:
    """The avg@k callback for a ``use_vllm`` run: wraps the correctness reward (``reward_funcs[0]``, in place) so
    the evaluation's values are kept. Pass ``heldout`` to the trainer as ``eval_dataset`` and set ``.trainer``."""
    check_eval_batch(training_args)
    recorder = EvalRewardRecorder(reward_funcs[0])
    reward_funcs[0] = recorder
    return VLLMAvgAtKCallback(task, heldout, recorder, eval_k(training_args), every=every)
