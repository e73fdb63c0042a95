"""Checks of a command line that need no model, no data and no torch: run first, so a mistake costs a second.

Standard library (and YAML) only, like :mod:`.paths`.
"""

from __future__ import annotations

from .args import RecipeError

__all__ = ["check_max_steps"]


def check_max_steps(value: int, origin: str) -> None:
    """Refuse ``max_steps: 0``. transformers reads any ``max_steps <= 0`` as "train ``num_train_epochs`` epochs"
    (its default is -1), so 0 trained a whole run whose summary looked like any other; a user writing 0 meant
    something else (no training, or "as many as the data has"), and says which with -1 or a positive count."""
    if value == 0:
        raise RecipeError(
            f"{origin}: max_steps 0 would not stop at 0 steps: transformers reads max_steps <= 0 as 'train "
            "num_train_epochs epochs'. Set max_steps to the optimizer steps to train (>= 1), or -1 to train "
            "num_train_epochs epochs over the training prompts."
        )
