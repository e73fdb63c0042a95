"""A ``dfpo-train`` run, once its command line passed the fast checks: parse it into the three dataclasses
(:mod:`.parser`), then :func:`run` trains and writes the outputs. Imports torch, transformers and TRL, which
:mod:`.main` imports only when the command is about to train.
"""

from __future__ import annotations

import contextlib
import gc
import logging
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
from ..config.trl_field_rules import launched_processes
from ..metrics.drift_meter import DriftMeterCallback
from ..rewards import RewardError
from ..trainer import DFPOTrainer
from . import logger
from .args import DFPOScriptArguments
from .callbacks import CheckpointRecord, CurveMetricsCallback, FormShareReward
from .data import (
    build_datasets,
    build_drift_problems,
    build_rewards,
    build_task,
    check_reward_model_templates,
    filter_long_prompts,
    prompt_tokens,
)
from .engine import engine_length, engine_start_as_one_line, quiet_vllm_environment
from .evaluation import HeldoutAccuracyCallback
from .files import (
    CHECKPOINT_DIR,
    SetAside,
    aside_folders,
    earlier_results,
    names_said,
    set_aside_previous_outputs,
)
from .model import model_init_kwargs, resolve_model
from .oom import out_of_memory_as_one_line, watch_phases
from .outputs import save_model, write_outputs
from .parser import parse_args
from .peers import lost_peer_as_one_line
from .precheck import field_origin, recipe_argv, split_recipe
from .progress import close_progress_bar, use_dfpo_progress_bar
from .resume import read_run_record
from .signals import further_interrupts_wait, signal_name
from .vllm_eval import avg_at_k_callback, check_eval_batch, default_eval_batch

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
    first = int(os.environ.get("RANK", "0")) == 0
    model_path, model_label = resolve_model(model_args, progress=first and not training_args.disable_tqdm)
    model_seconds = time.monotonic() - model_start  # the embedded model's one-time conversion, or a quick check
    tokenizer = None
    if script_args.max_prompt_length is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
        train = filter_long_prompts(train, tokenizer, script_args.max_prompt_length, training_args.chat_template_kwargs)
    training_args.model_init_kwargs = model_init_kwargs(training_args, model_args)
    avg_at_k = heldout is not None and training_args.use_vllm  # held-out avg@k through TRL's eval path (vLLM)
    if avg_at_k:
        if origin is not None and origin("per_device_eval_batch_size").endswith("(its default)"):
            default_eval_batch(training_args, len(heldout), launched_processes() or 1)
        check_eval_batch(training_args)
    length_source = size_engine(training_args, script_args, heldout if avg_at_k else None, tokenizer)
    if training_args.use_vllm:
        quiet_vllm_environment()
    # An earlier run's results move aside (previous_run/, previous_run.1/, ...) once this run's first optimizer step
    # has ended: a run that ends before that (a failure, Ctrl-C, a kill) leaves output_dir as it was.
    earlier = EarlierResults(training_args.output_dir, training_args.resume_from_checkpoint)

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
    callbacks.insert(0, StartLine(len(train), heldout_cb))
    callbacks.append(CheckpointRecord(heldout_cb))  # what a resumed run reads back (resume.py)
    if heldout_cb is not None and training_args.resume_from_checkpoint:
        heldout_cb.resumed_record = read_run_record(training_args.resume_from_checkpoint).get("heldout")
    with engine_start_as_one_line(training_args, length_source):  # vLLM's refusal to start: one line (engine.py)
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
    wrap_up = contextlib.ExitStack()  # after Ctrl-C: what a second Ctrl-C does while the partial results are written
    try:
        # an out-of-memory error, or a collective failing on a lost or hung peer: one line, nothing removed or
        # written (oom.py, peers.py)
        with out_of_memory_as_one_line(trainer, script_args), lost_peer_as_one_line(trainer), \
                checkpoint_mismatch_said():
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except RewardError as exc:  # the user's reward failed: one line, with the training row it was scoring
        close_progress_bar(trainer)
        earlier.say_kept()
        raise UserCodeError(exc.said(training_row(train, exc.prompt))) from exc
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: keep what was learned about the run, not a traceback
        wrap_up.enter_context(further_interrupts_wait())
        interrupted = True
        stop_signal = signal_name(exc)
        close_progress_bar(trainer)
        curves.on_train_end(training_args, trainer.state, trainer.control)  # the curve up to the last logged step
    except BaseException:
        earlier.say_kept()
        raise
    train_seconds = time.monotonic() - train_start

    with wrap_up:
        summary: dict[str, Any] = {"interrupted": interrupted, "signal": stop_signal}
        how = "interrupted" if stop_signal == "SIGINT" else f"stopped by {stop_signal}"
        if earlier.steps_done(trainer.state) == 0:  # stopped before this run's first optimizer step ended
            if trainer.accelerator.is_main_process:
                said = (f"at step {trainer.state.global_step} of {trainer.state.max_steps}, before this run's first "
                        f"optimizer step ended: nothing written to {training_args.output_dir}{earlier.kept_clause()}")
                print(f"dfpo-train: {how} {said}", file=sys.stderr, flush=True)
        else:
            earlier.set_aside()  # a step ended, though the interrupt came before the callback that moves them
            saved = save_model(trainer, training_args.output_dir) if script_args.save_model and not interrupted else []
            if trainer.accelerator.is_main_process:
                times = {"model": model_seconds, "setup": setup_seconds, "train_call": train_seconds}
                summary = write_outputs(
                    trainer, script_args, training_args, model_label, heldout_cb, curves, times, start, interrupted,
                    saved, drift_cb, stop_signal, earlier.moved_to(),
                )
                if interrupted:
                    moved = f" (the earlier run's moved to {earlier.moved_to()}/)" if earlier.moved_to() else ""
                    said = (f"at step {summary['steps']} of {summary['max_steps']}; partial results in "
                            f"{training_args.output_dir}{moved}")
                    print(f"dfpo-train: {how} {said}", file=sys.stderr, flush=True)
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
    """Moves the earlier run's results in ``output_dir`` aside when this run's first optimizer step has ended (before
    a checkpoint of that step is saved), never before: a run that fails, is interrupted or is killed before that
    leaves them byte for byte where they were, and :meth:`say_kept` says so. Nothing is ever deleted: they go to the
    first free ``previous_run/``, ``previous_run.1/``, ... (files.py). A run resuming from ``checkpoint-K/`` of
    ``output_dir`` keeps ``checkpoint-N/`` for N <= K there (its own history); every other checkpoint moves with
    the rest."""

    def __init__(self, output_dir: str, resume_from: str | None = None) -> None:
        self.output_dir = output_dir
        self.keep_checkpoints_to = resumed_step_in(output_dir, resume_from)
        self.outcome: SetAside | None = None
        self.start_step: int | None = None  # the global step train() began at (the resume step, or 0)

    def steps_done(self, state: Any) -> int:
        """The optimizer steps this run's train() has ended (0 before its on_train_begin)."""
        return 0 if self.start_step is None else state.global_step - self.start_step

    def set_aside(self) -> None:
        if self.outcome is None:
            self.outcome = set_aside_earlier_results(self.output_dir, self.keep_checkpoints_to)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start_step = state.global_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.outcome is None:
            self.set_aside()
            if args.world_size > 1:  # no process writes this step's checkpoint before process 0 has moved an old one
                from accelerate import PartialState

                PartialState().wait_for_everyone()

    def moved_to(self) -> str | None:
        """The aside folder this run moved the earlier run's results to, or None."""
        target = self.outcome.target if self.outcome is not None else None
        return str(target) if target is not None else None

    def kept_clause(self) -> str:
        """``; the earlier run's results there (...) are kept in place`` when output_dir holds any, else ""."""
        if self.outcome is not None or int(os.environ.get("RANK", "0")) != 0:
            return ""
        present = earlier_results(self.output_dir, self.keep_checkpoints_to)
        runs = [f"{p.name}/" for p in aside_folders(self.output_dir)]
        if not present and not runs:
            return ""
        parts = [f"the earlier run's results there ({names_said(present)})"] if present else []
        parts += [f"the earlier runs in {', '.join(runs)}"] if runs else []
        return f"; {' and '.join(parts)} are kept in place"

    def say_kept(self) -> None:
        """Log that the earlier runs' results stay where they are, for a run that fails before its first step."""
        clause = self.kept_clause()
        if clause:
            logger.info("%s: this run ended before its first optimizer step%s", self.output_dir, clause)


