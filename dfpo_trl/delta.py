"""DelTA token weights: discriminative token coefficients for RLVR (docs/delta.md).

A sequence-level RLVR update moves token probabilities like a linear discriminator between the positive-
and negative-advantage centroids of token-gradient vectors (the DelTA paper's centroid decomposition and
local discriminator score; docs/delta.md). DelTA scores each rollout token by how characteristic its proxy gradient
vector is of its own side versus the opposite side (eq. DelTA-alpha), refines the centroids with those
scores, maps the scores into bounded coefficients λ ∈ [λ_min, λ_max] and uses them, self-normalised,
as stop-gradient per-token multipliers on the policy loss (eq. DelTA-weighted-objective).

The paper leaves γ and the degenerate cases open; by default every rule below is the one of the authors'
released code (docs/delta.md, "What the paper states, and what the released code does"), and our earlier
rules are options. Everything here is a pure, ``no_grad`` function of detached tensors.

Conventions (the user documentation must state them):

* Support. Only *scored* tokens (``mask != 0``) of completions with ``Â ≠ 0`` enter the centroids and the γ
  statistics. Tokens of zero-advantage completions get ``λ = λ_min`` (``zero_advantage="lambda_min"``, the
  released code) or exactly ``λ = 1`` (``"one"``, our earlier rule); padding positions (``mask == 0``) get
  ``λ = 1`` here and 0 in :func:`delta_token_weights`. Values of ``vectors`` / ``hidden`` / ``token_probs`` at
  padding positions and in zero-advantage rows are never read, so even NaN or Inf there cannot influence a weight.
* Centroids. ``μ_side = Σ w v / max(Σ w, 1e-8)`` over the side's tokens (w = |Â|, or α|Â| when refining), the
  released code's guard: a side without tokens (one side empty over the batch) or without weight has the
  zero centroid and the computation goes on. ``zero_advantage="one"`` restores our earlier rules for sides
  without weight too: an empty side gives ``λ = 1`` to *every* token (no between-side contrast, also under
  ``random_weights``), and a side whose refinement weights sum to 0 (hard assignment, sigmoid underflow) keeps
  its previous centroid.
* γ. ``gamma="std"`` (released code): the population standard deviation of the side's margins over its tokens,
  unweighted, ``sqrt(max(var, 1e-8))``. ``"mean_abs"`` (our earlier rule): the unweighted mean of ``|margin|``,
  1 if that is 0. A number: that fixed γ for both sides. The adaptive rules make the weights invariant to a
  common positive rescaling of ``v`` (for ``"std"`` while the margins' variance exceeds the 1e-8 floor).
* γ schedule (``gamma_update``). Refinement step k scores α^(k) with μ^(k) and γ^(k) and updates μ^(k+1).
  ``"lagged"`` (released code): γ^(0) comes from the margins at μ^(0) and γ^(k+1) from the margins at μ^(k),
  before the update, so the final α uses μ^(K) with γ^(K), which for K = 1 is the initial γ.
  ``"current"`` (our earlier rule): γ^(k) from the margins at μ^(k).
* Refinement. Both centroids are updated together from the previous scores with weights α|Â|.
* ``contrast="within"`` (the paper's "within-side only" ablation): the score ignores the opposite side,
  ``margin = D̄_own − ‖v − μ_own‖²`` with ``D̄_own`` the unweighted mean of ``‖v − μ_own‖²`` over the
  side's tokens, so a token scores above 1/2 when it is closer to its own centroid than the side's
  average token. γ is computed from these margins by the same rule.
* ``assignment="hard"``: ``α = 1[margin > 0]`` (no γ; the "w/o h(α)" ablation).
* ``random_weights=True``: ``λ ~ U[λ_min, λ_max]`` i.i.d. per (row, position) from ``generator``, drawn
  over the full ``(B, T)`` grid and then restricted to the scored tokens of ``Â ≠ 0`` rows (so a token's draw
  does not depend on the other tokens' masks); zero-advantage and empty-side tokens as above.
* Precision. Everything is computed in float32 (float64 if the inputs are float64), also for bf16/fp16
  inputs; the returned weights are float32 (float64).
* Distributed. Centroid sums, side weights and the γ statistics go through ``all_reduce`` (a callable
  that returns the element-wise sum over processes of the tensor it is given, e.g.
  ``lambda t: (torch.distributed.all_reduce(t), t)[1]``). The number and shapes of reductions depend
  only on the options, never on the local data, so a process with no scored token cannot deadlock the
  others; the result equals the single-process computation on the concatenated batch. Without
  ``all_reduce`` each process computes on its own shard (the released code's scope).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .precision import compute_dtype as _compute_dtype

if TYPE_CHECKING:
    from .config import DFPOConfig

__all__ = [
    "GAMMA_RULES",
    "GAMMA_UPDATES",
    "SCOPES",
    "ZERO_ADVANTAGE_RULES",
    "coefficient_options",
    "delta_token_weights",
    "delta_weights",
    "self_normalise",
    "token_weights",
    "token_weights_from_hidden",
]

Reducer = Callable[[Tensor], Tensor]
Gamma = float | str

# Option values; the first of each is the default and the authors' released code's behaviour (docs/delta.md).
GAMMA_RULES = ("std", "mean_abs")  # or a number: a fixed γ
GAMMA_UPDATES = ("lagged", "current")
ZERO_ADVANTAGE_RULES = ("lambda_min", "one")
SCOPES = ("global", "process")  # "global" is ours (all processes); "process" is the released code's
RELEASED_FLOOR = 1e-8  # the released code's floor on γ² and on a centroid's weight sum

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
    packed = _reduce(packed, all_reduce)
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


def _gamma(margin: Tensor, side: Tensor, rule: Gamma, all_reduce: Reducer | None) -> Tensor:
    """γ_side (2,) of DelTA's α (docs/delta.md step 4) from the margins of the side's tokens.

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
    """α from margins: σ(margin / γ_side) (DelTA's α, docs/delta.md step 4) or the hard 1[margin > 0]."""
    if assignment == "hard":
        return (margin > 0).to(margin.dtype)
    assert gamma is not None
    return torch.sigmoid(margin / gamma[side])


