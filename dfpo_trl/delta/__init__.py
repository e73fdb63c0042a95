"""DelTA token weights (docs/source/concepts/delta.md): discriminative per-token coefficients.

One public entry point, :func:`delta_token_weights` (λ̄ of a batch under a ``DFPOConfig``'s ``delta_*`` fields);
everything else here is internal. ``weights`` holds the math, ``centroids`` the centroids and scores it uses,
``rollout`` the entry point with the trainer's rollout-time call (normalisation domain, reducers, side means, token
table) and ``weighting`` the trainer's DelTA component.
"""

from .rollout import delta_token_weights as delta_token_weights

__all__ = ["delta_token_weights"]