class StartLine(TrainerCallback):
    """The line that opens training: how many optimizer steps it makes (what ``max_steps -1`` means in steps: the
    epochs over the training prompts), from where when resumed, and what comes first (the held-out evaluation)."""

    def __init__(self, prompts: int, heldout_cb: Any = None) -> None:
        self.prompts = prompts
        self.heldout_cb = heldout_cb

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if args.max_steps > 0:
            steps = f"{state.max_steps} optimizer steps (max_steps {args.max_steps})"
        else:
            steps = (f"{state.max_steps} optimizer steps (max_steps {args.max_steps}: num_train_epochs "
                     f"{args.num_train_epochs:g} over {self.prompts} training prompts)")
        where = f", resuming at step {state.global_step}" if state.global_step else ""
        first = ""
        if self.heldout_cb is not None and not state.global_step:
            held = self.heldout_cb
            first = f"; first the held-out {held.label} before training on {held.results['n']} problems"
        logger.info("training %s%s%s", steps, where, first)


class _SaidMismatch(logging.Filter):
    """transformers' raw lines saying a resumed run's steps differ from the checkpoint's ("Warning: The following
    arguments do not match ... save_steps: 500 (from args) != 2 (from trainer_state.json)"): the parse already took
    the checkpoint's values, or said in one line the ones the command line changes (parser.resume_like_the_checkpoint),
    so they are not printed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "do not match the ones in the `trainer_state.json`" not in record.getMessage()


@contextlib.contextmanager
def checkpoint_mismatch_said() -> Any:
    said = _SaidMismatch()
    transformers_logger = logging.getLogger("transformers.trainer_utils")
    transformers_logger.addFilter(said)
    try:
        yield
    finally:
        transformers_logger.removeFilter(said)


def resumed_step_in(output_dir: str, resume_from: str | None) -> int | None:
    """K when ``resume_from`` is ``output_dir/checkpoint-K/``, else None (a fresh run, or a checkpoint elsewhere)."""
    if not resume_from:
        return None
    folder = Path(resume_from)
    match = CHECKPOINT_DIR.match(folder.name)
    same = Path(output_dir).exists() and folder.parent.exists() and folder.parent.samefile(output_dir)
    return int(match.group(1)) if match and same else None


def size_engine(training_args: DFPOConfig, script_args: DFPOScriptArguments, heldout: Any, tokenizer: Any) -> str:
    """Give the colocated engine the context the run needs when ``vllm_max_model_length`` is unset
    (:func:`.engine.engine_length`: the longest prompt it is sent plus ``max_completion_length``); returns where the
    engine's length comes from: ``"set"`` (the user's), ``"run"`` (filled here) or ``"model"`` (vLLM's default)."""
    if training_args.vllm_max_model_length is not None:
        return "set"
    if not (training_args.use_vllm and training_args.vllm_mode == "colocate"):
        return "model"  # the server sizes its own engine (`vllm serve --max-model-len`)
    longest = None
    if heldout is not None and tokenizer is not None:  # avg@k's prompts are not filtered by max_prompt_length
        longest = max(prompt_tokens(p, tokenizer, training_args.chat_template_kwargs) for p in heldout["prompt"])
    length = engine_length(script_args.max_prompt_length, training_args.max_completion_length, longest)
    if length is None:
        return "model"
    training_args.vllm_max_model_length = length
    heldout_said = f", a held-out prompt of {longest}" if longest and longest > script_args.max_prompt_length else ""
    logger.info("vllm_max_model_length unset: the colocated vLLM engine holds %d tokens (max_prompt_length %d%s + "
                "max_completion_length %d)", length, script_args.max_prompt_length, heldout_said,
                training_args.max_completion_length)
    return "run"


def training_row(train: Any, prompt: Any) -> int | None:
    """The training dataset's row whose prompt is ``prompt`` (the first such row), for a failing reward's message;
    None when no row has it or the dataset cannot be read so."""
    if prompt is None:
        return None
    try:
        return next((i for i, row_prompt in enumerate(train["prompt"]) if row_prompt == prompt), None)
    except (KeyError, TypeError):
        return None


def set_aside_earlier_results(output_dir: str, keep_checkpoints_to: int | None = None) -> SetAside:
    """Move an earlier run's results aside (rank 0 only), so no older result passes for this run's, and say where
    to, and which earlier runs stay where they are. On the other ranks nothing moves (an empty SetAside)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return SetAside()
    outcome = set_aside_previous_outputs(output_dir, keep_checkpoints_to)
    if outcome.target is not None:
        kept = f"; earlier runs kept in place: {', '.join(f'{p.name}/' for p in outcome.kept)}" if outcome.kept else ""
        logger.info("%s held an earlier run's results (%s): moved to %s/%s", output_dir, names_said(outcome.moved),
                    outcome.target, kept)
    return outcome


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
    recipe, flags = split_recipe(args)
    return lambda name: field_origin(name, [f"--{name}", f"--{name.replace('_', '-')}"], flags, recipe)