def _check_gamma(gamma: Any) -> None:
    if gamma is None:
        raise ValueError(
            "gamma=None (the former adaptive mean-|margin| γ) is no longer accepted: use 'std' (the authors' released "
            "code, the default) or 'mean_abs' (the former rule), or a number > 0 for a fixed γ."
        )
    if isinstance(gamma, str):
        if gamma not in GAMMA_RULES:
            raise ValueError(f"gamma must be one of {GAMMA_RULES} or a number > 0, got {gamma!r}")
        return
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"gamma must be a finite number > 0 (a fixed γ) or one of {GAMMA_RULES}, got {gamma!r}")


def _check_options(
    lambda_min: float,
    lambda_max: float,
    refine_steps: int,
    gamma: Gamma,
    gamma_update: str,
    zero_advantage: str,
    assignment: str,
    contrast: str,
    chunk_tokens: int,
) -> None:
    if not lambda_min <= lambda_max:
        raise ValueError(f"lambda_min ({lambda_min}) must be <= lambda_max ({lambda_max})")
    if refine_steps < 0:
        raise ValueError(f"refine_steps must be >= 0, got {refine_steps}")
    _check_gamma(gamma)
    if gamma_update not in GAMMA_UPDATES:
        raise ValueError(f"gamma_update must be one of {GAMMA_UPDATES}, got {gamma_update!r}")
    if zero_advantage not in ZERO_ADVANTAGE_RULES:
        raise ValueError(f"zero_advantage must be one of {ZERO_ADVANTAGE_RULES}, got {zero_advantage!r}")
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
    gamma: Gamma,
    gamma_update: str,
    zero_advantage: str,
    assignment: str,
    contrast: str,
    generator: torch.Generator | None,
    random_weights: bool,
    all_reduce: Reducer | None,
    chunk_tokens: int,
) -> Tensor:
    """Shared implementation: proxy vectors are ``v = coef · h`` (coef = 1 for the vector path)."""
    _check_options(
        lambda_min, lambda_max, refine_steps, gamma, gamma_update, zero_advantage, assignment, contrast, chunk_tokens
    )
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
    scored = mask.detach().to(device) != 0
    active = scored & (adv_bt != 0)
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
    if zero_advantage == "one":
        if not bool((sum_w > 0).all()):  # our earlier rule: an empty side (global) means no contrast, λ = 1
            return out.reshape(b, t)
    else:  # the released code: zero-advantage tokens get λ_min and count in the normaliser
        out[(scored & (adv_bt == 0)).reshape(-1)] = lambda_min

    if random_weights:
        gen_device = generator.device if generator is not None else device
        u = torch.rand((b, t), generator=generator, device=gen_device, dtype=dtype).to(device)
        alpha = u.reshape(-1)[idx]
    else:
        alpha = _refined_scores(
            h_flat, idx, coef, weight, side, sum_vec, sum_w, refine_steps, gamma, gamma_update, zero_advantage,
            assignment, contrast, all_reduce, chunk_tokens,
        )
    out[idx] = lambda_min + (lambda_max - lambda_min) * alpha
    return out.reshape(b, t)


