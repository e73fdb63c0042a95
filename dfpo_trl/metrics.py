"""Mechanism metrics of DFPO (docs/metrics.md; arXiv 2604.13088 eq. 19, 20, 23/94, 24).

Tensor metrics take ``(num_groups, G)`` (or ``(num_groups, G, T)``) tensors, compute in float32 (float64
when an input is float64) and return 0-dim tensors, so the trainer decides when to synchronise with the
device. Curve metrics (Jitter₂, EMA, steps-to-threshold) take a Python sequence or a 1-D tensor and
return Python numbers. None of them returns NaN for valid input: empty batches give 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .precision import compute_dtype as _compute_dtype

__all__ = [
    "asym",
    "ema",
    "energy_by_bucket",
    "frequency_buckets",
    "jitter2",
    "lm_head_grad_scale",
    "orth_residual",
    "phi_stats",
    "shared_prefix_mask",
    "shared_prefix_residual",
    "steps_to_threshold",
]

# Denominator guard for φ = w̃ / w̄. w̄ = exp(·) clipped is > 0 by construction; the guard only keeps a
# corrupted w̄ <= 0 from producing Inf/NaN.
_PHI_DENOM_MIN = 1e-12




def _check_groups(name: str, x: torch.Tensor, advantages: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape != advantages.shape:
        raise ValueError(
            f"{name} expects two tensors shaped (num_groups, G) and equal; got {tuple(x.shape)} and "
            f"{tuple(advantages.shape)}"
        )


def asym(coefficients: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Asym (eq. 23/94): mean over groups of Var_i(coefficient_i · Â_i), population variance.

    It measures how unevenly the weights modulate the group's advantages; with a transform that makes
    the coefficients equal it reduces to the variance of Â itself.
    """
    _check_groups("asym", coefficients, advantages)
    dtype = _compute_dtype(coefficients, advantages)
    if coefficients.numel() == 0:
        return torch.zeros((), dtype=dtype, device=coefficients.device)
    prod = coefficients.to(dtype) * advantages.to(dtype)
    return prod.var(dim=-1, correction=0).mean()


