"""DFPO's objective as pure math, tensors in, tensors out: sequence weights, transforms, the gradient target, the
loss-input rewrite, and the plan that resolves the config into them (docs/design.md, docs/cancellation.md)."""
