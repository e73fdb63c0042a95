"""The trained-weights runs' math task, given to ``dfpo-train --task dfpo_bench.trained.tasks:two_step`` (the runs
start in the repository root).

GSM8K cannot be reached from the GPU machine, so the problems are generated offline: "Compute a × b + c" with
two-digit a, b and a three-digit c. A trained 0.5B instruct model solves a part of them, not all, so most groups of
8 completions hold both rewarded and unrewarded answers (the signal the group objectives need), and a wrong answer
is written in the same form as a right one. The reward is 1 when the completion's last number is the answer
(the registered reward ``arithmetic_correct``, the embedded default's rule), else 0.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from datasets import Dataset
from dfpo_trl.cli import get_reward

TRAIN = "train"  # the training split's name in a task's build_dataset (docs/source/guides/cli.md); the other is "test"
TWO_STEP_PROMPT = "Compute {a} × {b} + {c}. Show your work briefly, then give the final answer as: Answer: <number>"
# The held-out problems come from one fixed stream whatever the run's seed; training problems from a stream keyed by
# the seed and a salt, so the two never coincide.
_HELDOUT_SEED = 20261128
_TRAIN_SALT = "dfpo-two-step-train"


def two_step_problems(split: str, n: int, seed: int) -> list[tuple[int, int, int]]:
    """``n`` triples (a, b, c), a and b in [10, 99], c in [100, 999], from the split's stream."""
    rng = random.Random(f"{_TRAIN_SALT}:{seed}") if split == TRAIN else random.Random(_HELDOUT_SEED)
    return [(rng.randint(10, 99), rng.randint(10, 99), rng.randint(100, 999)) for _ in range(n)]


@dataclass
class TwoStepTask:
    """Two-step arithmetic "Compute a × b + c", rewarded on the completion's last number."""

    name: str = "two_step"
    default_train_size: int = 4000
    default_heldout_size: int = 64
    reward_funcs: list[Callable[..., list[float]]] = field(default_factory=lambda: [get_reward("arithmetic_correct")])

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows: ``prompt`` (one user message) and ``answer`` (a·b + c)."""
        if n is None:
            n = self.default_train_size if split == TRAIN else self.default_heldout_size
        triples = two_step_problems(split, n, seed)
        return Dataset.from_dict({
            "prompt": [[{"role": "user", "content": TWO_STEP_PROMPT.format(a=a, b=b, c=c)}] for a, b, c in triples],
            "answer": [a * b + c for a, b, c in triples],
        })


def two_step() -> TwoStepTask:
    """The task factory ``--task dfpo_bench.trained.tasks:two_step`` calls."""
    return TwoStepTask()
