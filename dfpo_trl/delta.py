"""DelTA token weights: discriminative token coefficients for RLVR (docs/delta.md).

A sequence-level RLVR update moves token probabilities like a linear discriminator between the positive-
and negative-advantage centroids of token-gradient vectors (the DelTA paper's centroid decomposition and
local discriminator score; docs/delta.md). DelTA scores each rollout token by how characteristic its proxy gradient
vector is of its own side versus the opposite side (eq. DelTA-alpha), refines the centroids with those
scores, maps the scores into bounded coefficients λ ∈ [λ_min, λ_max] and uses them, self-normalised,
as stop-gradient per-token multipliers on the policy loss (eq. DelTA-weighted-objective).

Everything here is a pure, ``no_grad`` function of detached tensors.

Conventions (the user documentation must state them):

* Support. Only *scored* tokens (``mask != 0``) of completions with ``Â ≠ 0`` are weighted. Tokens of
  zero-advantage completions get exactly ``λ = 1``; padding positions (``mask == 0``) also get exactly
  ``λ = 1``. Values of ``vectors`` / ``hidden`` / ``token_probs`` at padding positions are never read
  into any computation, so even NaN or Inf there cannot influence a weight.
* Empty side. If, over the whole (all-reduced) rollout batch, one side has no token (no ``Â > 0`` or no
  ``Â < 0`` token), there is no between-side contrast (the update is a single-side mean), so *every*
  token gets ``λ = 1``, whatever the ablation options (``random_weights`` included, so that the random
  control keeps the exact support of the default). With group-centred advantages this only happens
  when every group in the batch has zero advantages.
* Adaptive γ. ``γ_side`` is the unweighted mean of ``|margin|`` over that side's tokens, recomputed at
  every refinement step (γ^{(k)} in the DelTA paper). Because margins and γ both scale with ``‖v‖²``, the
  weights are invariant to a common positive rescaling of ``v`` (a fixed ``gamma`` breaks this). If all
  margins of a side are 0, γ is set to 1 (the score is then σ(0) = 1/2 for every token of that side).
* Refinement. Both centroids are updated simultaneously from the previous scores:
  ``μ_side ← Σ α|Â| v / Σ α|Â|`` over the side's tokens. If that weight sum is 0 (possible with hard
  assignment, or sigmoid underflow) the side keeps its previous centroid.
* ``contrast="within"`` (the paper's "within-side only" ablation): the score ignores the opposite side,
  ``margin = D̄_own − ‖v − μ_own‖²`` with ``D̄_own`` the unweighted mean of ``‖v − μ_own‖²`` over the
  side's tokens, so a token scores above 1/2 when it is closer to its own centroid than the side's
  average token. γ (adaptive) is then the mean absolute deviation of that distance.
* ``assignment="hard"``: ``α = 1[margin > 0]`` (no γ; the "w/o h(α)" ablation).
* ``random_weights=True``: ``λ ~ U[λ_min, λ_max]`` i.i.d. per (row, position) from ``generator``, drawn
  over the full ``(B, T)`` grid and then restricted to the support above (so a token's draw does not
  depend on the other tokens' masks).
* Precision. Everything is computed in float32 (float64 if the inputs are float64), also for bf16/fp16
  inputs; the returned weights are float32 (float64).
* Distributed. Centroid sums, side weights and the γ statistics go through ``all_reduce`` (a callable
  that returns the element-wise sum over processes of the tensor it is given, e.g.
  ``lambda t: (torch.distributed.all_reduce(t), t)[1]``). The number and shapes of reductions depend
  only on the options, never on the local data, so a process with no scored token cannot deadlock the
  others; the result equals the single-process computation on the concatenated batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .precision import compute_dtype as _compute_dtype

__all__ = ["self_normalise", "token_weights", "token_weights_from_hidden"]

Reducer = Callable[[Tensor], Tensor]

_ASSIGNMENTS = ("soft", "hard")
_CONTRASTS = ("opposite", "within")
_DEFAULT_CHUNK = 16384


def _reduce(x: Tensor, all_reduce: Reducer | None) -> Tensor:
    return x if all_reduce is None else all_reduce(x)




def _rows(h_flat: Tensor, idx: Tensor, start: int, stop: int, dtype: torch.dtype) -> Tensor:
    """Float copy of the active rows ``idx[start:stop]`` of ``h_flat``: the only (tokens × d) temporary."""
    return h_flat.index_select(0, idx[start:stop]).to(dtype)


def _dots(h_flat: Tensor, idx: Tensor, m: Tensor, chunk: int) -> Tensor:
    """``h[idx] @ m.T`` for ``m`` of shape (k, d), chunked over tokens; returns (n, k)."""
    n = idx.numel()
    out = m.new_zeros(n, m.shape[0])
    for s in range(0, n, chunk):
        out[s : s + chunk] = _rows(h_flat, idx, s, s + chunk, m.dtype) @ m.T
    return out


def _sq_norms(h_flat: Tensor, idx: Tensor, dtype: torch.dtype, chunk: int) -> Tensor:
    """``‖h‖²`` of the active rows, chunked; returns (n,)."""
    n = idx.numel()
    out = torch.zeros(n, dtype=dtype, device=h_flat.device)
    for s in range(0, n, chunk):
        r = _rows(h_flat, idx, s, s + chunk, dtype)
        out[s : s + chunk] = (r * r).sum(-1)
    return out


def _side_sums(
    h_flat: Tensor,
    idx: Tensor,
    coef: Tensor,
    weight: Tensor,
    side: Tensor,
    all_reduce: Reducer | None,
    chunk: int,
) -> tuple[Tensor, Tensor]:
    """Per-side weighted sums of ``v = coef · h`` over the active tokens (all-reduced).

    Returns ``sum_vec`` (2, d) with ``sum_vec[k] = Σ_{side=k} weight · coef · h`` and ``sum_weight`` (2,)
    with ``sum_weight[k] = Σ_{side=k} weight``; side 0 is Â > 0, side 1 is Â < 0. The centroid of side k
    (the centroid decomposition, μ = weighted mean of v) is ``sum_vec[k] / sum_weight[k]``. Both are
    packed in one (2, d + 1) tensor so a distributed run pays a single collective.
    """
    n, d, dtype = idx.numel(), h_flat.shape[-1], weight.dtype
    onehot = torch.zeros(n, 2, dtype=dtype, device=weight.device)
    onehot[torch.arange(n, device=weight.device), side] = 1.0
    per_token = onehot * (weight * coef)[:, None]
    packed = torch.zeros(2, d + 1, dtype=dtype, device=weight.device)
    for s in range(0, n, chunk):
        packed[:, :d] += per_token[s : s + chunk].T @ _rows(h_flat, idx, s, s + chunk, dtype)
    packed[:, d] = onehot.T @ weight
    packed = _reduce(packed, all_reduce)
    return packed[:, :d], packed[:, d]


def _side_means(values: Tensor, side: Tensor, all_reduce: Reducer | None) -> Tensor:
    """Unweighted per-side mean of ``values`` over the (global) active tokens; 0 for an empty side."""
    stats = torch.zeros(2, 2, dtype=values.dtype, device=values.device)
    stats[0].index_add_(0, side, values)
    stats[1].index_add_(0, side, torch.ones_like(values))
    stats = _reduce(stats, all_reduce)
    return stats[0] / stats[1].clamp_min(1.0)


def _margins(
    h_flat: Tensor,
    idx: Tensor,
    coef: Tensor,
    side: Tensor,
    mu: Tensor,
    contrast: str,
    sq_norms: Tensor | None,
    all_reduce: Reducer | None,
    chunk: int,
) -> Tensor:
    """Score margins of the active tokens (numerators of DelTA's α, docs/delta.md step 4).

    ``opposite``: ``‖v − μ_opp‖² − ‖v − μ_own‖²``. Expanding both squares, the ``‖v‖²`` terms cancel and
    the margin of a positive-side token is the linear discriminator ``2 δ·(v − (μ₊ + μ₋)/2)`` with
    ``δ = μ₊ − μ₋`` (the negative side's is its negation); with ``v = c h`` this is
    ``2 (c h·δ − δ·mid)``, so only one dot product per token is needed.
    ``within``: ``D̄_own − ‖v − μ_own‖²`` with ``‖v − μ‖² = c²‖h‖² − 2c h·μ + ‖μ‖²``.
    """
    if contrast == "opposite":
        delta = mu[0] - mu[1]
        mid = 0.5 * (mu[0] + mu[1])
        proj = coef * _dots(h_flat, idx, delta[None], chunk)[:, 0] - delta @ mid
        sign = 1.0 - 2.0 * side.to(proj.dtype)
        return 2.0 * sign * proj
    assert sq_norms is not None
    own_dot = _dots(h_flat, idx, mu, chunk).gather(1, side[:, None])[:, 0]
    mu_sq = (mu * mu).sum(-1)
    dist = coef * coef * sq_norms - 2.0 * coef * own_dot + mu_sq[side]
    return _side_means(dist, side, all_reduce)[side] - dist


def _scores(
    margin: Tensor, side: Tensor, assignment: str, gamma: float | None, all_reduce: Reducer | None
) -> Tensor:
    """α from margins: σ(margin / γ_side) (DelTA's α, docs/delta.md step 4) or the hard 1[margin > 0]."""
    if assignment == "hard":
        return (margin > 0).to(margin.dtype)
    if gamma is None:
        g = _side_means(margin.abs(), side, all_reduce)
        g = torch.where(g > 0, g, torch.ones_like(g))
    else:
        g = torch.full((2,), float(gamma), dtype=margin.dtype, device=margin.device)
    return torch.sigmoid(margin / g[side])


def _check_options(
    lambda_min: float,
    lambda_max: float,
    refine_steps: int,
    gamma: float | None,
    assignment: str,
    contrast: str,
    chunk_tokens: int,
) -> None:
    if not lambda_min <= lambda_max:
        raise ValueError(f"lambda_min ({lambda_min}) must be <= lambda_max ({lambda_max})")
    if refine_steps < 0:
        raise ValueError(f"refine_steps must be >= 0, got {refine_steps}")
    if gamma is not None and not gamma > 0:
        raise ValueError(f"gamma must be > 0 (or None for the adaptive γ), got {gamma}")
    if assignment not in _ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {_ASSIGNMENTS}, got {assignment!r}")
    if contrast not in _CONTRASTS:
        raise ValueError(f"contrast must be one of {_CONTRASTS}, got {contrast!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


@torch.no_grad()
def _weights_core(
    h: Tensor,
    coef_bt: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    lambda_min: float,
    lambda_max: float,
    refine_steps: int,
    gamma: float | None,
    assignment: str,
    contrast: str,
    generator: torch.Generator | None,
    random_weights: bool,
    all_reduce: Reducer | None,
    chunk_tokens: int,
) -> Tensor:
    """Shared implementation: proxy vectors are ``v = coef · h`` (coef = 1 for the vector path)."""
    _check_options(lambda_min, lambda_max, refine_steps, gamma, assignment, contrast, chunk_tokens)
    if h.dim() != 3:
        raise ValueError(f"expected (B, T, d) vectors/hidden states, got shape {tuple(h.shape)}")
    b, t, d = h.shape
    if mask.shape != (b, t):
        raise ValueError(f"mask must have shape {(b, t)}, got {tuple(mask.shape)}")
    if advantages.shape != (b,):
        raise ValueError(f"advantages must have shape {(b,)}, got {tuple(advantages.shape)}")
    if coef_bt is not None and coef_bt.shape != (b, t):
        raise ValueError(f"token_probs must have shape {(b, t)}, got {tuple(coef_bt.shape)}")

    dtype, device = _compute_dtype(h), h.device
    adv = advantages.detach().to(device=device, dtype=dtype)
    adv_bt = adv[:, None].expand(b, t)
    active = (mask.detach().to(device) != 0) & (adv_bt != 0)
    idx = active.reshape(-1).nonzero().squeeze(1)
    a_tok = adv_bt.reshape(-1)[idx]
    weight = a_tok.abs()
    side = (a_tok < 0).long()
    if coef_bt is None:
        coef = torch.ones_like(weight)
    else:
        coef = coef_bt.detach().to(device=device, dtype=dtype).reshape(-1)[idx]
    h_flat = h.detach().reshape(b * t, d)

    out = torch.ones(b * t, dtype=dtype, device=device)
    sum_vec, sum_w = _side_sums(h_flat, idx, coef, weight, side, all_reduce, chunk_tokens)
    if not bool((sum_w > 0).all()):  # empty side (global): no contrast, λ = 1 everywhere
        return out.reshape(b, t)

    if random_weights:
        gen_device = generator.device if generator is not None else device
        u = torch.rand((b, t), generator=generator, device=gen_device, dtype=dtype).to(device)
        alpha = u.reshape(-1)[idx]
    else:
        mu = sum_vec / sum_w[:, None]
        sq_norms = _sq_norms(h_flat, idx, dtype, chunk_tokens) if contrast == "within" else None
        for step in range(refine_steps + 1):
            margin = _margins(h_flat, idx, coef, side, mu, contrast, sq_norms, all_reduce, chunk_tokens)
            alpha = _scores(margin, side, assignment, gamma, all_reduce)
            if step == refine_steps:
                break
            new_vec, new_w = _side_sums(h_flat, idx, coef, weight * alpha, side, all_reduce, chunk_tokens)
            keep = new_w > 0
            mu = torch.where(keep[:, None], new_vec / torch.where(keep, new_w, 1.0)[:, None], mu)

    out[idx] = lambda_min + (lambda_max - lambda_min) * alpha
    return out.reshape(b, t)


def token_weights(
    vectors: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lambda_min: float = 0.8,
    lambda_max: float = 1.2,
    refine_steps: int = 1,
    *,
    gamma: float | None = None,
    assignment: str = "soft",
    contrast: str = "opposite",
    generator: torch.Generator | None = None,
    random_weights: bool = False,
    all_reduce: Reducer | None = None,
    chunk_tokens: int = _DEFAULT_CHUNK,
) -> Tensor:
    """DelTA coefficients λ (B, T) from proxy token-gradient vectors, before self-normalisation.

    DelTA's method (docs/delta.md): centroids μ_± are the |Â|-weighted means of ``vectors`` (B, T, d) over each
    side's scored tokens (eq. centroid-decomposition); α = σ((‖v − μ_opp‖² − ‖v − μ_own‖²)/γ_side)
    (eq. DelTA-alpha, adaptive γ_side = mean |margin| of the side unless ``gamma`` is given);
    ``refine_steps`` times μ_own ← α|Â|-weighted mean and α recomputed; λ = λ_min + (λ_max − λ_min)α.
    ``advantages`` (B,) are the completions' Â, ``mask`` (B, T) is nonzero on scored tokens.
    See the module docstring for zero-advantage rows, padding, empty sides, the ablations
    (``assignment="hard"``, ``contrast="within"``, ``random_weights``) and ``all_reduce``.
    ``chunk_tokens`` bounds the float32 temporaries to ``chunk_tokens × d``.
    """
    return _weights_core(
        vectors,
        None,
        advantages,
        mask,
        lambda_min,
        lambda_max,
        refine_steps,
        gamma,
        assignment,
        contrast,
        generator,
        random_weights,
        all_reduce,
        chunk_tokens,
    )


def token_weights_from_hidden(
    hidden: Tensor,
    token_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lambda_min: float = 0.8,
    lambda_max: float = 1.2,
    refine_steps: int = 1,
    *,
    gamma: float | None = None,
    assignment: str = "soft",
    contrast: str = "opposite",
    generator: torch.Generator | None = None,
    random_weights: bool = False,
    all_reduce: Reducer | None = None,
    chunk_tokens: int = _DEFAULT_CHUNK,
) -> Tensor:
    """:func:`token_weights` for the LM-head-row proxy v = (1 − p) h without materialising v.

    DelTA's proxy (docs/delta.md step 1): ∇_{W_y} log p(y) = (1 − p(y)) h. ``hidden`` (B, T, d) are the final
    hidden states feeding the LM head, ``token_probs`` (B, T) the sampled tokens' probabilities p. Sums are
    Σ w (1 − p) h (matmuls over h), distances use ‖v − μ‖² = (1−p)²‖h‖² − 2(1−p) h·μ + ‖μ‖² (docs/delta.md);
    the only (tokens × d) temporaries are float32 copies of at most ``chunk_tokens`` rows of h.
    Equal to ``token_weights((1 - token_probs)[..., None] * hidden, ...)`` up to float rounding.
    """
    coef = 1.0 - token_probs.detach().to(_compute_dtype(hidden))
    return _weights_core(
        hidden,
        coef,
        advantages,
        mask,
        lambda_min,
        lambda_max,
        refine_steps,
        gamma,
        assignment,
        contrast,
        generator,
        random_weights,
        all_reduce,
        chunk_tokens,
    )


@torch.no_grad()
def self_normalise(
    weights: Tensor,
    mask: Tensor,
    *,
    dim: int | None = None,
    all_reduce: Reducer | None = None,
) -> Tensor:
    """λ̄ = λ · N / Z with N = Σ mask and Z = Σ λ · mask (DelTA's self-normalised objective, docs/delta.md step 6).

    Afterwards the weights average exactly 1 over the masked tokens of the normalisation domain, so the
    loss's usual token-count normaliser N can be kept. The domain is the whole tensor (``dim=None``,
    optionally over all processes through ``all_reduce`` applied to the packed (Z, N)) or each slice
    along ``dim`` (e.g. ``dim=-1`` for per-sequence normalisation). Where Z ≤ 0 (no masked token)
    the weights are returned unchanged. Padding positions are scaled like the rest (they carry mask 0).
    Returns float32 (float64 for float64 input).
    """
    w = weights.detach().to(_compute_dtype(weights))
    m = mask.detach().to(device=w.device, dtype=w.dtype)
    if dim is None:
        stats = torch.stack([(w * m).sum(), m.sum()])
        stats = _reduce(stats, all_reduce)
        z, n = stats[0], stats[1]
    else:
        if all_reduce is not None:
            raise ValueError("all_reduce is only supported with dim=None (a global normalisation domain)")
        z, n = (w * m).sum(dim, keepdim=True), m.sum(dim, keepdim=True)
    scale = torch.where(z > 0, n / torch.where(z > 0, z, torch.ones_like(z)), torch.ones_like(z))
    return w * scale
