"""DelTA's centroids and scores (docs/source/concepts/delta.md steps 2–5): side sums, centroids, margins, γ, α and
refinement.

Internal to :mod:`dfpo_trl.delta.weights`, which validates the options and calls :func:`side_sums` and
:func:`refined_scores`. Every function works on the *active* tokens (scored tokens of rows with Â ≠ 0), given as
indices ``idx`` into the flattened (B·T, d) hidden states, with v = coef · h; statistics go through ``all_reduce``
(see the conventions in :mod:`dfpo_trl.delta.weights`). Never reads a (tokens × d) tensor beyond chunks of h.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["RELEASED_FLOOR", "Gamma", "Reducer", "all_reduced", "refined_scores", "side_sums"]

Reducer = Callable[[Tensor], Tensor]
Gamma = float | str

RELEASED_FLOOR = 1e-8  # the released code's floor on γ² and on a centroid's weight sum


def all_reduced(x: Tensor, all_reduce: Reducer | None) -> Tensor:
    """``x`` summed over processes through ``all_reduce``, or ``x`` itself without one."""
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


def side_sums(
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
    with ``sum_weight[k] = Σ_{side=k} weight``; side 0 is Â > 0, side 1 is Â < 0. Both are packed in one
    (2, d + 1) tensor so a distributed run pays a single collective.
    """
    n, d, dtype = idx.numel(), h_flat.shape[-1], weight.dtype
    onehot = torch.zeros(n, 2, dtype=dtype, device=weight.device)
    onehot[torch.arange(n, device=weight.device), side] = 1.0
    per_token = onehot * (weight * coef)[:, None]
    packed = torch.zeros(2, d + 1, dtype=dtype, device=weight.device)
    for s in range(0, n, chunk):
        packed[:, :d] += per_token[s : s + chunk].T @ _rows(h_flat, idx, s, s + chunk, dtype)
    packed[:, d] = onehot.T @ weight
    packed = all_reduced(packed, all_reduce)
    return packed[:, :d], packed[:, d]


def _centroids(sum_vec: Tensor, sum_weight: Tensor, previous: Tensor | None, zero_advantage: str) -> Tensor:
    """μ_side = Σ w v / Σ w (the centroid decomposition) with a guard for a side without weight.

    ``"lambda_min"`` (the released code): the weight sum is floored at 1e-8, so a side with no token or no weight
    has the zero centroid. ``"one"`` (our earlier rule): exact division; a side whose refinement weights sum to 0
    keeps its ``previous`` centroid (an empty side never gets here: it gave λ = 1 everywhere).
    """
    if zero_advantage == "lambda_min":
        return sum_vec / sum_weight.clamp_min(RELEASED_FLOOR)[:, None]
    some = sum_weight > 0
    mean = sum_vec / torch.where(some, sum_weight, torch.ones_like(sum_weight))[:, None]
    return mean if previous is None else torch.where(some[:, None], mean, previous)


def _side_means(values: Tensor, side: Tensor, all_reduce: Reducer | None) -> Tensor:
    """Unweighted per-side mean of ``values`` over the (global) active tokens; 0 for an empty side."""
    stats = torch.zeros(2, 2, dtype=values.dtype, device=values.device)
    stats[0].index_add_(0, side, values)
    stats[1].index_add_(0, side, torch.ones_like(values))
    stats = all_reduced(stats, all_reduce)
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
    """Score margins of the active tokens (numerators of DelTA's α, docs/source/concepts/delta.md step 4).

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


def _gamma(margin: Tensor, side: Tensor, rule: Gamma, all_reduce: Reducer | None) -> Tensor:
    """γ_side (2,) of DelTA's α (docs/source/concepts/delta.md step 4) from the margins of the side's tokens.

    ``"std"``: population standard deviation, variance floored at 1e-8 (the released code). Computed in two
    passes (mean, then squared deviations) rather than as E[m²] − E[m]², which loses digits in float32 when
    the margins' mean is large against their spread. ``"mean_abs"``: mean |margin| (1 if 0). A number: fixed.
    """
    if not isinstance(rule, str):
        return torch.full((2,), float(rule), dtype=margin.dtype, device=margin.device)
    if rule == "mean_abs":
        g = _side_means(margin.abs(), side, all_reduce)
        return torch.where(g > 0, g, torch.ones_like(g))
    mean = _side_means(margin, side, all_reduce)
    var = _side_means((margin - mean[side]) ** 2, side, all_reduce)
    return var.clamp_min(RELEASED_FLOOR).sqrt()


def _scores(margin: Tensor, side: Tensor, assignment: str, gamma: Tensor | None) -> Tensor:
    """α from margins: σ(margin / γ_side) (DelTA's α, docs/source/concepts/delta.md step 4) or the hard 1[margin >
    0]."""
    if assignment == "hard":
        return (margin > 0).to(margin.dtype)
    assert gamma is not None
    return torch.sigmoid(margin / gamma[side])


def refined_scores(
    h_flat: Tensor,
    idx: Tensor,
    coef: Tensor,
    weight: Tensor,
    side: Tensor,
    sum_vec: Tensor,
    sum_w: Tensor,
    refine_steps: int,
    gamma: Gamma,
    gamma_update: str,
    zero_advantage: str,
    assignment: str,
    contrast: str,
    all_reduce: Reducer | None,
    chunk: int,
) -> Tensor:
    """α* after ``refine_steps`` centroid refinements (docs/source/concepts/delta.md steps 3–5), γ scheduled by
    ``gamma_update``.

    ``sum_vec``, ``sum_w`` are the |Â|-weighted side sums of the initial centroids.

    Step k: α^(k) = σ(m^(k) / γ^(k)) with m^(k) the margins at μ^(k); μ^(k+1) = α^(k)|Â|-weighted side means.
    γ^(0) comes from m^(0); then γ^(k+1) from m^(k) (``"lagged"``) or from m^(k+1) (``"current"``).
    """
    sq_norms = _sq_norms(h_flat, idx, weight.dtype, chunk) if contrast == "within" else None

    def margins_at(centroids: Tensor) -> Tensor:
        return _margins(h_flat, idx, coef, side, centroids, contrast, sq_norms, all_reduce, chunk)

    def gamma_of(margin: Tensor) -> Tensor | None:
        return None if assignment == "hard" else _gamma(margin, side, gamma, all_reduce)

    mu = _centroids(sum_vec, sum_w, None, zero_advantage)
    margin = margins_at(mu)
    g = gamma_of(margin)
    for step in range(refine_steps):
        alpha = _scores(margin, side, assignment, g)
        new_vec, new_w = side_sums(h_flat, idx, coef, weight * alpha, side, all_reduce, chunk)
        if gamma_update == "lagged" and step > 0:  # γ^(step+1) from the margins at μ^(step) (at step 0: γ^(0))
            g = gamma_of(margin)
        mu = _centroids(new_vec, new_w, mu, zero_advantage)
        margin = margins_at(mu)
        if gamma_update == "current":
            g = gamma_of(margin)
    return _scores(margin, side, assignment, g)
