"""An out-of-memory error anywhere in a ``dfpo-train`` run as one line: the phase it happened in, the sizes that set
that phase's memory, and the two or three settings that lower it (docs/source/guides/cli.md, "Out of memory").

:func:`watch_phases` wraps the trainer's phases on its instance (generation, DFPO's pre-pass, the loss micro-step,
the held-out evaluation): the innermost one an error passes through names it. :func:`out_of_memory_as_one_line`
turns ``torch.OutOfMemoryError`` into :class:`RunOutOfMemory`, which :mod:`.main` prints without a traceback, as it
prints a recipe's error. Nothing is written or removed on the way out: checkpoints and the user's files stay.
This module imports torch only inside its functions, so :mod:`.main` can name :class:`RunOutOfMemory`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["RunOutOfMemory", "oom_message", "out_of_memory_as_one_line", "watch_phases"]

PHASE_ATTRIBUTE = "_dfpo_phase"  # set on the error by the innermost phase it passes through


class RunOutOfMemory(RuntimeError):
    """A run that ran out of accelerator memory; the message is the whole report (one line)."""


def _mark(phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` naming ``phase`` on an out-of-memory error that no inner phase has named."""
    import torch

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if not hasattr(exc, PHASE_ATTRIBUTE):
                setattr(exc, PHASE_ATTRIBUTE, phase)
            raise

    return wrapped


def _within(phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` prefixing ``phase`` to the phase an inner one named (the held-out evaluation generates too)."""
    import torch

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            inner = getattr(exc, PHASE_ATTRIBUTE, None)
            setattr(exc, PHASE_ATTRIBUTE, f"{phase} ({inner})" if inner else phase)
            raise

    return wrapped


def watch_phases(trainer: Any, heldout: Any = None) -> None:
    """Wrap ``trainer``'s phases (and ``heldout``'s measurement) on the instances, so an out-of-memory error
    carries the phase it happened in. Only the instances change, not the classes."""
    use_vllm = bool(trainer.args.use_vllm)
    trainer._generate = _mark(f"generation ({'vLLM' if use_vllm else 'transformers generate'})", trainer._generate)
    pre_pass = getattr(trainer, "pre_pass", None)
    if pre_pass is not None:
        pre_pass.run = _mark("DFPO pre-pass", pre_pass.run)
    trainer.training_step = _mark("loss micro-step (forward and backward)", trainer.training_step)
    if heldout is not None:
        heldout._accuracy = _within("held-out evaluation", heldout._accuracy)


def _gpu_capacity() -> str | None:
    """The first GPU's memory, when there is one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB"


def _fixes(phase: str, args: Any, script_args: Any) -> list[str]:
    """The two or three settings that lower the memory of ``phase``, with their current values."""
    # dfpo-train sets expandable segments unless the user chose another setting (allocator.py): named then only
    expandable = [] if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower() else [
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation)"]
    shorter = f"--max_completion_length (now {args.max_completion_length})"
    if phase.startswith("held-out evaluation"):
        if args.use_vllm and "(generation" in phase:
            return [f"--per_device_eval_batch_size (now {args.per_device_eval_batch_size})",
                    f"--num_generations_eval (k of avg@k, now {args.num_generations_eval or args.num_generations})",
                    "--skip_eval true"]
        if args.use_vllm:  # its forwards and scoring: each forward has the training batch's rows (eval_forward_chunks)
            return [f"--vllm_gpu_memory_utilization (now {args.vllm_gpu_memory_utilization}; the engine's share of "
                    "the GPU, the rest is the trainer's)",
                    f"--per_device_train_batch_size (now {args.per_device_train_batch_size}: the rows of each of the "
                    "evaluation's forwards)", "--skip_eval true"]
        return [f"--eval_batch_size (now {script_args.eval_batch_size})",
                f"--eval_max_new_tokens (now {script_args.eval_max_new_tokens})", "--skip_eval true"]
    if phase.startswith("generation (vLLM"):
        return [f"--vllm_gpu_memory_utilization (now {args.vllm_gpu_memory_utilization}; the engine's share of the "
                "GPU)", shorter, *expandable]
    if phase.startswith("generation"):
        per_device = args.per_device_train_batch_size * args.steps_per_generation
        return [f"--steps_per_generation (now {args.steps_per_generation}: {per_device} completions per generate "
                "call)", shorter, *expandable]
    if phase.startswith("DFPO pre-pass"):
        return [f"--prepass_batch_size (now {args.prepass_batch_size or 4 * args.per_device_train_batch_size} rows "
                "per no-grad chunk)", shorter, *expandable]
    checkpointing = "" if args.gradient_checkpointing else "--gradient_checkpointing true, "
    return [f"--per_device_train_batch_size {max(1, args.per_device_train_batch_size // 2)} with --group_layout "
            f"pre_pass (groups split over micro-steps; now {args.per_device_train_batch_size})",
            f"{checkpointing}{shorter}", *expandable]


def oom_message(phase: str, args: Any, script_args: Any, step: int | None) -> str:
    """The one line: phase, sizes, the settings that lower it, and what was kept."""
    sizes = [f"rollout of {args.generation_batch_size} completions (G = {args.num_generations})",
             f"max_completion_length {args.max_completion_length}",
             f"per_device_train_batch_size {args.per_device_train_batch_size}"]
    capacity = _gpu_capacity()
    if capacity is not None:
        sizes.append(f"GPU {capacity}")
    where = f" at step {step}" if step is not None else ""
    return (f"out of memory in the {phase}{where} ({', '.join(sizes)}); lower it with "
            f"{'; '.join(_fixes(phase, args, script_args))}. Nothing in {args.output_dir} was removed; its checkpoints "
            "stay")


@contextmanager
def out_of_memory_as_one_line(trainer: Any, script_args: Any) -> Iterator[None]:
    """Turn an out-of-memory error raised inside into :class:`RunOutOfMemory` with :func:`oom_message`'s line."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as exc:
        phase = getattr(exc, PHASE_ATTRIBUTE, "training loop")
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        raise RunOutOfMemory(oom_message(phase, trainer.args, script_args, step)) from None
