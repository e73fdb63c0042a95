"""Aggregate gradient energy per vocabulary entry (eq. 24 read as the paper's claim needs it,
docs/source/concepts/metrics.md).

The per-position form (:mod:`dfpo_trl.metrics.energy`) sums ‖c_t ∂ log p_t/∂W‖ over positions, so two members of a
group pushing one token type in opposite directions both count: cancellation is invisible by construction. The
aggregate form takes the norm after the sum, per vocabulary entry v: the LM-head gradient row

    G_v = ∂L/∂W_v = Σ_t c_t ∂ log p_t/∂W_v = Σ_t c_t (s/τ) d_{t,v} (δ_{v,y_t} − p_{t,v}) h_t,          (E1)

(W the LM-head weight, c_t = ∂L/∂ log p_t, d the softcapping derivative, 1 without it), and E_v = ‖G_v‖. Rows are
those of the token types the micro-batch's loss tokens hold; each row takes its type's frequency bucket, and a bucket's
energy is Σ_{v∈B} E_v (eq. 24's numerator with a token type, not a position, as the unit).

Computed in two parts so that nothing runs on the loss's graph: :func:`row_factors` (no grad, at the forward) gives
P_{t,v} = (s/τ) d_{t,v} (δ_{v,y_t} − p_{t,v}) for the present types, with log Z from one online pass over W;
:func:`row_norms` (in the backward hook, once c is known) forms G = (c ⊙ P)ᵀ H and its row norms. Float32 (float64
for float64 input).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["RowFactors", "row_factors", "row_norms", "type_buckets"]


class RowFactors(NamedTuple):
    """What the aggregate needs from a forward: the present token types, P (positions × types, eq. E1's factor of
    h_t), and the positions' h; ``positions`` indexes the flattened (B·T) loss tokens they are."""

    type_ids: Tensor  # (U,) the distinct token ids of the loss tokens, ascending
    factors: Tensor  # (N, U)
    hidden: Tensor  # (N, d)
    positions: Tensor  # (N,) flat indices of the loss tokens in (B, T)
    column: Tensor  # (N,) each position's type, as an index into type_ids


def _logits(h: Tensor, w: Tensor, b: Tensor | None, logit_scale: float, softcap: float | None,
            temperature: float) -> tuple[Tensor, Tensor | None]:
    """z = softcap · tanh(s (h Wᵀ + b) / softcap) / τ and d = 1 − tanh² (None without softcapping), as TRL's head."""
    z = h @ w.T
    if b is not None:
        z = z + b
    z = z * logit_scale
    d = None
    if softcap is not None:
        z = torch.tanh(z / softcap)
        d = 1.0 - z * z
        z = z * softcap
    return z / temperature, d


def row_factors(
    hidden: Tensor, weight: Tensor, token_ids: Tensor, mask: Tensor, temperature: float = 1.0, *,
    bias: Tensor | None = None, logit_scale: float = 1.0, final_logit_softcapping: float | None = None,
    chunk_size: int = 1024, vocab_chunk_size: int = 8192,
) -> RowFactors:
    """P_{t,v} of eq. E1 for the loss tokens (``mask`` ≠ 0) and their distinct types v, with h_t, under no grad.

    ``hidden`` (B, T, d) as TRL's fused head reads it, ``token_ids`` and ``mask`` (B, T). log Z_t comes from one pass
    over W in ``vocab_chunk_size`` rows, ``chunk_size`` positions at a time (an online log-sum-exp: no positions ×
    vocabulary tensor). P itself is (loss tokens × present types), kept until the backward.

    Args:
        hidden: (B, T, d) the LM head's inputs.
        weight: (V, d) the LM-head weight W.
        token_ids: (B, T) sampled ids y_t.
        mask: (B, T), nonzero on loss tokens.
        temperature, bias, logit_scale, final_logit_softcapping: the logits TRL's fused head computes.
        chunk_size, vocab_chunk_size: the positions and vocabulary rows per pass.

    Returns:
        :class:`RowFactors`: (U,) present types, (N, U) factors P, (N, d) h, (N,) positions, (N,) type column, for the
        N loss tokens.
    """
    if hidden.shape[:-1] != token_ids.shape or token_ids.shape != mask.shape:
        raise ValueError(f"row_factors expects hidden (B, T, d) and token_ids, mask (B, T); got "
                         f"{tuple(hidden.shape)}, {tuple(token_ids.shape)}, {tuple(mask.shape)}")
    if not temperature > 0 or chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(f"row_factors needs temperature > 0 and chunk sizes >= 1; got temperature={temperature}, "
                         f"chunk_size={chunk_size}, vocab_chunk_size={vocab_chunk_size}")
    device = weight.device
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        positions = (mask.reshape(-1) != 0).nonzero().squeeze(1).to(device)
        h = hidden.detach().reshape(-1, hidden.size(-1)).to(device)[positions].to(dtype)
        y = token_ids.reshape(-1).to(device)[positions].long()
        type_ids, column = torch.unique(y, return_inverse=True)
        b_all = None if bias is None else bias.detach().to(dtype)
        log_z = torch.full((h.size(0),), float("-inf"), dtype=dtype, device=device)
        for v0 in range(0, weight.size(0), vocab_chunk_size):
            w = weight.detach()[v0:v0 + vocab_chunk_size].to(dtype)
            b = None if b_all is None else b_all[v0:v0 + vocab_chunk_size]
            for r0 in range(0, h.size(0), chunk_size):
                z, _ = _logits(h[r0:r0 + chunk_size], w, b, logit_scale, final_logit_softcapping, temperature)
                log_z[r0:r0 + chunk_size] = torch.logaddexp(log_z[r0:r0 + chunk_size], torch.logsumexp(z, dim=1))
        z, d = _logits(h, weight.detach()[type_ids].to(dtype), None if b_all is None else b_all[type_ids],
                       logit_scale, final_logit_softcapping, temperature)
        factors = -torch.exp(z - log_z.unsqueeze(1))
        factors[torch.arange(h.size(0), device=device), column] += 1.0  # δ_{v,y_t} − p_{t,v}
        if d is not None:
            factors *= d
        factors *= logit_scale / temperature
    return RowFactors(type_ids, factors, h, positions, column)


def row_norms(coefficients: Tensor, factors: RowFactors) -> Tensor:
    """E_v = ‖Σ_t c_t P_{t,v} h_t‖ for each present type (eq. E1): ``coefficients`` are c (B, T), ∂L/∂ log p.

    Args:
        coefficients: (B, T) c = ∂L/∂ log p.
        factors: :func:`row_factors`' result for the same batch.

    Returns:
        (U,) E_v, one per present type.
    """
    c = coefficients.detach().reshape(-1).to(factors.factors.device)[factors.positions].to(factors.factors.dtype)
    gradient_rows = (factors.factors * c.unsqueeze(1)).T @ factors.hidden  # (U, d): G restricted to present types
    return gradient_rows.norm(dim=1)


def type_buckets(token_bucket: Tensor, factors: RowFactors) -> Tensor:
    """The frequency bucket of each present type (:func:`~dfpo_trl.metrics.energy.frequency_buckets` gives every
    occurrence of an id the same bucket), shaped (U,).

    Args:
        token_bucket: (B, T) :func:`~dfpo_trl.metrics.energy.frequency_buckets`' result.
        factors: :func:`row_factors`' result for the same batch.

    Returns:
        (U,) the bucket of each present type.
    """
    bucket = token_bucket.reshape(-1).to(factors.positions.device)[factors.positions]
    return torch.zeros_like(factors.type_ids).scatter(0, factors.column, bucket.to(factors.type_ids.dtype))
