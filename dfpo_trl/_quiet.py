"""Silence exactly the library warnings a dfpo-trl user cannot act on.

TRL 1.16's generation and log-prob helpers (``unwrap_model_for_generation``, ``disable_gradient_checkpointing``)
read ``model.is_gradient_checkpointing`` and, with checkpointing on, call ``gradient_checkpointing_disable`` and
``gradient_checkpointing_enable``; transformers >= 5.24 deprecates all three with a FutureWarning on every
rollout. The calls are inside TRL; nothing in a recipe or in the user's code changes them.
"""

from __future__ import annotations

import warnings

TRL_DEPRECATED_CALLS = (
    r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated"
)


def silence_library_deprecations() -> None:
    """Ignore the FutureWarnings of TRL's internal checkpointing calls (and nothing else)."""
    warnings.filterwarnings("ignore", message=TRL_DEPRECATED_CALLS, category=FutureWarning)
