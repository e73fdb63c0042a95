"""Gradient energy on frequent tokens (eq. 24, docs/source/concepts/metrics.md): the LM-head gradient scale and bucket
shares.

‖∇_W ℓ_t‖ = |c_t| · ‖∂ log p_t/∂W‖ per token, W the LM-head weight, c_t = ∂loss/∂log p_t: :func:`lm_head_grad_scale`
gives the second factor from h (no autograd graph), :func:`frequency_buckets` the token sets B_b, and
:func:`energy_sums_by_bucket` each bucket's sum (its share: divided by the total in the metric store). The backward hook
(:mod:`dfpo_trl.metrics.hooks`) multiplies by |c_t|. Float32 throughout (float64 for float64 input).
"""

from __future__ import annotations

import torch

from ..precision import compute_dtype as _compute_dtype

__all__ = ["energy_sums_by_bucket", "frequency_buckets", "lm_head_grad_scale"]


def lm_head_grad_scale(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    vocab_chunk_size: int = 8192,
) -> torch.Tensor:
    """‖∂ log p(y_t) / ∂W‖_F per token, W the LM-head weight (eq. 24, docs/source/concepts/metrics.md): the per-token
    LM-head gradient norm ‖∇_W ℓ_t‖ is |c_t| times this, c_t = ∂loss/∂ log p(y_t).

    For the logits TRL's fused head uses, z = softcap · tanh(s (h Wᵀ + b) / softcap) / τ (plain s (h Wᵀ + b) / τ
    without softcapping), row k of ∂ log p_y/∂W is (δ_ky − p_k) d_k (s/τ) h, d_k = 1 − tanh²(·)_k (1 without
    softcapping), so the norm is ‖h‖ · |s|/τ · (Σ_k (δ_ky − p_k)² d_k²)^½; without softcapping the sum is
    ‖e_y − p‖² = (1 − p_y)² + Σ_{k≠y} p_k² = 1 − 2 p_y + Σ_k p_k². ``bias`` enters the logits only: the norm is
    the weight's gradient. ``hidden`` is (..., d) and ``token_ids`` (...); returns float32 (...) on the weight's
    device. No autograd graph; float32 throughout; one pass over W in ``vocab_chunk_size`` rows, an online
    log-sum-exp over the vocabulary, so no tensor beyond (chunk_size × vocab_chunk_size) is formed.
    """
    if hidden.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"lm_head_grad_scale expects hidden shaped (..., d) and token_ids shaped (...); got "
            f"{tuple(hidden.shape)} and {tuple(token_ids.shape)}"
        )
    if hidden.size(-1) != lm_head_weight.size(-1):
        raise ValueError(
            f"hidden size {hidden.size(-1)} does not match the LM-head weight {tuple(lm_head_weight.shape)}"
        )
    if not temperature > 0 or chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(
            f"lm_head_grad_scale needs temperature > 0 and chunk sizes >= 1; got temperature={temperature}, "
            f"chunk_size={chunk_size}, vocab_chunk_size={vocab_chunk_size}"
        )
    device, vocab = lm_head_weight.device, lm_head_weight.size(0)
    with torch.no_grad():
        h = hidden.detach().reshape(-1, hidden.size(-1))
        y = token_ids.reshape(-1).to(device=device, dtype=torch.int64)
        n = y.numel()
        if n and (int(y.min()) < 0 or int(y.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}), the LM head's vocabulary")
        f32 = dict(dtype=torch.float32, device=device)
        running_max = torch.full((n,), float("-inf"), **f32)
        sum_exp = torch.zeros(n, **f32)  # Σ_k exp(z_k − m)
        sum_sq_other = torch.zeros(n, **f32)  # Σ_{k≠y} exp(2 (z_k − m)) d_k²
        target_logit = torch.zeros(n, **f32)
        target_d = torch.ones(n, **f32)
        h_norm = torch.zeros(n, **f32)
        for start in range(0, n, chunk_size):
            h_norm[start : start + chunk_size] = h[start : start + chunk_size].to(**f32).norm(dim=-1)
        for v0 in range(0, vocab, vocab_chunk_size):
            w = lm_head_weight.detach()[v0 : v0 + vocab_chunk_size].to(**f32)
            b = None if bias is None else bias.detach()[v0 : v0 + vocab_chunk_size].to(**f32)
            for start in range(0, n, chunk_size):
                rows = slice(start, min(start + chunk_size, n))
                z = h[rows].to(**f32) @ w.T
                if b is not None:
                    z += b
                z *= logit_scale
                d = None
                if final_logit_softcapping is not None:
                    z = torch.tanh(z / final_logit_softcapping)
                    d = 1.0 - z * z
                    z *= final_logit_softcapping
                z /= temperature
                local = y[rows] - v0
                here = (local >= 0) & (local < z.size(1))
                col = local.clamp(0, z.size(1) - 1).unsqueeze(1)
                target_logit[rows] = torch.where(here, z.gather(1, col).squeeze(1), target_logit[rows])
                if d is not None:
                    target_d[rows] = torch.where(here, d.gather(1, col).squeeze(1), target_d[rows])
                new_max = torch.maximum(running_max[rows], z.max(dim=1).values)
                decay = torch.exp(running_max[rows] - new_max)
                e = torch.exp(z - new_max.unsqueeze(1))
                sum_exp[rows] = sum_exp[rows] * decay + e.sum(dim=1)
                q = e if d is None else e * d
                q.scatter_(1, col, torch.where(here.unsqueeze(1), 0.0, q.gather(1, col)))
                sum_sq_other[rows] = sum_sq_other[rows] * decay * decay + (q * q).sum(dim=1)
                running_max[rows] = new_max
        log_z = running_max + torch.log(sum_exp)
        one_minus_p_y = -torch.expm1(target_logit - log_z)
        # Σ_{k≠y} p_k² d_k² = Σ_{k≠y} exp(2 (z_k − m)) d_k² / (Σ_k exp(z_k − m))²
        sq_norm = (one_minus_p_y * target_d) ** 2 + sum_sq_other / (sum_exp * sum_exp)
        scale = h_norm * sq_norm.sqrt() * (abs(logit_scale) / temperature)
    return scale.view(token_ids.shape)


