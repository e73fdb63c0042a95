"""The colocated vLLM engine as ``dfpo-train`` starts it: the context it is sized for, its environment, and its
start-up refusals said in one line (docs/source/concepts/decisions.md, "The colocated vLLM engine").

* :func:`engine_length`: with ``vllm_max_model_length`` unset, the engine holds the longest prompt the run sends
  (``max_prompt_length``, or a longer held-out prompt of the avg@k evaluation) plus ``max_completion_length``,
  instead of vLLM's default, the model's whole context (40,960 tokens for Qwen3-8B), whose one-request KV cache a
  small engine cannot hold. A value the user set is kept; without ``max_prompt_length`` vLLM's default stands.
* :func:`quiet_vllm_environment`: vLLM's usage statistics off (``VLLM_NO_USAGE_STATS``, ``DO_NOT_TRACK``) unless the
  user set either; on a machine without network vLLM's reporting thread dies printing a traceback.
* :func:`engine_start_as_one_line`: vLLM's refusals to start (KV cache too small for one request, no memory left for
  it, less free memory than asked for, a context longer than the model's) become :class:`EngineStartFailed`, one
  line naming the fields that fix them with the values computable from vLLM's own numbers.

Light at import (no torch, no vLLM): :mod:`.main` names :class:`EngineStartFailed`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "EngineStartFailed",
    "engine_length",
    "engine_start_as_one_line",
    "engine_start_message",
    "quiet_vllm_environment",
]

#: vLLM's usage-statistics switches; :func:`quiet_vllm_environment` sets both when the user set neither.
USAGE_STATS_VARIABLES = ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")

# vLLM's start-up refusals, as vLLM 0.22-0.31 word them (vllm/v1/core/kv_cache_utils.py, the memory check of
# vllm/v1/worker, vllm/config/model.py); the spelling moved between releases ("models's" / "model's", a parenthesis
# before the needed GiB or not, the device named or not), so each pattern takes both.
KV_CACHE_TOO_SMALL = re.compile(
    r"max seq len \((?P<length>\d+)\), \(?(?P<needed>[\d.]+) GiB KV cache\)? is needed, which is larger than the "
    r"available KV cache memory \((?P<available>-?[\d.]+) GiB\)(?:\. Based on the available memory, the estimated "
    r"maximum model length is (?P<fits>\d+))?"
)
NO_KV_CACHE_MEMORY = re.compile(r"No available memory for the cache blocks")
FREE_MEMORY_TOO_SMALL = re.compile(
    r"Free memory on device(?: \S+)? \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on startup is less than desired GPU "
    r"memory utilization \((?P<utilization>[\d.]+), (?P<requested>[\d.]+) GiB\)"
)
LONGER_THAN_MODEL = re.compile(
    r"User-specified max_model_len \((?P<length>\d+)\) is greater than the derived max_model_len "
    r"\((?:[^=()]*=)?(?P<model>\d+)"
)


class EngineStartFailed(RuntimeError):
    """vLLM refused to start the run's colocated engine; the message is the whole report (one line)."""


