"""DFPO's objective as one function: the advantages and old log-probs that make TRL's loss compute it.

TRL's ``_compute_loss`` runs unchanged; DFPO enters only through the two inputs TRL reads after its policy forward
ℓ(θ): the advantages and the old log-probabilities. :func:`rewrite_loss_inputs` maps TRL's inputs and the sequence
weights of :class:`~dfpo_trl.objectives.weights.RowWeights` to the inputs of DFPO's objective, tensors in, tensors
out (tests/objectives/test_loss_inputs.py):

* ratio form (docs/source/concepts/design.md): Â_i → Â_i φ_i with φ_i = s̃_i / s̄_i under stop-gradient. For φ_i ≥ 0,
TRL's
  -min(s Â φ, c Â φ) = -φ Â s̄(θ), which is eq. 59–62; φ ≡ 1 for ``"none"``, so that is GSPO exactly;
* score form: old log-probs → the detached current ones (ratio 1 in value, ∇ρ in gradient, never clipped) and
  Â → Â_i s̃_i, so the policy term is -Â_i sg(s̃_i) ρ_i(θ) (eq. 16/68/85);
* the flipped rows of Orth-Proj (any transform registered with ``nonnegative=False``) under
  ``cancellation_target="gradient"`` take the score representation (docs/source/concepts/cancellation.md);
* GRPO-fix (Appendix H, eq. 79–80): for Â < 0, tokens with r > 1+ε_high get the constant ratio 1+ε_high (zero
  gradient), which with TRL's ε_low := 1 makes the weight the same operator for both signs;
* DelTA (docs/source/concepts/delta.md): Â → Â_i λ̄_{i,t} (B, T) last; since λ̄ > 0, the policy term is -λ̄ min(rÂ,
clip(r)Â)
  (eq. DelTA-weighted-objective).

β-KL, the vLLM importance-sampling correction, the entropy bonus, ``top_entropy_quantile``, truncation masking and
TRL's ``delta`` clipping are TRL's code paths and apply on top unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .normalise import self_normalise
from .weights import RowWeights

__all__ = [
    "LossInputs",
    "RewriteForm",
    "RewrittenInputs",
    "grpo_fix_old_logps",
    "rewrite_loss_inputs",
    "sequence_level_inputs",
    "token_weighted_advantages",
]


class RewriteForm(NamedTuple):
    """The constants of the rewrite, resolved once from the config by the objective plan (objectives/plan.py)."""

    grpo_fix: bool  # symmetric_clip: GRPO-fix's old log-probs (eq. 79–80)
    score_form: bool  # transform_gradient="score": -Â sg(s̃) ρ(θ) (eq. 16/68/85)
    transform_active: bool  # a group transform other than "none": Â φ
    flip_to_score: bool  # weights that may be < 0 (Orth-Proj) under the gradient target: flipped rows as score form
    renormalise_lambda_bar: bool  # DelTA under loss_type="bnpo": λ̄ averages 1 over the micro-batch


class LossInputs(NamedTuple):
    """What TRL's loss reads after its policy forward, as DFPO hands it over: the advantages ((B,), or (B, T) with
    DelTA), the old log-probs (None: TRL uses the detached current ones) and, under GRPO-fix, the (B, T) tokens
    whose ratio was capped (else None)."""

    advantages: Tensor
    old_per_token_logps: Tensor | None
    capped: Tensor | None


def rewrite_loss_inputs(
    per_token_logps: Tensor,
    old: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    form: RewriteForm,
    *,
    eps_high: float,
    weights: RowWeights | None = None,
    differentiate: bool = False,
    lambda_bar: Tensor | None = None,
) -> LossInputs:
    """DFPO's objective expressed in TRL's loss inputs (module docstring).

    Args:
        per_token_logps: ℓ(θ) (B, T) with its graph.
        old: TRL's old log-probs (B, T) after the log-ratio bound; None on-policy.
        advantages: Â (B,). mask: the loss mask (B, T). form: the rewrite's constants. eps_high: TRL's ε_high.
        weights: the rows' s̄, s̃, U and two-sided flags (B,) each at sequence level (None: no sequence rewrite).
        differentiate: the no-stop-gradient ablation, s̃(θ)/s̄(θ) with the graph kept.
        lambda_bar: DelTA's λ̄ (B, T), or None.

    Returns:
        :class:`LossInputs`: the advantages ((B,), or (B, T) with DelTA), the old log-probs (None: unchanged) and
        GRPO-fix's capped tokens (B, T) or None.
    """
    current_old = per_token_logps.detach() if old is None else old
    capped = None
    if form.grpo_fix:
        old, capped = grpo_fix_old_logps(per_token_logps, current_old, advantages, eps_high)
    if weights is not None:
        advantages, rewritten_old = sequence_level_inputs(
            per_token_logps, current_old, advantages, *weights, score_form=form.score_form,
            differentiate=differentiate, transform_active=form.transform_active, flip_to_score=form.flip_to_score,
        )
        if rewritten_old is not None:
            old = rewritten_old
    if lambda_bar is not None:
        advantages = token_weighted_advantages(advantages, lambda_bar, mask, form.renormalise_lambda_bar)
    return LossInputs(advantages, old, capped)


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


class RewrittenInputs(NamedTuple):
    """The two loss inputs of :func:`sequence_level_inputs`; ``old_per_token_logps`` is None where they stay."""

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


def token_weighted_advantages(advantages: Tensor, lambda_bar: Tensor, mask: Tensor, renormalise: bool) -> Tensor:
    """Â_i → Â_i λ̄_{i,t} (eq. DelTA-weighted-objective), applied after everything that reads the 1-D advantages.

    Args:
        advantages: Â (B,) (or already (B, T)). lambda_bar: DelTA's λ̄ (B, T). mask: the loss mask (B, T).
        renormalise: ``loss_type="bnpo"`` (normalised by the micro-batch's own tokens): λ̄ first made to average 1
            over this micro-batch's loss tokens (docs/source/concepts/delta.md step 6).

    Returns:
        The token-weighted advantages (B, T).
    """
    if renormalise:
        lambda_bar = self_normalise(lambda_bar, mask)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return advantages * lambda_bar.to(device=advantages.device, dtype=advantages.dtype)
