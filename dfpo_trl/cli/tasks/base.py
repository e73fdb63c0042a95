"""What a task is: the Task protocols, the train and held-out splits, and the text of a TRL completion.

A task is anything with a ``name``, a list of ``reward_funcs`` and a ``build_dataset(split, n, seed)`` method.
Datasets are in TRL's conversational format: a ``"prompt"`` column holding a list of ``{"role", "content"}``
messages, plus the columns the reward functions read (TRL passes every column except ``"prompt"`` to them as
keyword arguments, one list entry per completion).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from datasets import Dataset

from ...rewards import RewardFunc

TRAIN_SPLIT = "train"
# The held-out split is what the before/after greedy accuracy is measured on.
HELDOUT_SPLIT = "test"
_SPLITS = (TRAIN_SPLIT, HELDOUT_SPLIT)


@runtime_checkable
class Task(Protocol):
    """What the trainer needs from a task: a name, its reward functions, and a dataset builder."""

    name: str
    reward_funcs: list[RewardFunc]

    def build_dataset(self, split: str, n: int | None, seed: int) -> Dataset:
        """``split`` is ``"train"`` or ``"test"`` (held-out); ``n`` rows (``None``: the task's default)."""
        ...


@runtime_checkable
class EquivalentFormsTask(Task, Protocol):
    """A task whose fully correct answer can be written in several surface forms that its reward scores alike: what
    the equivalent-solution drift meter (dfpo_trl.metrics.drift, ``drift_every``) measures.
    ``equivalent_forms(row)`` gives one canonical completion per form (in ``form_names`` order) for a dataset row;
    ``form_of(completion, row)`` says which form a completion is, or None."""

    form_names: tuple[str, ...]

    def equivalent_forms(self, row: Mapping[str, Any]) -> list[str]: ...

    def form_of(self, completion: Any, row: Mapping[str, Any]) -> int | None: ...


def check_split(split: str) -> None:
    """Refuse a split other than ``"train"`` and ``"test"``."""
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(_SPLITS)}")


def completion_text(completion: Any) -> str:
    """Text of one TRL completion: a plain string, or a conversational list of messages.

    For conversational completions the assistant messages' contents are joined, so a multi-turn
    completion is scored on everything the model wrote.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence):
        parts = []
        for message in completion:
            if isinstance(message, Mapping):
                if message.get("role", "assistant") == "assistant":
                    content = message.get("content")
                    if isinstance(content, list):  # multimodal content blocks: keep the text blocks
                        content = "".join(b.get("text", "") for b in content if isinstance(b, Mapping))
                    parts.append(str(content or ""))
            else:
                parts.append(str(message))
        return "\n".join(parts)
    raise TypeError(
        f"unsupported completion type {type(completion).__name__}: expected str or list of messages"
    )
