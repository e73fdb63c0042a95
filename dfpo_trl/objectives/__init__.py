"""DFPO's objective as pure math, tensors in, tensors out (docs/design.md, docs/cancellation.md).

``weights`` (s, s̄, U, the loss mask), ``transforms`` (the registry of in-group transforms), ``transform_entry``
(what one entry of it is), ``transform_math`` (the built-ins' math), ``transform_probe`` (the check a registered
transform passes), ``cancellation`` (the gradient target), ``rewrite`` (the objective as TRL's loss inputs), ``plan``
(the config resolved once into the functions and constants these take) and ``step`` (one loss micro-step's objective
as one call).
"""
