"""DFPO's objective as pure math, tensors in, tensors out (docs/source/concepts/design.md,
docs/source/concepts/cancellation.md).

``weights`` (s, s̄, U, the loss mask, the clipped ratios), ``normalise`` (DelTA's λ̄ = λ N / Z, which the loss
inputs redo per micro-batch for ``bnpo``), ``cancellation`` (the gradient target), ``rewrite`` (the objective as TRL's
loss inputs), ``plan`` (the config resolved once into the functions and constants these take) and ``step`` (the one
function that turns rows into grouped weights, for the loss micro-step and the pre-pass, and a loss micro-step's
objective on top of it). The in-group transforms they apply are the registry's, below the config
(:mod:`dfpo_trl.transforms`).
"""
