"""DFPO's rewrite of the inputs TRL's loss reads after its policy forward: pure functions of tensors.

TRL's ``_compute_loss`` runs unchanged; DFPO enters only through the advantages and the old log-probabilities it
reads after computing the current per-token log-probs ℓ(θ). Everything here maps tensors to tensors (no trainer,
no config object), so each rule is tested on its own (tests/test_loss_inputs.py):

* :func:`loss_mask`: the tokens TRL's loss counts (completion mask × tool mask);
* :func:`bounded_old_logps`: the log-ratio bound (README "Log-ratio bound"): ρ (sequence level) or each
  token's log-ratio kept in ±20 by shifting the old log-probs, gradients unchanged;
* :func:`grpo_fix_old_logps`: GRPO-fix, Appendix H eq. 79–80: for Â < 0, tokens with r > 1+ε_high get the
  constant ratio 1+ε_high (zero gradient);
* :func:`post_clip_weights`: s̄ (eq. 44–47) and U, the members whose gradient survives the clip (eq. C2);
* :func:`sequence_level_inputs`: advantages and old log-probs from s̄ and s̃ in the configured gradient form:
  ratio form Â φ with φ = sg(s̃/s̄) (eq. 59–62), the differentiated ablation Â s̃(θ)/s̄(θ), the score form
  (old := sg(ℓ), advantage Â sg(s̃): -Â sg(s̃) ρ(θ), eq. 16/68/85), and the score representation of the rows
  whose weight flips sign under Orth-Proj with ``cancellation_target="gradient"`` (docs/cancellation.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .cancellation import clip_survivors
from .transforms import sequence_log_ratio, sign_aware_post_clip

__all__ = [
    "MAX_LOG_RATIO",
    "PostClipWeights",
    "RewrittenInputs",
    "bounded_old_logps",
    "grpo_fix_old_logps",
    "loss_mask",
    "post_clip_weights",
    "sequence_level_inputs",
]

MAX_LOG_RATIO = 20.0


def loss_mask(inputs: Mapping[str, Any]) -> Tensor:
    """The tokens TRL's loss counts: ``completion_mask`` times ``tool_mask`` where the rollout has one."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def bounded_old_logps(
    per_token_logps: Tensor, old: Tensor, mask: Tensor, sequence_level: bool, max_log_ratio: float = MAX_LOG_RATIO
) -> Tensor:
    """Old log-probs shifted so that TRL's log-ratio, ρ_i (eq. 44) at sequence level or ℓ − ℓ_old per token,
    lies in ±``max_log_ratio``: exp() never overflows and Â = 0 rows never give inf·0. Inside the bound the
    shift is exactly 0 (the same values, no data-dependent branch); gradients are unchanged."""
    log_ratio = per_token_logps.detach() - old
    if sequence_level:
        rho = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        excess = rho - rho.clamp(-max_log_ratio, max_log_ratio)
        return old + excess.unsqueeze(1) * mask
    return old + (log_ratio - log_ratio.clamp(-max_log_ratio, max_log_ratio))


def grpo_fix_old_logps(
    per_token_logps: Tensor, old: Tensor, advantages: Tensor, eps_high: float
) -> tuple[Tensor, Tensor]:
    """GRPO-fix for Â < 0 (eq. 79): where r = exp(ℓ − ℓ_old) > 1+ε_high, old := ℓ − log(1+ε_high), so that
    log r = log(1+ε_high) exactly with no gradient path left (the weight is the same operator for both signs,
    eq. 80). With TRL's ε_low := 1 this gives the clip(r, 0, 1+ε_high) of eq. 79. Returns (old log-probs, the
    (B, T) tokens so capped)."""
    log_cap = math.log1p(eps_high)
    capped = (advantages < 0).unsqueeze(1) & ((per_token_logps.detach() - old) > log_cap)
    return torch.where(capped, per_token_logps - log_cap, old), capped


class PostClipWeights(NamedTuple):
    """Per row: s̄ (eq. 47), U (eq. C2) and whether a NaN/Inf token log-ratio was read as 0 / ±1e6."""

    s_bar: Tensor
    survives: Tensor
    sanitised: Tensor


def post_clip_weights(
    logps: Tensor, old: Tensor, mask: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
    delta: float | None = None, score_form: bool = False,
) -> PostClipWeights:
    """s̄ = sign-aware post-clip of s = exp(ρ) (eq. 44–47) and U, the rows whose gradient survives TRL's clip
    (eq. C2; every row in the score form, which is never clipped). Differentiable in ``logps``."""
    sanitised = (~torch.isfinite(logps.detach() - old) & (mask != 0)).any(-1)
    s = torch.exp(sequence_log_ratio(logps, old, mask))
    s_bar = sign_aware_post_clip(s, advantages, eps_low, eps_high)
    if score_form:
        return PostClipWeights(s_bar, torch.ones_like(s, dtype=torch.bool), sanitised)
    return PostClipWeights(s_bar, clip_survivors(s.detach(), advantages, eps_low, eps_high, delta), sanitised)


class RewrittenInputs(NamedTuple):
    """The two loss inputs DFPO hands TRL; ``old_per_token_logps`` is None where they stay as they were."""

    advantages: Tensor
    old_per_token_logps: Tensor | None


def sequence_level_inputs(
    per_token_logps: Tensor,
    old: Tensor | None,
    advantages: Tensor,
    s_bar: Tensor,
    s_tilde: Tensor,
    survives: Tensor,
    two_sided: Tensor,
    *,
    score_form: bool,
    differentiate: bool,
    transform_active: bool,
    flip_to_score: bool,
) -> RewrittenInputs:
    """TRL's sequence-level loss inputs that make its clipped surrogate DFPO's objective (module docstring).

    ``score_form``: -Â sg(s̃) ρ(θ) (old := sg(ℓ): ratio 1 in value, ∇ρ in gradient, never clipped).
    ``differentiate``: -Â s̃(θ) on both clip branches (Â s̃/s̄ with the graph kept; the no-stop-gradient ablation).
    ``transform_active`` (ratio form): Â φ, φ = s̃/s̄; with ``flip_to_score`` (Orth-Proj, gradient target), rows of
    U in two-sided groups whose φ < 0 take the score representation instead, since Â φ of flipped sign would
    select TRL's other clip branch: same value Â s̃ and same gradient Â s̃ ∇ρ as J = Â φ s̄(θ) for a member of U.
    Otherwise (GSPO) nothing changes: TRL's inputs are returned as they are."""
    if score_form:
        return RewrittenInputs(advantages * s_tilde.detach().to(advantages.dtype), per_token_logps.detach())
    if differentiate:
        return RewrittenInputs(advantages * (s_tilde / s_bar).to(advantages.dtype), None)
    if not transform_active:
        return RewrittenInputs(advantages, None)
    phi = s_tilde / s_bar
    weighted = advantages * phi.to(advantages.dtype)
    if not flip_to_score:
        return RewrittenInputs(weighted, None)
    flipped = survives & two_sided & (phi < 0)
    current = per_token_logps.detach()
    old = current if old is None else old  # on-policy: the old log-probs are the detached current ones
    scored = advantages * s_tilde.detach().to(advantages.dtype)
    return RewrittenInputs(
        torch.where(flipped, scored, weighted), torch.where(flipped.unsqueeze(1), current, old)
    )