def _check_bucket_inputs(
    function: str, first: tuple[str, torch.Tensor], second: tuple[str, torch.Tensor], num_buckets: int
) -> None:
    """The eq. 24 helpers' shared input check: two per-token tensors of equal shape and at least one bucket."""
    (first_name, first_tensor), (second_name, second_tensor) = first, second
    if first_tensor.shape != second_tensor.shape:
        raise ValueError(
            f"{function} expects {first_name} and {second_name} of equal shape; got {tuple(first_tensor.shape)} "
            f"and {tuple(second_tensor.shape)}"
        )
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")


def frequency_buckets(token_ids: torch.Tensor, mask: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Frequency bucket of every token of a batch (the token sets B of eq. 24, docs/source/concepts/metrics.md); −1
    where ``mask`` is 0.

    The distinct ids of the unmasked tokens are ranked by their count in this batch (most frequent first, ties
    by smaller id); their occurrences, in that order, are cut into ``num_buckets`` consecutive slices of equal
    mass N/k, and an id belongs to the bucket of its first occurrence: bucket = ⌊(occurrences of more frequent
    ids) · k / N⌋. An id never straddles two buckets, so the buckets hold about (not exactly) N/k tokens each,
    and some may be empty; bucket 0 holds the most frequent ids. Returns int64, shaped like ``token_ids``.

    Args:
        token_ids: (B, T) token ids.
        mask: (B, T), nonzero on the tokens that count.
        num_buckets: k ≥ 1.

    Returns:
        (B, T) int64 bucket of each token, −1 outside ``mask``.
    """
    _check_bucket_inputs("frequency_buckets", ("token_ids", token_ids), ("mask", mask), num_buckets)
    valid = mask != 0
    bucket = torch.full(token_ids.shape, -1, dtype=torch.int64, device=token_ids.device)
    ids = token_ids[valid]
    if ids.numel() == 0:
        return bucket
    unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)  # ascending ids
    order = torch.argsort(counts, descending=True, stable=True)  # stable: equal counts keep ascending ids
    ranked = counts[order]
    before = torch.cumsum(ranked, 0) - ranked
    of_unique = torch.empty_like(order)
    of_unique[order] = before * num_buckets // ids.numel()
    bucket[valid] = of_unique[inverse]
    return bucket


def energy_sums_by_bucket(token_energy: torch.Tensor, bucket: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Σ_{t∈B_b} ‖∇ℓ_t‖ for b = 0..num_buckets−1, the numerators of eq. 24;
    each bucket's share is its sum over the counted total, divided when the metric store flushes.

    Tokens with bucket −1 count nowhere. No input checks and no host sync (bucket indices from
    :func:`frequency_buckets` are in range by construction), so it can run inside a backward hook; the trainer
    pools these sums over micro-steps and processes before dividing.

    Args:
        token_energy: per-token gradient norms ‖∇ℓ_t‖ ≥ 0, any shape.
        bucket: the same shape, each token's bucket (−1: not counted).
        num_buckets: k.

    Returns:
        (k,) sums, float32 (float64 for float64 input).
    """
    dtype = _compute_dtype(token_energy)
    used = bucket >= 0
    index = torch.where(used, bucket, torch.zeros_like(bucket)).to(torch.int64).reshape(-1)
    energy = torch.where(used, token_energy.detach().to(dtype), torch.zeros((), dtype=dtype, device=bucket.device))
    sums = torch.zeros(num_buckets, dtype=dtype, device=token_energy.device)
    return sums.index_add_(0, index.to(token_energy.device), energy.reshape(-1).to(token_energy.device))
