"""Silence exactly the library warnings a dfpo-trl user cannot act on.

TRL 1.16's generation and log-prob helpers (``unwrap_model_for_generation``, ``disable_gradient_checkpointing``)
read ``model.is_gradient_checkpointing``, which transformers >= 5.24 deprecates with a FutureWarning on every
rollout. The call is inside TRL; nothing in a recipe or in the user's code changes it.
"""

from __future__ import annotations

import warnings

TRL_DEPRECATED_PROPERTY = r"`is_gradient_checkpointing` is deprecated"


def silence_library_deprecations() -> None:
    """Ignore the FutureWarning of TRL's internal use of ``is_gradient_checkpointing`` (and nothing else)."""
    warnings.filterwarnings("ignore", message=TRL_DEPRECATED_PROPERTY, category=FutureWarning)
