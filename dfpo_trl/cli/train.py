"""A ``dfpo-train`` run, once its command line passed the fast checks: parse it into the three dataclasses
(:mod:`.parser`), then :func:`run` trains and writes the outputs. Imports torch, transformers and TRL, which
:mod:`.main` imports only when the command is about to train.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import ModelConfig, get_peft_config

from .._usercode import UserCodeError
from ..config import DFPOConfig
from ..metrics.drift_meter import DriftMeterCallback
from ..rewards import RewardError
from ..trainer import DFPOTrainer
from . import logger
from .args import DFPOScriptArguments
from .callbacks import CurveMetricsCallback, FormShareReward
from .data import (
    build_datasets,
    build_drift_problems,
    build_rewards,
    build_task,
    check_reward_model_templates,
    filter_long_prompts,
)
from .evaluation import HeldoutAccuracyCallback
from .model import model_init_kwargs, resolve_model
from .oom import out_of_memory_as_one_line, watch_phases
from .outputs import PREVIOUS_RUN_DIR, save_model, set_aside_previous_outputs, write_outputs
from .parser import parse_args
from .peers import lost_peer_as_one_line
from .precheck import field_origin, recipe_argv
from .progress import close_progress_bar, use_dfpo_progress_bar
from .signals import signal_name
from .vllm_eval import avg_at_k_callback, check_eval_batch

__all__ = ["default_process_group", "parse_and_run", "run"]


def run(
    script_args: DFPOScriptArguments,
    training_args: DFPOConfig,
    model_args: ModelConfig,
    origin: Callable[[str], str] | None = None,
    user_callbacks: Sequence[TrainerCallback] = (),
) -> dict[str, Any]:
    """Train as described, write the summary (and the PNG) to ``output_dir``; returns the summary. ``origin`` says
    where a field was set (the flag, or the recipe's line), for the refusals only the data can show;
    ``user_callbacks`` go to the trainer after the run's own (``dfpo_train(argv, callbacks=...)``)."""
    start = time.monotonic()
    # The task, its rewards and data first: a mistake there is refused before the model is looked at or converted.
    task = build_task(script_args, origin)
    reward_funcs = build_rewards(script_args, task, model_args.model_revision, origin)
    train, heldout = build_datasets(script_args, task, training_args.seed, origin)
    check_reward_model_templates(reward_funcs, train, model_args.model_revision)
    drift_problems = build_drift_problems(script_args, task, training_args.seed, origin)
    if drift_problems is not None:
        # The correctness reward also logs which form each fully correct sampled completion takes.
        reward_funcs[0] = FormShareReward(reward_funcs[0], task)
    model_start = time.monotonic()
    model_path, model_label = resolve_model(model_args)
    model_seconds = time.monotonic() - model_start  # the embedded model's one-time conversion, or a quick check
    if script_args.max_prompt_length is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
        train = filter_long_prompts(train, tokenizer, script_args.max_prompt_length, training_args.chat_template_kwargs)
    training_args.model_init_kwargs = model_init_kwargs(training_args, model_args)
    avg_at_k = heldout is not None and training_args.use_vllm  # held-out avg@k through TRL's eval path (vLLM)
    if avg_at_k:
        check_eval_batch(training_args)
    # An earlier run's results move to previous_run/ once this run has trained a step (or is about to write its
    # own): a failure before that (the user's reward on the first rollout) leaves output_dir as it was.
    earlier = EarlierResults(training_args.output_dir)

    curves = CurveMetricsCallback(threshold=script_args.reward_threshold)
    callbacks: list[Any] = [curves, earlier]
    heldout_cb: Any = None
    if avg_at_k:
        heldout_cb = avg_at_k_callback(task, heldout, reward_funcs, training_args, script_args.eval_every)
        callbacks.insert(0, heldout_cb)
    elif heldout is not None:
        heldout_cb = HeldoutAccuracyCallback(
            task,
            heldout,
            max_new_tokens=script_args.eval_max_new_tokens,
            batch_size=script_args.eval_batch_size,
            chat_template_kwargs=training_args.chat_template_kwargs,
            every=script_args.eval_every,
        )
        callbacks.insert(0, heldout_cb)
    trainer = DFPOTrainer(  # logs the group layout it chose, why, and what it costs
        model=model_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train,
        peft_config=get_peft_config(model_args),
        callbacks=[*callbacks, *user_callbacks],
        eval_dataset=heldout if avg_at_k else None,
    )
    if heldout_cb is not None:
        heldout_cb.metrics = trainer.dfpo_metrics
    if avg_at_k:
        heldout_cb.trainer = trainer
    drift_cb = None
    if drift_problems is not None:
        drift_cb = DriftMeterCallback(
            task,
            drift_problems,
            every=script_args.drift_every,
            temperature=training_args.temperature,
            batch_size=script_args.eval_batch_size,
            chat_template_kwargs=training_args.chat_template_kwargs,
            metrics=trainer.dfpo_metrics,
        )
        trainer.add_callback(drift_cb)
    use_dfpo_progress_bar(trainer)
    watch_phases(trainer, heldout_cb)  # an out-of-memory error names its phase (oom.py)
    train_start = time.monotonic()
    setup_seconds = train_start - start - model_seconds
    interrupted = False
    stop_signal = None
    try:
        # an out-of-memory error, or a collective failing on a lost or hung peer: one line, nothing removed or
        # written (oom.py, peers.py)
        with out_of_memory_as_one_line(trainer, script_args), lost_peer_as_one_line(trainer):
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except RewardError as exc:  # the user's reward failed: one line, with the training row it was scoring
        close_progress_bar(trainer)
        raise UserCodeError(exc.said(training_row(train, exc.prompt))) from exc
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: keep what was learned about the run, not a traceback
        interrupted = True
        stop_signal = signal_name(exc)
        close_progress_bar(trainer)
        curves.on_train_end(training_args, trainer.state, trainer.control)  # the curve up to the last logged step
    train_seconds = time.monotonic() - train_start
    earlier.set_aside()  # interrupted before the first step ended: this run writes its partial results now
    saved = save_model(trainer, training_args.output_dir) if script_args.save_model and not interrupted else []

    summary: dict[str, Any] = {"interrupted": interrupted, "signal": stop_signal}
    if trainer.accelerator.is_main_process:
        times = {"model": model_seconds, "setup": setup_seconds, "train_call": train_seconds}
        summary = write_outputs(
            trainer, script_args, training_args, model_label, heldout_cb, curves, times, start, interrupted, saved,
            drift_cb, stop_signal,
        )
        if interrupted:
            how = "interrupted" if stop_signal == "SIGINT" else f"stopped by {stop_signal}"
            print(
                f"dfpo-train: {how} at step {summary['steps']} of {summary['max_steps']}; partial results in "
                f"{training_args.output_dir}",
                file=sys.stderr,
                flush=True,
            )
    # Ending a multi-process launch: the trainer's DDP reducer must not be the last holder of the process group.
    # `trainer.end()` (Transformers) destroys the group; if the reducer then drops the last reference, torch joins
    # gloo's worker threads while holding the GIL, and a worker that needs the GIL to release a finished
    # all-gather's tensors deadlocks the rank (seen in our two-process tests; pytorch/pytorch#56297). Holding the
    # group's Python handle until the trainer is gone makes the handle the last reference, and torch's Python
    # binding releases the GIL while it joins.
    group_handle = default_process_group()
    if hasattr(trainer, "end"):
        trainer.end()
    elif group_handle is not None:
        torch.distributed.destroy_process_group()
    del trainer
    gc.collect()
    del group_handle
    return summary


class EarlierResults(TrainerCallback):
    """Moves an earlier run's results to previous_run/ when the first optimizer step has ended (before a checkpoint
    of that step is saved), or before this run writes its own, whichever comes first; never when the run fails
    before that, so a failure in the user's reward, task or data leaves their files byte for byte as they were."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.done = False

    def set_aside(self) -> None:
        if not self.done:
            self.done = True
            set_aside_earlier_results(self.output_dir)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.set_aside()


def training_row(train: Any, prompt: Any) -> int | None:
    """The training dataset's row whose prompt is ``prompt`` (the first such row), for a failing reward's message;
    None when no row has it or the dataset cannot be read so."""
    if prompt is None:
        return None
    try:
        return next((i for i, row_prompt in enumerate(train["prompt"]) if row_prompt == prompt), None)
    except (KeyError, TypeError):
        return None


def set_aside_earlier_results(output_dir: str) -> None:
    """Move an earlier run's results to previous_run/ (rank 0 only), so no older result passes for this run's."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    moved = set_aside_previous_outputs(output_dir)
    if moved:
        logger.info(
            "%s held an earlier run's results (%s): moved to %s/",
            output_dir,
            ", ".join(moved),
            Path(output_dir) / PREVIOUS_RUN_DIR,
        )


def default_process_group() -> Any:
    """The default process group's Python handle when one is initialised (a multi-process launch), else None."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return None


def parse_and_run(argv: Sequence[str], callbacks: Sequence[TrainerCallback] = ()) -> dict[str, Any]:
    """Parse ``argv`` (recipe and flags; a bad input raises RecipeError) and run it with ``callbacks`` added to the
    trainer's; returns the summary."""
    script_args, training_args, model_args = parse_args(argv)
    return run(script_args, training_args, model_args, command_line_origin(argv), callbacks)


def command_line_origin(argv: Sequence[str]) -> Callable[[str], str]:
    """Where each field of ``argv`` was set: ``--name`` on the command line, or the recipe's file and line."""
    args = recipe_argv(argv)
    recipe = args[args.index("--config") + 1] if "--config" in args else None
    flags = [a for i, a in enumerate(args) if not (a == "--config" or (i > 0 and args[i - 1] == "--config"))]
    return lambda name: field_origin(name, [f"--{name}", f"--{name.replace('_', '-')}"], flags, recipe)
