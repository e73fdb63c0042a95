"""Float comparisons held to what the computation's rounding can promise, on any CPU.

The rule: two results of the same math reached by different float operations (another code path, another reduction
order, another CPU's vector kernels) may differ by ``ulps · eps(dtype) · (scale + |expected|)``, where ``scale`` is
the size of the terms the result was computed from: by default the largest magnitude on either side (a gradient
tensor's max-norm, a weight), and the caller passes it where the result is smaller than its terms: for a "sums to
zero" check the sum of the terms' magnitudes, for a loss the mean magnitude of the terms it averages. A bare
``atol=1e-8`` on float32 asks near a cancellation for a fraction of an ulp of the terms, which one CPU's rounding
meets and another's does not. ``ulps`` is 64: the results compared here are chains of a few dozen float operations over
sums of up to a few hundred terms, and differed by at most 4 eps·scale across ATEN_CPU_CAPABILITY=avx512, avx2 and
default and OMP_NUM_THREADS=1 (a margin of 16), while a relative error of 1e-4 in a coefficient (840 float32 eps)
exceeds the allowance, at most 128 eps·scale, more than six-fold. Results equal by construction (the same
operations in the same order, exactly representable values) are compared exactly instead, and comparisons against
an independent approximation (a QP solver's answer) keep that approximation's tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_ULPS = 64

Value = torch.Tensor | float | Sequence[float]


def _as_tensor(value: Value) -> torch.Tensor:
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.float64)
    return tensor.cpu()


def _computation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The least precise floating dtype among the operands: the precision the comparison can be held to."""
    floating = [t.dtype for t in tensors if t.is_floating_point()]
    if not floating:
        return torch.float64
    return max(floating, key=lambda dtype: torch.finfo(dtype).eps)


def assert_close_to_rounding(
    actual: Value,
    expected: Value,
    *,
    scale: Value | None = None,
    ulps: float = DEFAULT_ULPS,
    dtype: torch.dtype | None = None,
    msg: str | None = None,
) -> None:
    """Assert |actual − expected| <= ulps·eps·(scale + |expected|) elementwise (the module's rule).

    ``dtype`` is the precision of the computation (default: the least precise floating dtype of the operands; pass
    it when a float32 result arrives as a Python float). ``scale`` (a number or a tensor broadcastable to
    ``actual``) defaults to the largest magnitude on either side. Non-finite values must match exactly.
    """
    a, e = _as_tensor(actual), _as_tensor(expected)
    dtype = dtype or _computation_dtype(a, e)
    note = f" ({msg})" if msg else ""
    if torch.broadcast_shapes(a.shape, e.shape) != a.shape:
        raise AssertionError(f"shapes differ: actual {tuple(a.shape)}, expected {tuple(e.shape)}{note}")
    a, e = a.double(), e.double().expand_as(a)
    finite = torch.isfinite(a) & torch.isfinite(e)
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    if not same[~finite].all():
        raise AssertionError(f"non-finite values differ: actual {a[~finite].tolist()}, "
                             f"expected {e[~finite].tolist()}{note}")
    if scale is None:
        s = torch.cat([a[finite].abs(), e[finite].abs(), torch.zeros(1, dtype=torch.float64)]).max().expand_as(a)
    else:
        s = _as_tensor(scale).double().expand_as(a)
    eps = torch.finfo(dtype).eps
    allowed = ulps * eps * (s + e.abs())
    diff = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    bad = diff > allowed
    if bad.any():
        i = int(torch.argmax(torch.where(bad, diff / allowed.clamp(min=1e-300), torch.zeros_like(diff))))
        where = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), a.shape))
        a_i, e_i, d_i, s_i = (float(t.flatten()[i]) for t in (a, e, diff, s))
        raise AssertionError(
            f"{int(bad.sum())} of {a.numel()} elements differ by more than {ulps} ulps of their scale ({dtype}); "
            f"worst at {where}: actual {a_i!r}, expected {e_i!r}, difference {d_i:.3g} = "
            f"{d_i / (eps * s_i) if s_i > 0 else float('inf'):.3g} eps·scale (scale {s_i:.3g}, allowed "
            f"{float(allowed.flatten()[i]):.3g}){note}"
        )
