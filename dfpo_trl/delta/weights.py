"""DelTA token weights λ and λ̄ (docs/delta.md): the public functions, their options and conventions.

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

from types import SimpleNamespace
from typing import Any, Protocol

import torch
from torch import Tensor

from ..options import ASSIGNMENTS, CONTRASTS, GAMMA_RULES, GAMMA_UPDATES, SCOPES, ZERO_ADVANTAGE_RULES
from ..precision import compute_dtype as _compute_dtype
from ..rules import FieldRule, finite, integer, one_of, problems, quoted
from .centroids import Gamma, Reducer, all_reduced, refined_scores, side_sums

__all__ = [
    "DELTA_RULES",
    "DeltaFields",
    "read_gamma",
    "self_normalise",
    "token_weights",
    "token_weights_from_hidden",
]

_DEFAULT_CHUNK = 16384


class DeltaFields(Protocol):
    """What DelTA reads of a ``DFPOConfig``: its ``delta_*`` fields (and, at rollout time, TRL's ``loss_type``)."""

    loss_type: str
    delta_lambda_min: float
    delta_lambda_max: float
    delta_refine_steps: int
    delta_gamma: Gamma
    delta_gamma_update: str
    delta_zero_advantage: str
    delta_scope: str
    delta_assignment: str
    delta_contrast: str
    delta_random: bool


def read_gamma(gamma: Any) -> Any:
    """A fixed ``delta_gamma`` given as a numeric string (the command line) or an int becomes a float."""
    if isinstance(gamma, str) and gamma not in GAMMA_RULES:
        try:
            return float(gamma)
        except ValueError:
            return gamma
    if integer(gamma):
        return float(gamma)
    return gamma


def _gamma_rule(value: Any, _: Any) -> str:
    if value is None:
        return "is no longer accepted (it meant the adaptive mean-|margin| gamma)"
    return "is not valid: it must be 'std', 'mean_abs' or a finite number > 0 (a fixed gamma)"


#: DelTA's options and their one rule each, under the config's field names; the functions below take the same
#: options as keyword arguments without the ``delta_`` prefix and apply these rules to them.
DELTA_RULES: tuple[FieldRule, ...] = (
    FieldRule(
        "delta_lambda_min",
        lambda v, c: finite(v) and (not finite(c.delta_lambda_max) or 0 < v <= c.delta_lambda_max),
        lambda _, c: f"with delta_lambda_max={c.delta_lambda_max!r} must be a finite number with "
        "0 < delta_lambda_min <= delta_lambda_max (the weights multiply advantages and must stay positive)",
        "the paper uses 0.8 and 1.2",
    ),
    FieldRule("delta_lambda_max", lambda v, _: finite(v), "must be a finite number", "the paper uses 0.8 and 1.2"),
    FieldRule(
        "delta_refine_steps", lambda v, _: integer(v) and v >= 0, "must be an integer >= 0", "the paper uses 1"
    ),
    FieldRule(
        "delta_gamma", lambda v, _: v in GAMMA_RULES or finite(v) and v > 0, _gamma_rule,
        "use 'std' (the authors' released code, the default), 'mean_abs' (the former rule) or a fixed number > 0",
    ),
    FieldRule("delta_gamma_update", one_of(GAMMA_UPDATES), "is not valid", f"use {quoted(GAMMA_UPDATES)}"),
    FieldRule("delta_zero_advantage", one_of(ZERO_ADVANTAGE_RULES), "is not valid",
              f"use {quoted(ZERO_ADVANTAGE_RULES)}"),
    FieldRule("delta_scope", one_of(SCOPES), "is not valid", f"use {quoted(SCOPES)}"),
    FieldRule("delta_assignment", one_of(ASSIGNMENTS), "is not valid", f"use {quoted(ASSIGNMENTS)}"),
    FieldRule("delta_contrast", one_of(CONTRASTS), "is not valid", f"use {quoted(CONTRASTS)}"),
)
_FUNCTION_RULES = tuple(rule for rule in DELTA_RULES if rule.field != "delta_scope")  # scope: the caller's reducer


def _check_options(chunk_tokens: int, **options: Any) -> None:
    """:data:`DELTA_RULES` on a function's keyword arguments (``lambda_min`` for ``delta_lambda_min``, ...), every
    problem at once, named as the function's arguments."""
    holder = SimpleNamespace(**{f"delta_{name}": value for name, value in options.items()})
    found = [p.replace("delta_", "") for p in problems(_FUNCTION_RULES, holder)]
    if not (integer(chunk_tokens) and chunk_tokens >= 1):
        found.append(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1; the default is {_DEFAULT_CHUNK}")
    if found:
        raise ValueError("invalid DelTA option(s): " + " | ".join(found) + ".")


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
        chunk_tokens, lambda_min=lambda_min, lambda_max=lambda_max, refine_steps=refine_steps, gamma=gamma,
        gamma_update=gamma_update, zero_advantage=zero_advantage, assignment=assignment, contrast=contrast,
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
    sum_vec, sum_w = side_sums(h_flat, idx, coef, weight, side, all_reduce, chunk_tokens)
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
        alpha = refined_scores(
            h_flat, idx, coef, weight, side, sum_vec, sum_w, refine_steps, gamma, gamma_update, zero_advantage,
            assignment, contrast, all_reduce, chunk_tokens,
        )
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
    side's scored tokens (docs/delta.md step 3); α = σ((‖v − μ_opp‖² − ‖v − μ_own‖²)/γ_side)
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
        stats = all_reduced(stats, all_reduce)
        z, n = stats[0], stats[1]
    else:
        if all_reduce is not None:
            raise ValueError("all_reduce is only supported with dim=None (a global normalisation domain)")
        z, n = (w * m).sum(dim, keepdim=True), m.sum(dim, keepdim=True)
    scale = torch.where(z > 0, n / torch.where(z > 0, z, torch.ones_like(z)), torch.ones_like(z))
    return w * scale