def _refined_scores(
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
    """α* after ``refine_steps`` centroid refinements (docs/delta.md steps 3–5), γ scheduled by ``gamma_update``.

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
        new_vec, new_w = _side_sums(h_flat, idx, coef, weight * alpha, side, all_reduce, chunk)
        if gamma_update == "lagged" and step > 0:  # γ^(step+1) from the margins at μ^(step) (at step 0: γ^(0))
            g = gamma_of(margin)
        mu = _centroids(new_vec, new_w, mu, zero_advantage)
        margin = margins_at(mu)
        if gamma_update == "current":
            g = gamma_of(margin)
    return _scores(margin, side, assignment, g)


def token_weights(
    vectors: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lambda_min: float = 0.8,
    lambda_max: float = 1.2,
    refine_steps: int = 1,
    *,
    gamma: Gamma = "std",
    gamma_update: str = "lagged",
    zero_advantage: str = "lambda_min",
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
    (eq. DelTA-alpha; γ by ``gamma`` and ``gamma_update``); ``refine_steps`` times μ_side ← α|Â|-weighted mean
    and α recomputed; λ = λ_min + (λ_max − λ_min)α. ``advantages`` (B,) are the completions' Â, ``mask`` (B, T)
    is nonzero on scored tokens. The defaults are the authors' released code. See the module docstring for
    zero-advantage rows, padding, empty sides, the ablations (``assignment="hard"``, ``contrast="within"``,
    ``random_weights``) and ``all_reduce``. ``chunk_tokens`` bounds the float32 temporaries to
    ``chunk_tokens × d``.
    """
    return _weights_core(
        vectors, None, advantages, mask, lambda_min, lambda_max, refine_steps, gamma, gamma_update, zero_advantage,
        assignment, contrast, generator, random_weights, all_reduce, chunk_tokens,
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
    gamma: Gamma = "std",
    gamma_update: str = "lagged",
    zero_advantage: str = "lambda_min",
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
        hidden, coef, advantages, mask, lambda_min, lambda_max, refine_steps, gamma, gamma_update, zero_advantage,
        assignment, contrast, generator, random_weights, all_reduce, chunk_tokens,
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


def coefficient_options(config: DFPOConfig) -> dict[str, Any]:
    """:func:`token_weights_from_hidden` keyword arguments from a ``DFPOConfig``'s ``delta_*`` fields.

    ``delta_scope`` is not among them: it decides whether the caller passes an ``all_reduce``.
    """
    return dict(
        lambda_min=config.delta_lambda_min,
        lambda_max=config.delta_lambda_max,
        refine_steps=config.delta_refine_steps,
        gamma=config.delta_gamma,
        gamma_update=config.delta_gamma_update,
        zero_advantage=config.delta_zero_advantage,
        assignment=config.delta_assignment,
        contrast=config.delta_contrast,
        random_weights=config.delta_random,
    )


@torch.no_grad()
def delta_weights(
    hidden: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: DFPOConfig,
    *,
    per_sequence: bool = False,
    all_reduce: Reducer | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """(λ, λ̄) of one rollout batch under ``config``'s DelTA options (docs/delta.md steps 1–6).

    λ from the proxy v = (1 − p) h with p = exp(``logprobs``); λ̄ = λ N / Z over the masked tokens of the whole
    batch (the token-mean loss's domain; over all processes through ``all_reduce``) or, with ``per_sequence``,
    of each row; λ̄ is 0 outside ``mask``. The trainer's weights come from here.
    """
    probs = logprobs.detach().to(_compute_dtype(hidden, logprobs)).exp()
    raw = token_weights_from_hidden(
        hidden, probs, advantages, mask, all_reduce=all_reduce, generator=generator, **coefficient_options(config)
    )
    if per_sequence:
        bar = self_normalise(raw, mask, dim=-1)
    else:
        bar = self_normalise(raw, mask, all_reduce=all_reduce)
    return raw, torch.where(mask.to(bar.device) != 0, bar, torch.zeros_like(bar))


def delta_token_weights(
    hidden: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: DFPOConfig,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """DelTA's λ̄ (B, T) for the token-mean (``dapo``) loss, on one process (docs/delta.md).

    ``hidden`` (B, T, d): the LM-head inputs before each sampled token; ``logprobs`` (B, T): the sampled tokens'
    log-probabilities at the sampling temperature; ``advantages`` (B,); ``mask`` (B, T): nonzero on response
    tokens; ``config``: a ``DFPOConfig`` whose ``delta_*`` fields choose the rules (defaults: the authors'
    released code). Returns λ̄ = λ N / Z, N and Z summed over the batch's response tokens, 0 outside ``mask``
    (eq. DelTA-weighted-objective). One process, so ``delta_scope`` has no effect; ``generator`` feeds the
    random-λ control.
    """
    return delta_weights(hidden, logprobs, advantages, mask, config, generator=generator)[1]
