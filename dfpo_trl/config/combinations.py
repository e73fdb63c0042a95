"""The rules between ``DFPOConfig``'s fields, checked after every field's own rule (:mod:`dfpo_trl.config.checks`):
what a transform, the gradient target, GRPO-fix, DelTA and TRL's options need of each other. The first rule broken
raises, naming the fields and the fix.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .method import method_in_use
from .options import CLIPPED_LOSS_TYPES, DELTA_LOSS_TYPES, TOKEN_LEVEL_CLIPPED_LOSS_TYPES
from .rules import quoted

DFPOConfig = Any  # the config being built: these rules read its fields (config/fields.py imports this module)

__all__ = ["check_combinations", "check_sequence_options"]


def check_combinations(config: DFPOConfig) -> None:
    """Each rule between fields in turn; the first one broken raises."""
    for check in (_cancellation, _group_granular, _sequence_rewrite, _symmetric_clip, _old_logps_rewrite,
                  _off_policy_mask, _delta, _liger_kernel, _truncated_support):
        check(config)


def check_sequence_options(config: DFPOConfig) -> None:
    """The rules between the options that choose the objective (a transform, the score form, GRPO-fix) and TRL's
    importance-sampling level and loss type. They read no registry and import no torch, so ``dfpo-train`` checks
    them before its heavy imports (``config`` may be any object with the fields :func:`method_in_use` reads)."""
    _sequence_rewrite(config)
    _symmetric_clip(config)


def _require_clipped_loss_type(config: DFPOConfig, what: str) -> None:
    if config.loss_type not in CLIPPED_LOSS_TYPES:
        raise ValueError(
            f"{what} rewrites TRL's clipped surrogate, which loss_type={config.loss_type!r} does not use. Set "
            f"loss_type to one of {quoted(CLIPPED_LOSS_TYPES, ', ')}."
        )


def _cancellation(config: DFPOConfig) -> None:
    """cancellation_target='gradient' (docs/source/concepts/cancellation.md) and what it needs."""
    if config.cancellation_target == "weights":
        if config.cancellation_one_sided != "keep":
            raise ValueError(
                f"cancellation_one_sided={config.cancellation_one_sided!r} applies only with "
                "cancellation_target='gradient' (with 'weights' no group is one-sided); set "
                "cancellation_target='gradient' or leave cancellation_one_sided='keep'."
            )
        return
    from ..transforms import get_transform, not_retargetable  # the registry imports torch

    transform = get_transform(config.group_transform)
    if not transform.retargetable:
        raise ValueError(not_retargetable(transform))
    if not config.transform_stop_gradient:
        raise ValueError(
            "cancellation_target='gradient' balances stop-gradient weights; transform_stop_gradient=False "
            "differentiates the transform, whose gradient is then not a_i s~_i. Set transform_stop_gradient=True "
            "or cancellation_target='weights'."
        )
    if config.top_entropy_quantile < 1.0:
        raise ValueError(
            f"cancellation_target='gradient' cannot be combined with top_entropy_quantile="
            f"{config.top_entropy_quantile}: TRL's entropy mask is chosen per micro-batch after the weights are "
            "fixed, so it changes which tokens carry gradient. Set top_entropy_quantile=1.0 or "
            "cancellation_target='weights'."
        )


def _group_granular(config: DFPOConfig) -> None:
    if config.group_granular_batches is False and not config.transform_stop_gradient:
        raise ValueError(
            "transform_stop_gradient=False differentiates the transform through every member's s̄, so whole "
            "groups must be in one micro-batch, but group_granular_batches=False. Set "
            "group_granular_batches=None (automatic) or True."
        )


def _sequence_rewrite(config: DFPOConfig) -> None:
    """A transform, the score form or no stop-gradient: GSPO's sequence-level clipped loss only."""
    method = method_in_use(config)
    if not method.rewrites_sequences:
        return
    what = method.sequence_options
    if config.importance_sampling_level != "sequence":
        raise ValueError(
            f"{what} acts on sequence weights and needs importance_sampling_level='sequence' (GSPO), but "
            f"importance_sampling_level={config.importance_sampling_level!r}. Set "
            "importance_sampling_level='sequence', or use symmetric_clip=True for the token-level fix."
        )
    _require_clipped_loss_type(config, what)
    if not config.transform_stop_gradient and config.transform_gradient == "score":
        raise ValueError(
            "transform_stop_gradient=False is the ablation of the ratio form; it does not apply to "
            "transform_gradient='score' (whose weight is sg(s~) by definition). Use transform_gradient='ratio'."
        )