def orth_residual(w_tilde: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Mean over groups of |Σ_i w̃_i Â_i|: how far the transformed weights are from the orthogonality
    condition Σ_i s̃_i Â_i = 0 that restores shared-token cancellation (Appendix B, eq. 49–51)."""
    _check_groups("orth_residual", w_tilde, advantages)
    dtype = _compute_dtype(w_tilde, advantages)
    if w_tilde.shape[0] == 0:
        return torch.zeros((), dtype=dtype, device=w_tilde.device)
    return (w_tilde.to(dtype) * advantages.to(dtype)).sum(dim=-1).abs().mean()


def phi_stats(w_tilde: torch.Tensor, w_bar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, mean) of φ = w̃ / w̄, the stop-gradient factor of the ratio-form surrogate (docs/design.md).

    φ < 1 means the transform shrank a sequence's weight. w̄ is clamped below at 1e-12 before dividing.
    Any shape; empty input gives (0, 0).
    """
    if w_tilde.shape != w_bar.shape:
        raise ValueError(
            f"phi_stats expects equal shapes; got {tuple(w_tilde.shape)} and {tuple(w_bar.shape)}"
        )
    dtype = _compute_dtype(w_tilde, w_bar)
    if w_tilde.numel() == 0:
        zero = torch.zeros((), dtype=dtype, device=w_tilde.device)
        return zero, zero.clone()
    phi = w_tilde.to(dtype) / w_bar.to(dtype).clamp(min=_PHI_DENOM_MIN)
    return phi.min(), phi.mean()


def shared_prefix_mask(completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Positions whose (prefix, token) every member of the group shares, shaped (num_groups, T).

    True at t iff for all members i: mask[i, t'] = 1 and ids[i, t'] = ids[0, t'] for every t' ≤ t. These
    are the positions where the gradients ∇ℓ_{i,t} coincide, so only the coefficient sum matters
    (eq. 38, Corollary 3.3). Groups of G = 1 are all False: with one member there is nothing to cancel.
    Inputs are (num_groups, G, T).
    """
    if completion_ids.dim() != 3 or completion_ids.shape != completion_mask.shape:
        raise ValueError(
            "shared_prefix_mask expects completion_ids and completion_mask shaped (num_groups, G, T) and "
            f"equal; got {tuple(completion_ids.shape)} and {tuple(completion_mask.shape)}"
        )
    num_groups, group_size, length = completion_ids.shape
    if group_size < 2 or length == 0:
        return torch.zeros((num_groups, length), dtype=torch.bool, device=completion_ids.device)
    same = (completion_ids == completion_ids[:, :1, :]).all(dim=1) & (completion_mask != 0).all(dim=1)
    # Cumulative AND along t: a position is shared only if every earlier one is.
    return same.to(torch.int8).cummin(dim=-1).values.bool()


def shared_prefix_residual(
    token_coefficients: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-token cancellation residual (docs/metrics.md): returns (value, count).

    Over shared positions (see :func:`shared_prefix_mask`) with Σ_i |c_{i,t}| > 0, the mean of
    |Σ_i c_{i,t}| / Σ_i |c_{i,t}|, where c_{i,t} is the effective scalar multiplying ∇ℓ_{i,t}. 0 means
    the shared tokens' gradients cancel exactly, 1 that they all push the same way (the "learning tax").
    ``count`` (int64 0-dim tensor) is the number of positions used; ``value`` is 0 when it is 0, so the
    caller should check ``count`` before logging. Inputs are (num_groups, G, T).
    """
    if token_coefficients.shape != completion_ids.shape:
        raise ValueError(
            "shared_prefix_residual expects token_coefficients shaped like completion_ids; got "
            f"{tuple(token_coefficients.shape)} and {tuple(completion_ids.shape)}"
        )
    (total, count), = shared_prefix_residual_sums(
        token_coefficients, shared_prefix_mask(completion_ids, completion_mask)
    )
    return total / count.clamp(min=1).to(total.dtype), count


def shared_prefix_residual_sums(
    token_coefficients: torch.Tensor, shared: torch.Tensor, *group_subsets: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(Σ ratio, count) of :func:`shared_prefix_residual` over all groups, then over each subset of groups.

    ``token_coefficients`` (num_groups, G, T); ``shared`` the (num_groups, T) mask of
    :func:`shared_prefix_mask`; each of ``group_subsets`` a (num_groups,) bool selecting groups (e.g. the two-sided
    ones, eq. C8). One pass over the coefficients serves every subset: the metric runs in a backward hook on
    every micro-step, where each extra kernel shows in step time."""
    dtype = _compute_dtype(token_coefficients)
    c = token_coefficients.to(dtype)
    total_abs = c.abs().sum(dim=1)
    used = shared & (total_abs > 0)
    ratio = torch.where(used, c.sum(dim=1).abs() / torch.where(used, total_abs, 1.0), 0.0)
    sums = [(ratio.sum(), used.sum())]
    for subset in group_subsets:
        keep = subset.unsqueeze(-1)
        sums.append(((ratio * keep).sum(), (used & keep).sum()))
    return sums


# ------------------------------------------------------------------------------------------ eq. 24 energy
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
    """‖∂ log p(y_t) / ∂W‖_F per token, W the LM-head weight (eq. 24, docs/metrics.md): the per-token LM-head
    gradient norm ‖∇_W ℓ_t‖ is |c_t| times this, c_t = ∂loss/∂ log p(y_t).

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
    """Frequency bucket of every token of a batch (the token sets B of eq. 24, docs/metrics.md); −1 where
    ``mask`` is 0.

    The distinct ids of the unmasked tokens are ranked by their count in this batch (most frequent first, ties
    by smaller id); their occurrences, in that order, are cut into ``num_buckets`` consecutive slices of equal
    mass N/k, and an id belongs to the bucket of its first occurrence: bucket = ⌊(occurrences of more frequent
    ids) · k / N⌋. An id never straddles two buckets, so the buckets hold about (not exactly) N/k tokens each,
    and some may be empty; bucket 0 holds the most frequent ids. Returns int64, shaped like ``token_ids``.
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
    """Σ_{t∈B_b} ‖∇ℓ_t‖ for b = 0..num_buckets−1, the numerators of eq. 24 (:func:`energy_by_bucket`).

    Tokens with bucket −1 count nowhere. No input checks and no host sync (bucket indices from
    :func:`frequency_buckets` are in range by construction), so it can run inside a backward hook; the trainer
    pools these sums over micro-steps and processes before dividing.
    """
    dtype = _compute_dtype(token_energy)
    used = bucket >= 0
    index = torch.where(used, bucket, torch.zeros_like(bucket)).to(torch.int64).reshape(-1)
    energy = torch.where(used, token_energy.detach().to(dtype), torch.zeros((), dtype=dtype, device=bucket.device))
    sums = torch.zeros(num_buckets, dtype=dtype, device=token_energy.device)
    return sums.index_add_(0, index.to(token_energy.device), energy.reshape(-1).to(token_energy.device))


def energy_by_bucket(token_energy: torch.Tensor, bucket: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Energy(B_b) = Σ_{t∈B_b} ‖∇ℓ_t‖ / Σ_t ‖∇ℓ_t‖ for b = 0..num_buckets−1 (eq. 24, docs/metrics.md).

    ``token_energy`` holds non-negative per-token gradient norms, ``bucket`` the bucket of each token (−1 =
    not counted, see :func:`frequency_buckets`), same shape. Returns the (num_buckets,) shares, summing to 1,
    or zeros when the counted energy is 0 (float32, float64 for float64 input).
    """
    _check_bucket_inputs("energy_by_bucket", ("token_energy", token_energy), ("bucket", bucket), num_buckets)
    used = bucket >= 0
    if used.any() and int(bucket[used].max()) >= num_buckets:
        raise ValueError(f"bucket index {int(bucket[used].max())} is out of range for num_buckets={num_buckets}")
    sums = energy_sums_by_bucket(token_energy, bucket, num_buckets)
    total = sums.sum()
    positive = total > 0
    return torch.where(positive, sums / torch.where(positive, total, torch.ones_like(total)), torch.zeros_like(sums))


def _as_float_list(curve: Sequence[float] | torch.Tensor, name: str) -> list[float]:
    if isinstance(curve, torch.Tensor):
        if curve.dim() != 1:
            raise ValueError(f"{name} expects a 1-D curve, got a tensor of shape {tuple(curve.shape)}")
        return [float(v) for v in curve.detach().to("cpu", torch.float64).tolist()]
    return [float(v) for v in curve]


def jitter2(curve: Sequence[float] | torch.Tensor) -> float:
    """Jitter₂ (eq. 20): (1/(T−2)) Σ_{t=1}^{T−2} |m_{t+2} − 2m_{t+1} + m_t|, the mean absolute second
    difference of a training curve: 0 for a straight line, large for short-term oscillation.

    Raises ValueError for fewer than 3 points (the metric is undefined; we never log NaN).
    """
    m = _as_float_list(curve, "jitter2")
    if len(m) < 3:
        raise ValueError(f"jitter2 needs a curve of at least 3 points, got {len(m)}")
    return sum(abs(m[t + 2] - 2.0 * m[t + 1] + m[t]) for t in range(len(m) - 2)) / (len(m) - 2)


def ema(curve: Sequence[float] | torch.Tensor, alpha: float = 0.3) -> list[float]:
    """Exponential moving average e_0 = m_0, e_t = α m_t + (1 − α) e_{t−1}, used to smooth a reward
    curve before thresholding (eq. 19) so a single lucky step does not count as reaching the threshold."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    out: list[float] = []
    for value in _as_float_list(curve, "ema"):
        out.append(value if not out else alpha * value + (1.0 - alpha) * out[-1])
    return out


def steps_to_threshold(
    curve: Sequence[float] | torch.Tensor, threshold: float, alpha: float = 0.3
) -> int | None:
    """Steps(Score ≥ κ) (eq. 19): the first 0-based index where the EMA of ``curve`` is ≥ ``threshold``,
    or None if it never gets there."""
    for index, value in enumerate(ema(curve, alpha=alpha)):
        if value >= threshold:
            return index
    return None
