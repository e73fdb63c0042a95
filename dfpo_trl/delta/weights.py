"""DelTA token weights λ (docs/source/concepts/delta.md): the math, private to the package.

Scores each rollout token by how characteristic its proxy gradient vector is of its own advantage side versus the
other (eq. DelTA-alpha) and maps the scores into λ ∈ [λ_min, λ_max];
:func:`~dfpo_trl.objectives.normalise.self_normalise` turns them into the stop-gradient multipliers λ̄
(eq. DelTA-weighted-objective). The one public entry point is :func:`dfpo_trl.delta.delta_token_weights`
(:mod:`dfpo_trl.delta.rollout`), which computes λ under a config's options, checked once when the config was built.
:func:`_token_weights` (proxy vectors) and :func:`_token_weights_from_hidden` (the LM-head-row proxy) take the
options as keyword arguments and check them against the config's rules
(:data:`~dfpo_trl.config.delta_rules.DELTA_RULES`): the reference forms the tests hold the math to. Defaults are
the authors' released code's rules; the conventions (support, empty sides, precision, distributed reductions) are in
docs/source/concepts/delta.md, "Conventions of the functions". Everything here is a ``no_grad`` function of detached
tensors.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Protocol

import torch
from torch import Tensor

from ..config.delta_rules import (
    DELTA_GAMMA_DEFAULT,
    DELTA_LAMBDA_MAX_DEFAULT,
    DELTA_LAMBDA_MIN_DEFAULT,
    DELTA_REFINE_STEPS_DEFAULT,
    DELTA_RULES,
)
from ..config.rules import integer, problems
from ..precision import compute_dtype as _compute_dtype
from .centroids import Gamma, Reducer, refined_scores, side_sums

__all__ = ["DeltaFields"]

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
    """Shared implementation: proxy vectors are ``v = coef · h`` (coef = 1 for the vector path); the options are
    checked by the caller (:func:`_check_options`, or the config when it was built)."""
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


def _token_weights(
    vectors: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lambda_min: float = DELTA_LAMBDA_MIN_DEFAULT,
    lambda_max: float = DELTA_LAMBDA_MAX_DEFAULT,
    refine_steps: int = DELTA_REFINE_STEPS_DEFAULT,
    *,
    gamma: Gamma = DELTA_GAMMA_DEFAULT,
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

    DelTA's method (docs/source/concepts/delta.md): centroids μ_± are the |Â|-weighted means of ``vectors`` (B, T, d)
    over each side's scored tokens (docs/source/concepts/delta.md step 3); α = σ((‖v − μ_opp‖² − ‖v − μ_own‖²)/γ_side)
    (eq. DelTA-alpha; γ by ``gamma`` and ``gamma_update``); ``refine_steps`` times μ_side ← α|Â|-weighted mean
    and α recomputed; λ = λ_min + (λ_max − λ_min)α. ``advantages`` (B,) are the completions' Â, ``mask`` (B, T)
    is nonzero on scored tokens. The defaults are the authors' released code. Zero-advantage rows, padding,
    empty sides, the ablations and ``all_reduce``: docs/source/concepts/delta.md, "Conventions of the functions".

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
    _check_options(
        chunk_tokens, lambda_min=lambda_min, lambda_max=lambda_max, refine_steps=refine_steps, gamma=gamma,
        gamma_update=gamma_update, zero_advantage=zero_advantage, assignment=assignment, contrast=contrast,
    )
    return _weights_core(
        vectors, None, advantages, mask, lambda_min, lambda_max, refine_steps, gamma, gamma_update, zero_advantage,
        assignment, contrast, generator, random_weights, all_reduce, chunk_tokens,
    )


def _token_weights_from_hidden(
    hidden: Tensor,
    token_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lambda_min: float = DELTA_LAMBDA_MIN_DEFAULT,
    lambda_max: float = DELTA_LAMBDA_MAX_DEFAULT,
    refine_steps: int = DELTA_REFINE_STEPS_DEFAULT,
    *,
    gamma: Gamma = DELTA_GAMMA_DEFAULT,
    gamma_update: str = "lagged",
    zero_advantage: str = "lambda_min",
    assignment: str = "soft",
    contrast: str = "opposite",
    generator: torch.Generator | None = None,
    random_weights: bool = False,
    all_reduce: Reducer | None = None,
    chunk_tokens: int = _DEFAULT_CHUNK,
) -> Tensor:
    """:func:`_token_weights` for the LM-head-row proxy v = (1 − p) h without materialising v.

    DelTA's proxy (docs/source/concepts/delta.md step 1): ∇_{W_y} log p(y) = (1 − p(y)) h. ``hidden`` (B, T, d) are the
    final hidden states feeding the LM head, ``token_probs`` (B, T) the sampled tokens' probabilities p. Sums are
    Σ w (1 − p) h (matmuls over h), distances use ‖v − μ‖² = (1−p)²‖h‖² − 2(1−p) h·μ + ‖μ‖²
    (docs/source/concepts/delta.md); the only (tokens × d) temporaries are float32 copies of at most ``chunk_tokens``
    rows of h. Equal to ``_token_weights((1 - token_probs)[..., None] * hidden, ...)`` up to float rounding.

    Args:
        hidden: (B, T, d) LM-head inputs h.
        token_probs: (B, T) the sampled tokens' probabilities p.
        advantages, mask, and the keyword options: as :func:`_token_weights`.

    Returns:
        λ (B, T), as :func:`_token_weights` returns it.
    """
    _check_options(
        chunk_tokens, lambda_min=lambda_min, lambda_max=lambda_max, refine_steps=refine_steps, gamma=gamma,
        gamma_update=gamma_update, zero_advantage=zero_advantage, assignment=assignment, contrast=contrast,
    )
    coef = 1.0 - token_probs.detach().to(_compute_dtype(hidden))
    return _weights_core(
        hidden, coef, advantages, mask, lambda_min, lambda_max, refine_steps, gamma, gamma_update, zero_advantage,
        assignment, contrast, generator, random_weights, all_reduce, chunk_tokens,
    )