def _symmetric_clip(config: DFPOConfig) -> None:
    """GRPO-fix (Appendix H): a token-level clipped loss, not with the sequence-level options."""
    if not config.symmetric_clip:
        return
    if config.importance_sampling_level != "token":
        raise ValueError(
            "symmetric_clip=True (GRPO-fix, Appendix H) is a token-level objective, but "
            f"importance_sampling_level={config.importance_sampling_level!r}. Set "
            "importance_sampling_level='token', or use group_transform for sequence-level DFPO."
        )
    if method_in_use(config).rewrites_sequences:
        raise ValueError(
            "symmetric_clip=True cannot be combined with group_transform/transform_gradient/"
            "transform_stop_gradient options, which are sequence-level; choose one of the two."
        )
    _require_clipped_loss_type(config, "symmetric_clip=True")
    if config.loss_type not in TOKEN_LEVEL_CLIPPED_LOSS_TYPES:
        raise ValueError(
            f"symmetric_clip=True cannot be combined with loss_type={config.loss_type!r} (a sequence-level loss); "
            f"use loss_type {quoted(TOKEN_LEVEL_CLIPPED_LOSS_TYPES)}."
        )


def _old_logps_rewrite(config: DFPOConfig) -> None:
    """Options that hand TRL rewritten old log-probs: nothing else of TRL's may read them."""
    from ..transforms import get_transform  # the registry imports torch

    # A transform whose weights may go negative (Orth-Proj) under the gradient target hands TRL the score
    # representation for rows whose weight flips sign.
    flips_to_score = config.cancellation_target == "gradient" and not get_transform(config.group_transform).nonnegative
    if config.symmetric_clip:
        what = "symmetric_clip=True"
    elif config.transform_gradient == "score":
        what = "transform_gradient='score'"
    elif flips_to_score:
        what = f"group_transform={config.group_transform!r} (weights may be < 0) with cancellation_target='gradient'"
    else:
        return
    if config.use_bias_correction_kl and config.beta != 0.0:
        raise ValueError(
            f"{what} cannot be combined with beta != 0 and use_bias_correction_kl=True: the KL term "
            "would be weighted by the rewritten importance ratio. Set use_bias_correction_kl=False."
        )
    if config.off_policy_mask_threshold is not None:
        raise ValueError(
            f"{what} cannot be combined with off_policy_mask_threshold: the off-policy mask would read "
            "the rewritten old log-probabilities. Set off_policy_mask_threshold=None."
        )


def _off_policy_mask(config: DFPOConfig) -> None:
    """TRL's off-policy mask drops sequences from the loss after the transform has balanced the group: only the
    gradient target folds it into the balance (docs/source/concepts/cancellation.md, "TRL's off-policy mask")."""
    if config.off_policy_mask_threshold is None or config.cancellation_target == "gradient":
        return
    from ..transforms import get_transform  # the registry imports torch

    if get_transform(config.group_transform).balances:  # a built-in or registered transform with a balance
        raise ValueError(
            f"group_transform={config.group_transform!r} with cancellation_target='weights' cannot be combined "
            f"with off_policy_mask_threshold={config.off_policy_mask_threshold!r}: TRL's off-policy mask drops "
            "negative-advantage sequences from the loss after the transform has balanced sum_i A_i s~_i = 0 over "
            "the whole group, so the balance does not hold over the sequences that are trained. Set "
            "cancellation_target='gradient' (the balance then holds over the sequences that survive both the clip "
            "and the mask), or off_policy_mask_threshold=None."
        )


