"""The refusals of a command line's model, reward-model and dataset paths and of its choices between fields that need
only the text and the file system: checked by :func:`.precheck.precheck` before torch is imported (a second, not
the 10 to 40 s of the imports), and by the run itself in the same words, for callers that skip the fast path.

A value is a local path when it is written as one: absolute, or starting with ``./``, ``../`` or ``~`` (``.`` and
``..`` too). A hub id (``org/name``) never is, so a path that looks local and is not there is a typo, not a model
to download. Standard library only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from .args import RecipeError

__all__ = [
    "HUB_ID", "check_local_inputs", "eval_batch_problem", "looks_local", "model_path_problem",
    "reward_model_given", "reward_model_problem", "unread_dataset_problem",
]  # fmt: skip

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a hub repository id, "org/name"
MODEL_FIX = (
    "give a transformers checkpoint directory (saved with save_pretrained), a local .gguf file, a hub id "
    "'org/name', or omit model_name_or_path to use the embedded SmolLM2-135M-Instruct default"
)

Value = Callable[[str], Any]  # a field's value as the user set it (flag, recipe) or its default
Origin = Callable[[str], str]  # where a field's value came from, for a message


def looks_local(value: str) -> bool:
    """Whether ``value`` is written as a local path (absolute, ``./``, ``../``, ``~``), which no hub id is."""
    return value in (".", "..") or value.startswith(("/", "./", "../", "~"))


def model_path_problem(value: Any) -> str | None:
    """Why ``model_name_or_path`` written as a local path cannot be loaded (it does not exist, or is a file that is
    not a .gguf), or None (not written as a path, or a folder, or a .gguf file)."""
    if not isinstance(value, str) or not looks_local(value):
        return None
    path = os.path.expanduser(value)
    if os.path.isdir(path) or (os.path.isfile(path) and path.lower().endswith(".gguf")):
        return None
    what = "does not exist" if not os.path.exists(path) else "is a file, not a checkpoint directory or a .gguf file"
    return f"model_name_or_path {value!r} {what}; {MODEL_FIX}"


def reward_model_given(name: str) -> bool:
    """Whether a ``reward_funcs`` entry names a reward model (a path or a hub id ``org/name``), not a function."""
    return os.path.isdir(name) or name.startswith((".", "/", "~")) or HUB_ID.fullmatch(name) is not None


def reward_model_problem(name: str) -> str | None:
    """Why a ``reward_funcs`` entry that names a local reward model cannot be one (not a directory; a directory
    without the model's config or its tokenizer, which TRL loads from it), or None (a loadable folder, a hub id)."""
    if os.path.isdir(name):
        missing = [what for what, files in (("config.json", ("config.json",)),
                                            ("tokenizer (tokenizer.json or tokenizer_config.json)",
                                             ("tokenizer.json", "tokenizer_config.json")))
                   if not any(os.path.isfile(os.path.join(name, f)) for f in files)]
        if not missing:
            return None
        return (f"reward_funcs: {name!r} has no {' and no '.join(missing)}; a reward model is a directory saved "
                "with save_pretrained (an AutoModelForSequenceClassification with num_labels=1) and its tokenizer.")
    if HUB_ID.fullmatch(name):
        return None
    return (f"reward_funcs: {name!r} is not a directory; give a reward model's directory (saved with "
            "save_pretrained), a hub id 'org/name', a registered reward or an import path 'package.module:function'.")


def unread_dataset_problem(dataset: Any, task: Any) -> str | None:
    """A ``dataset`` that the task does not read (only ``math`` reads one): the run would train without it."""
    if dataset is None or task == "math":
        return None
    return (f"dataset={dataset!r} is set but task={task!r} does not read it; set task: math to train on a "
            "`datasets` dataset.")


def eval_batch_problem(per_device_eval_batch_size: int, k: int) -> str | None:
    """An eval batch that would split a problem's k completions of the held-out avg@k (through vLLM) across batches
    or processes: TRL samples the k of a problem next to each other, and avg@k groups them per process batch."""
    if per_device_eval_batch_size % k == 0:
        return None
    return (f"per_device_eval_batch_size ({per_device_eval_batch_size}) must be a multiple of num_generations_eval "
            f"({k}, the k of the held-out avg@k through vLLM): set --per_device_eval_batch_size "
            f"{k * max(1, per_device_eval_batch_size // k)} or --num_generations_eval to a divisor of it")


def _as_int(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _as_bool(value: Any) -> bool:
    return str(value).lower() in ("yes", "true", "t", "y", "1")


def check_local_inputs(value: Value, origin: Origin) -> None:
    """The model path, the reward models' folders, a dataset the task does not read, and the avg@k eval batch, from
    the command line's values (the flag, else the recipe, else the default): the first problem raises a one-line
    :class:`RecipeError` headed by where the field was set, as the run says it after torch."""
    problem = model_path_problem(value("model_name_or_path"))
    if problem is not None:
        raise RecipeError(f"{origin('model_name_or_path')}: {problem}")
    rewards = value("reward_funcs")
    for name in [rewards] if isinstance(rewards, str) else rewards if isinstance(rewards, list) else []:
        if isinstance(name, str) and reward_model_given(name) and (problem := reward_model_problem(name)):
            raise RecipeError(f"{origin('reward_funcs')}: {problem}")
    problem = unread_dataset_problem(value("dataset"), value("task"))
    if problem is not None:
        raise RecipeError(f"{origin('dataset')}: {problem}")
    batch, generations = _as_int(value("per_device_eval_batch_size")), _as_int(value("num_generations"))
    k = _as_int(value("num_generations_eval")) or generations
    eval_size = _as_int(value("eval_size"))
    measured = not _as_bool(value("skip_eval")) and (eval_size is None or eval_size > 0)
    if _as_bool(value("use_vllm")) and measured and batch and k and (problem := eval_batch_problem(batch, k)):
        raise RecipeError(f"{origin('per_device_eval_batch_size')}: {problem}")
