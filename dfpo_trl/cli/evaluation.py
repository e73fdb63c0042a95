"""The held-out greedy accuracy: the function, and the callback that measures it before, during and after training."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, TrainerCallback

from .progress import GenerationProgress
from .tasks import RewardFunc, Task

__all__ = ["BEFORE_KEY", "HeldoutAccuracyCallback", "greedy_accuracy"]

# The log-history key of the accuracy before training (with PROBLEMS_KEY, the number of problems it is over).
BEFORE_KEY = "heldout/accuracy_before_training"
PROBLEMS_KEY = "heldout/problems"


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Dataset | Sequence[Mapping[str, Any]],
    task: Task | RewardFunc,
    max_new_tokens: int = 32,
    batch_size: int = 32,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> float:
    """Mean reward of greedy completions on ``problems`` (rows from ``task.build_dataset``).

    Scored with the task's first reward function (its correctness reward), or with ``task`` itself when
    it is a reward function; rows scored ``None`` are left out of the mean. The prompt is rendered with
    the tokenizer's chat template (generation prompt added) and left-padded so a batch's completions
    start at the same position. Greedy decoding is deterministic, so each distinct prompt is generated
    once (a held-out set larger than the 100 arithmetic problems repeats them). Model mode and
    tokenizer padding side are restored afterwards, so it can run between training steps.
    ``chat_template_kwargs`` go to ``apply_chat_template`` (e.g. ``{"enable_thinking": False}`` for Qwen3), as
    TRL passes its ``chat_template_kwargs`` during training. ``progress(batch, batches, token, max_new_tokens)`` is
    called at every token generated (the 0-based batch, the batches, the 1-based token), for a progress line.
    """
    reward = task.reward_funcs[0] if hasattr(task, "reward_funcs") else task
    rows = [dict(r) for r in problems]
    if not rows:
        return 0.0
    conversational = not isinstance(rows[0]["prompt"], str)
    texts = [
        tokenizer.apply_chat_template(
            r["prompt"], tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
        )
        if conversational
        else r["prompt"]
        for r in rows
    ]
    # Distinct prompts, longest first: similar lengths share a batch (less padding) and an out-of-memory
    # error, if any, comes at the start.
    unique = sorted(set(texts), key=len, reverse=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    old_side = tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    generated: dict[str, str] = {}
    batches = -(-len(unique) // batch_size)
    try:
        for start in range(0, len(unique), batch_size):
            chunk = unique[start : start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(model.device)
            extra: dict[str, Any] = {}
            if progress is not None:
                def report(done: int, total: int, token: int, most: int, batch: int = start // batch_size) -> None:
                    progress(batch, batches, token, most)

                counter = GenerationProgress(report, enc["input_ids"].shape[1], max_new_tokens, [])
                extra["logits_processor"] = LogitsProcessorList([counter])
            # no_grad, not inference_mode: under FSDP2 the parameters gathered here stay gathered for the next
            # forward, and inference tensors cannot be saved for backward (tests/test_fsdp2.py).
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad_id,
                    **extra,
                )
            decoded = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            generated.update(zip(chunk, decoded, strict=True))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)

    decoded_rows = [generated[t] for t in texts]
    completions: list[Any] = (
        [[{"role": "assistant", "content": d}] for d in decoded_rows] if conversational else decoded_rows
    )
    extra = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    values = reward(prompts=[r["prompt"] for r in rows], completions=completions, **extra)
    scores = [float(v) for v in values if v is not None]
    return sum(scores) / len(scores) if scores else 0.0


class HeldoutAccuracyCallback(TrainerCallback):
    """Greedy accuracy on a fixed held-out set at the start and at the end of ``train()``, and every ``every``
    optimizer steps when ``every`` > 0.

    Runs on every process with the same problems (greedy decoding is deterministic, and under DeepSpeed ZeRO-3
    every rank must take part in ``generate``); only the main process prints. Results are in ``self.results``:
    ``{"n", "before", "after", "before_seconds", "after_seconds", "curve"}``, ``curve`` a list of ``[step,
    accuracy]`` (step 0 = before training). With a metric store (``metrics``), the periodic values are logged as
    ``heldout/accuracy`` at their step.

    The accuracy before training also goes into the log history (:data:`BEFORE_KEY`, with the number of problems,
    at step 0), so every checkpoint carries it. A resumed run (``train()`` starting at step k > 0) takes "before" and
    the periodic values up to step k from there instead of measuring the resumed model and calling it "before";
    ``results["resumed_at"]`` is k. When the checkpoint has no such row for as many problems (written by another
    trainer, or with another ``eval_size``), it measures at step k: ``results["before"]`` is None and
    ``results["at_resume"]`` holds that accuracy (docs/source/guides/cli.md, "Resume").
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
        self.label = "greedy accuracy"  # what the messages call the measure (vllm_eval: avg@k)
        # what the checkpoint a run resumes from recorded of this measure (checkpoint_record), set by the run
        self.resumed_record: dict[str, Any] | None = None
        self.results: dict[str, Any] = {
            "n": len(problems), "before": None, "after": None, "curve": [], "resumed_at": None,
        }

    def _accuracy(self, model: Any, processing_class: Any, shown: str | None = None) -> tuple[float, float]:
        """The accuracy and the seconds it took; ``shown``: the progress line's label (the evaluations before and
        after training, when no training bar is open to show it), None for none."""
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        start = time.monotonic()
        form = "{desc} ({percentage:.0f}%, {elapsed} so far, {remaining} left)"
        bar = None if shown is None else tqdm(total=1, desc=shown, dynamic_ncols=True, leave=False, bar_format=form)

        def report(batch: int, batches: int, token: int, most: int) -> None:
            bar.total, bar.n = batches * most, batch * most + token
            bar.set_description_str(f"{shown}: batch {batch + 1}/{batches}, token {token}/{most}", refresh=True)

        try:
            accuracy = greedy_accuracy(
                model,
                tokenizer,
                self.problems,
                self.task,
                max_new_tokens=self.max_new_tokens,
                batch_size=self.batch_size,
                chat_template_kwargs=self.chat_template_kwargs,
                progress=report if bar is not None else None,
            )
        finally:
            if bar is not None:
                bar.close()
        return accuracy, time.monotonic() - start

    def _shown(self, args: Any, state: Any, when: str) -> str | None:
        """The progress line's label for an evaluation outside the training bar (before or after training, at the
        resume step), on the first process with the bars on; else None."""
        if getattr(args, "disable_tqdm", True) or not state.is_world_process_zero:
            return None
        return f"held-out {self.label} {when} ({len(self.problems)} problems)"

    def _record(self, step: int, accuracy: float) -> None:
        curve = self.results["curve"]
        if curve and curve[-1][0] == step:
            curve[-1][1] = accuracy
        else:
            curve.append([step, accuracy])

    def _measure(self, when: str, state: Any, model: Any, processing_class: Any, args: Any = None) -> None:
        accuracy, seconds = self._accuracy(model, processing_class, self._shown(args, state, f"{when} training"))
        self.results[when] = accuracy
        self.results[f"{when}_seconds"] = round(seconds, 1)
        self._record(state.global_step if when == "after" else 0, accuracy)
        if state.is_world_process_zero:
            # tqdm.write: printed above an open progress bar instead of glued to its end.
            tqdm.write(
                f"held-out {self.label} {when} training: {accuracy:.3f} ({len(self.problems)} problems, "
                f"{seconds:.0f} s)"
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step > 0:  # resumed from a checkpoint
            self._resume(state, kwargs["model"], kwargs.get("processing_class"), args)
            return
        self._measure("before", state, kwargs["model"], kwargs.get("processing_class"), args)
        state.log_history.append({BEFORE_KEY: self.results["before"], PROBLEMS_KEY: len(self.problems), "step": 0})

    def checkpoint_record(self, step: int) -> dict[str, Any]:
        """What a checkpoint of step ``step`` keeps of this measure (dfpo_run.json, cli/callbacks.py): the problems'
        count, the measure, the accuracy before training and every point of the curve up to that step. The log
        history alone lost points: a periodic value is logged with a later step's row, after that step's save."""
        curve = [[int(s), float(a)] for s, a in self.results["curve"] if s <= step]
        return {"n": len(self.problems), "metric": self.label, "before": self.results["before"], "curve": curve}

    def _resume(self, state: Any, model: Any, processing_class: Any, args: Any = None) -> None:
        """The accuracy before training and the periodic values up to the resume step, from the checkpoint's record
        of them (else its log history); measured at the resume step, and said to be that, when the checkpoint does
        not have them."""
        step, n = state.global_step, len(self.problems)
        self.results["resumed_at"] = step
        record = self.resumed_record
        if record and record.get("n") == n and record.get("metric") == self.label and record.get("before") is not None:
            self.results.update(before=record["before"], before_seconds=0.0)
            for point, accuracy in record.get("curve", []):
                if point <= step:
                    self._record(int(point), float(accuracy))
            if state.is_world_process_zero:
                tqdm.write(f"held-out {self.label} before training: {record['before']:.3f} ({n} problems; from the "
                           f"checkpoint, resumed at step {step})")
            return
        row = next((r for r in state.log_history if BEFORE_KEY in r and r.get(PROBLEMS_KEY) == n), None)
        if row is not None:
            self.results.update(before=row[BEFORE_KEY], before_seconds=0.0)
            self._record(0, row[BEFORE_KEY])
            said = f"before training: {row[BEFORE_KEY]:.3f} ({n} problems; from the checkpoint, resumed at step {step})"
        for earlier in state.log_history:
            if "heldout/accuracy" in earlier and earlier.get("step", step + 1) <= step:
                self._record(earlier["step"], earlier["heldout/accuracy"])
        if row is None:
            shown = self._shown(args, state, f"at resume (step {step})")
            accuracy, seconds = self._accuracy(model, processing_class, shown)
            self.results.update(at_resume=accuracy, before_seconds=round(seconds, 1))
            self._record(step, accuracy)
            said = (f"at resume (step {step}): {accuracy:.3f} ({n} problems, {seconds:.0f} s; the checkpoint holds no "
                    "accuracy before training)")
        if state.is_world_process_zero:
            tqdm.write(f"held-out {self.label} {said}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.every or state.global_step % self.every != 0 or state.global_step >= state.max_steps:
            return  # the last step is measured by on_train_end
        accuracy, seconds = self._accuracy(kwargs["model"], kwargs.get("processing_class"))
        self.results["periodic_seconds"] = round(self.results.get("periodic_seconds", 0.0) + seconds, 1)
        self._record(state.global_step, accuracy)
        if state.is_world_process_zero:  # the curve as it grows, above the progress bar
            tqdm.write(f"held-out {self.label} at step {state.global_step}: {accuracy:.3f} ({seconds:.0f} s)")
        if self.metrics is not None:
            self.metrics.add_mean("train", "heldout/accuracy", torch.tensor(float(accuracy), dtype=torch.float64), 1.0)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._measure("after", state, kwargs["model"], kwargs.get("processing_class"), args)