def _delta(config: DFPOConfig) -> None:
    """DelTA (docs/source/concepts/delta.md): its options only with token_weighting='delta', token-level clipped losses
    only."""
    if config.token_weighting != "delta":
        changed = [
            f.name for f in fields(config) if f.name.startswith("delta_") and getattr(config, f.name) != f.default
        ]
        if changed:
            raise ValueError(
                f"{', '.join(changed)}: DelTA options have no effect unless token_weighting='delta', but "
                f"token_weighting={config.token_weighting!r}. Set token_weighting='delta' or leave them at their "
                "defaults."
            )
        return
    if config.importance_sampling_level != "token":
        raise ValueError(
            "token_weighting='delta' weights tokens, but importance_sampling_level="
            f"{config.importance_sampling_level!r}: TRL's sequence-level loss is one term per sequence broadcast "
            "over its tokens, so a per-token multiplier would only rescale each sequence by its mean weight. "
            "Set importance_sampling_level='token'."
        )
    if config.loss_type not in DELTA_LOSS_TYPES:
        raise ValueError(
            f"token_weighting='delta' multiplies TRL's per-token clipped surrogate and keeps the normaliser of "
            f"loss_type, but loss_type={config.loss_type!r} is not a token-level clipped loss. Set loss_type to "
            f"one of {quoted(DELTA_LOSS_TYPES, ', ')}."
        )


def _liger_kernel(config: DFPOConfig) -> None:
    """TRL 1.16's deprecated ``use_liger_kernel`` swaps the model's layers for Liger's Triton kernels (GPU only):
    DFPO's objectives with them have never run here (docs/source/concepts/decisions.md, "TRL features on top"), so an
    option that changes the loss is refused with them rather than trained untested. Without one, TRL's own path is left
    as is."""
    active = method_in_use(config).active_options
    if config.use_liger_kernel and active:
        raise ValueError(
            f"use_liger_kernel=True cannot be combined with {active}: TRL 1.16 deprecates it and its Triton layer "
            "kernels need a GPU, so DFPO's loss has not been tested with them. Set use_liger_kernel=False."
        )


# Sampling parameters that change vLLM's distribution before its truncation, or its temperature: the trainer cannot
# rebuild the support from logits it never sees (trl_hooks/sampling_support.py keeps the same list).
SUPPORT_CHANGING_KWARGS = ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty",
                           "logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "logits_processors")


def _truncated_support(config: DFPOConfig) -> None:
    """``vllm_importance_sampling_support="truncated"`` changes TRL's vLLM ratio, and rebuilds vLLM's support from
    the trainer's logits: with vLLM on, TRL must compute that ratio, and vLLM's distribution must be the trainer's
    before the truncation. Without vLLM the field waits for it (a recipe that generates either way keeps it)."""
    if config.vllm_importance_sampling_support != "truncated" or not config.use_vllm:
        return
    if not config.vllm_importance_sampling_correction:
        raise ValueError(
            "vllm_importance_sampling_support='truncated' changes TRL's vLLM importance-sampling ratio, which "
            "vllm_importance_sampling_correction=False turns off. Set vllm_importance_sampling_correction=True, or "
            "leave vllm_importance_sampling_support='full'."
        )
    changed = ["repetition_penalty"] if config.repetition_penalty != 1.0 else []
    changed += [key for key in SUPPORT_CHANGING_KWARGS if key in (config.generation_kwargs or {})]
    if changed:
        raise ValueError(
            f"vllm_importance_sampling_support='truncated' rebuilds the support vLLM samples from out of the "
            f"trainer's logits, but {', '.join(changed)} changes vLLM's distribution before its truncation "
            "(the trainer never sees it). Leave repetition_penalty=1.0 and those keys out of generation_kwargs, or "
            "set vllm_importance_sampling_support='full'."
        )
