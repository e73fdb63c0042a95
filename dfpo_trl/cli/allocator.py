"""PyTorch's CUDA allocator as ``dfpo-train`` sets it: expandable segments unless the user chose a setting
(docs/source/concepts/decisions.md, "The colocated vLLM engine").

A rollout's tensors change size at every step (the completions' lengths vary), and PyTorch's default allocator keeps
the blocks of each size it was asked for: measured on one H200 with the 8B LoRA recipe at batch 8, its peak reserved
memory was 44.3 GiB against 25.4 GiB with ``expandable_segments:True``, for the same peak allocated (23.3 GiB). So
``dfpo-train`` sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when neither ``PYTORCH_CUDA_ALLOC_CONF`` nor
``PYTORCH_ALLOC_CONF`` is set (in the shell or the recipe's ``env:``), and not with ``vllm_enable_sleep_mode``, whose
memory pool vLLM refuses beside expandable segments. It has to happen before torch initialises CUDA, which the
parse of the recipe already does (the bf16 check), so :mod:`.main` calls it before it imports :mod:`.train`.
Light: no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .args import RecipeError
from .precheck import _flag_value, read_recipe, recipe_argv, split_recipe

__all__ = ["ALLOCATOR_VARIABLES", "EXPANDABLE_SEGMENTS", "default_allocator"]

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"
SLEEP_MODE_FLAGS = ("--vllm_enable_sleep_mode", "--vllm-enable-sleep-mode")


def _true(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "1", "yes")


def default_allocator(argv: Sequence[str], environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for the run of ``argv`` (recipe and flags) unless
    the user set an allocator variable or the run uses vLLM's sleep mode; True when it was set."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in ALLOCATOR_VARIABLES):
        return False
    try:
        args = recipe_argv(argv)
        recipe = split_recipe(args)[0]
        settings: Mapping[str, Any] = read_recipe(recipe) if recipe else {}
        recipe_env = yaml.safe_load(Path(recipe).read_text()).get("env") if recipe else None
    except (RecipeError, OSError, ValueError, yaml.YAMLError):
        return False  # the run reports the recipe's problem itself
    if isinstance(recipe_env, Mapping) and any(name in recipe_env for name in ALLOCATOR_VARIABLES):
        return False
    sleep = _flag_value(args, SLEEP_MODE_FLAGS)
    if _true(settings.get("vllm_enable_sleep_mode") if sleep is None else sleep):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return True