def quiet_vllm_environment(environ: Any = None) -> bool:
    """Turn vLLM's usage statistics off (both :data:`USAGE_STATS_VARIABLES` set to 1) unless the user set either
    of them (the shell, or the recipe's ``env:``); True when this set them."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in USAGE_STATS_VARIABLES):
        return False
    for name in USAGE_STATS_VARIABLES:
        environ[name] = "1"
    return True


def engine_length(
    max_prompt_length: int | None, max_completion_length: int, longest_heldout_prompt: int | None = None
) -> int | None:
    """The context the run's colocated engine needs: the longest prompt it is sent (``max_prompt_length``, the
    bound on the training prompts, or a longer held-out prompt of the avg@k evaluation, which is not filtered)
    plus ``max_completion_length``; None without ``max_prompt_length`` (no bound: vLLM takes the model's own)."""
    if max_prompt_length is None:
        return None
    return max(max_prompt_length, longest_heldout_prompt or 0) + max_completion_length


def _gib(value: float) -> str:
    return f"{value:.2f} GiB"


def _round_up(value: float, step: float = 0.01) -> float:
    return round(math.ceil(value / step - 1e-9) * step, 2)


def _round_down(value: float, step: float = 0.01) -> float:
    return round(math.floor(value / step + 1e-9) * step, 2)


def engine_start_message(text: str, args: Any, length_source: str, total_gib: float | None) -> str | None:
    """The one line for vLLM's refusal ``text`` (None when it is none of the four), for a run with config ``args``.
    ``length_source`` says where the engine's length came from: ``"set"`` (the user's ``vllm_max_model_length``),
    ``"run"`` (:func:`engine_length`'s, from ``max_prompt_length``) or ``"model"`` (vLLM's default, the model's
    own); ``total_gib`` is the GPU's memory when known."""
    utilization = args.vllm_gpu_memory_utilization
    completion = args.max_completion_length
    share = f"vllm_gpu_memory_utilization {utilization}" + (
        f" of the GPU's {total_gib:.1f} GiB = {utilization * total_gib:.1f} GiB" if total_gib else " of the GPU"
    )
    kept = f"Nothing in {args.output_dir} was written or removed"
    found = KV_CACHE_TOO_SMALL.search(text)
    if found:
        length, needed, available = int(found["length"]), float(found["needed"]), float(found["available"])
        fits = int(found["fits"]) if found["fits"] else None
        said = {
            "set": f"vllm_max_model_length {length}",
            "run": f"vllm_max_model_length {length} (unset: max_prompt_length + max_completion_length)",
            "model": f"the model's whole context, {length} tokens (vllm_max_model_length and max_prompt_length unset)",
        }[length_source]
        fixes = []
        if length_source == "model":
            fixes.append(
                f"--max_prompt_length P (the engine then holds P + max_completion_length {completion}"
                f"{f', at most {fits} in all' if fits else ''}) or --vllm_max_model_length "
                f"{fits if fits else 'L'}"
            )
        elif fits:
            fixes.append(
                f"--vllm_max_model_length {fits} or less (with --max_completion_length, now {completion}, below it)"
            )
        else:
            fixes.append(f"a shorter --vllm_max_model_length or --max_completion_length (now {completion})")
        if total_gib:
            fixes.append(
                f"--vllm_gpu_memory_utilization {_round_up(utilization + (needed - available) / total_gib)}"
                f" or more (now {utilization})"
            )
        else:
            fixes.append(f"a larger --vllm_gpu_memory_utilization (now {utilization})")
        return (
            f"vLLM did not start: one request of {said} needs {_gib(needed)} of KV cache, and the engine has "
            f"{_gib(available)} left for it after the model's weights and activations ({share}); set "
            f"{'; or '.join(fixes)}. {kept}"
        )
    if NO_KV_CACHE_MEMORY.search(text):
        seqs = args.per_device_train_batch_size * args.steps_per_generation
        return (
            f"vLLM did not start: the model's weights and activations fill the engine's memory ({share}) and "
            f"leave none for its KV cache; set a larger --vllm_gpu_memory_utilization (now {utilization}), or "
            f"lower --per_device_train_batch_size or --steps_per_generation (the engine runs up to "
            f"{args.per_device_train_batch_size} x {args.steps_per_generation} = {seqs} sequences at once, "
            f"vLLM's max_num_seqs, which sets the activations it reserves). {kept}"
        )
    found = FREE_MEMORY_TOO_SMALL.search(text)
    if found:
        free, total = float(found["free"]), float(found["total"])
        requested = float(found["requested"])
        return (
            f"vLLM did not start: the GPU has {_gib(free)} free of {_gib(total)} when the engine starts (the "
            f"trainer's model and any other process hold the rest), less than vllm_gpu_memory_utilization "
            f"{utilization} asks for ({_gib(requested)}); set --vllm_gpu_memory_utilization "
            f"{_round_down(free / total)} or less, or free the GPU of other processes. {kept}"
        )
    found = LONGER_THAN_MODEL.search(text)
    if found:
        length, model = int(found["length"]), int(found["model"])
        said = {
            "set": f"vllm_max_model_length {length}",
            "run": f"vllm_max_model_length {length} (unset: max_prompt_length + max_completion_length)",
            "model": f"vllm_max_model_length {length}",
        }[length_source]
        return (
            f"vLLM did not start: {said} is longer than the model's context of {model} tokens; set "
            f"--vllm_max_model_length {model} or less, or lower --max_prompt_length and --max_completion_length "
            f"(now {completion}) to at most {model} together. {kept}"
        )
    return None


def _gpu_total_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


@contextmanager
def engine_start_as_one_line(args: Any, length_source: str) -> Iterator[None]:
    """Turn vLLM's start-up refusals raised inside (building the trainer, which builds the colocated engine) into
    :class:`EngineStartFailed` with :func:`engine_start_message`'s line; any other error passes unchanged."""
    try:
        yield
    except ValueError as exc:  # pydantic's ValidationError (the length check) is a ValueError too
        if not (args.use_vllm and args.vllm_mode == "colocate"):
            raise
        message = engine_start_message(str(exc), args, length_source, _gpu_total_gib())
        if message is None:
            raise
        raise EngineStartFailed(message) from None
