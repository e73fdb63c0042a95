"""DFPO's objective as pure math, tensors in, tensors out (docs/design.md, docs/cancellation.md).

``weights`` (s, s̄, U, the loss mask), ``transforms`` (the in-group transforms and their registry), ``cancellation``
(the gradient target), ``rewrite`` (the objective as TRL's loss inputs), ``plan`` (the config resolved once into
the functions and constants these take) and ``step`` (one loss micro-step's objective as one call).
"""
