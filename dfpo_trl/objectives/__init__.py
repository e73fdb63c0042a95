"""DFPO's objective as pure math, tensors in, tensors out (docs/design.md, docs/cancellation.md).

``weights`` (s, s̄, U, the loss mask, the clipped ratios), ``transforms`` (the registry of in-group transforms),
``transform_entry`` (what one entry of it is), ``transform_math`` (the built-ins' math), ``transform_probe`` (the
check a registered transform passes), ``cancellation`` (the gradient target), ``rewrite`` (the objective as TRL's
loss inputs), ``plan`` (the config resolved once into the functions and constants these take) and ``step`` (the one
function that turns rows into grouped weights, for the loss micro-step and the pre-pass, and a loss micro-step's
objective on top of it).
"""
