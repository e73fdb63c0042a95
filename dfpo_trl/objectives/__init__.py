"""DFPO's objective as pure math, tensors in, tensors out (docs/design.md, docs/cancellation.md).

``weights`` (s, s̄, U, the loss mask), ``normalise`` (DelTA's λ̄ = λ N / Z, which the loss inputs redo per
micro-batch for ``bnpo``), ``cancellation`` (the gradient target), ``rewrite`` (the objective as TRL's loss inputs),
``plan`` (the config resolved once into the functions and constants these take) and ``step`` (one loss micro-step's
objective as one call). The in-group transforms they apply are the registry's, below the config
(:mod:`dfpo_trl.transforms`).
"""
