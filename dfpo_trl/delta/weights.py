"""DelTA token weights λ and λ̄ (docs/delta.md): the public pure functions and the rules of their options.

Scores each rollout token by how characteristic its proxy gradient vector is of its own advantage side versus the
other (eq. DelTA-alpha), maps the scores into λ ∈ [λ_min, λ_max] and self-normalises them into the stop-gradient
multipliers λ̄ (eq. DelTA-weighted-objective). Defaults are the authors' released code's rules; the conventions
(support, empty sides, precision, distributed reductions) are in docs/delta.md, "Conventions of the functions".
Everything here is a ``no_grad`` function of detached tensors.
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
    """A fixed ``delta_gamma`` given as a numeric string (the command line) or an int becomes a float.

    Args:
        gamma: ``delta_gamma`` as given (a rule's name, a number, or a numeric string).

    Returns:
        The rule's name, or the fixed γ as a float (anything else unchanged, for the rule to refuse).
    """
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
    is nonzero on scored tokens. The defaults are the authors' released code. Zero-advantage rows, padding,
    empty sides, the ablations and ``all_reduce``: docs/delta.md, "Conventions of the functions".

    Args:
        vectors: (B, T, d) proxy token-gradient vectors v.
        advantages: (B,) the completions' Â.
        mask: (B, T), nonzero on scored (response) tokens.
        lambda_min, lambda_max, refine_steps, gamma, gamma_update, zero_advantage, assignment, contrast: DelTA's
            options (``DFPOConfig``'s ``delta_*`` fields without the prefix; checked by :data:`DELTA_RULES`).
        generator: the random-λ control's generator (``random_weights=True``).
        random_weights: λ ~ U[λ_min, λ_max] instead of the scores (control).
        all_reduce: element-wise sum over processes of the statistics; None: this process's shard alone.
        chunk_tokens: bounds the float32 temporaries to ``chunk_tokens × d``.

    Returns:
        λ (B, T): float32 (float64 for float64 input), 1 at padding positions.
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

    Args:
        hidden: (B, T, d) LM-head inputs h.
        token_probs: (B, T) the sampled tokens' probabilities p.
        advantages, mask, and the keyword options: as :func:`token_weights`.

    Returns:
        λ (B, T), as :func:`token_weights` returns it.
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
        stats = all_reduced(stats, all_reduce)
        z, n = stats[0], stats[1]
    else:
        if all_reduce is not None:
            raise ValueError("all_reduce is only supported with dim=None (a global normalisation domain)")
        z, n = (w * m).sum(dim, keepdim=True), m.sum(dim, keepdim=True)
    scale = torch.where(z > 0, n / torch.where(z > 0, z, torch.ones_like(z)), torch.ones_like(z))
    return w * scale
