"""DelTA's self-normalisation λ̄ = λ N / Z (docs/source/concepts/delta.md step 6), below both of its users: DelTA's
rollout weights (:mod:`dfpo_trl.delta.rollout`) and the objective's loss inputs (:mod:`dfpo_trl.objectives.rewrite`,
which normalises λ̄ again over each micro-batch for ``bnpo``), so the objective needs nothing of the DelTA package.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..precision import compute_dtype as _compute_dtype

__all__ = ["self_normalise"]


@torch.no_grad()
def self_normalise(
    weights: Tensor,
    mask: Tensor,
    *,
    dim: int | None = None,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """λ̄ = λ · N / Z with N = Σ mask and Z = Σ λ · mask (DelTA's self-normalised objective,
    docs/source/concepts/delta.md step 6).

    Afterwards the weights average exactly 1 over the masked tokens of the normalisation domain, so the
    loss's usual token-count normaliser N can be kept. The domain is the whole tensor (``dim=None``,
    optionally over all processes through ``all_reduce`` applied to the packed (Z, N)) or each slice
    along ``dim`` (e.g. ``dim=-1`` for per-sequence normalisation). Where Z ≤ 0 (no masked token)
    the weights are returned unchanged. Padding positions are scaled like the rest (they carry mask 0).
    Returns float32 (float64 for float64 input).

    Args:
        weights: λ, any shape.
        mask: same shape, nonzero on the tokens that count.
        dim: None for one domain over the whole tensor, else the dimension of each domain (e.g. -1: per sequence).
        all_reduce: sums the packed (Z, N) over processes (``dim=None`` only).

    Returns:
        λ̄, ``weights``' shape, float32 (float64 for float64 input).
    """
    w = weights.detach().to(_compute_dtype(weights))
    m = mask.detach().to(device=w.device, dtype=w.dtype)
    if dim is None:
        stats = torch.stack([(w * m).sum(), m.sum()])
        stats = stats if all_reduce is None else all_reduce(stats)
        z, n = stats[0], stats[1]
    else:
        if all_reduce is not None:
            raise ValueError("all_reduce is only supported with dim=None (a global normalisation domain)")
        z, n = (w * m).sum(dim, keepdim=True), m.sum(dim, keepdim=True)
    scale = torch.where(z > 0, n / torch.where(z > 0, z, torch.ones_like(z)), torch.ones_like(z))
    return w * scale
