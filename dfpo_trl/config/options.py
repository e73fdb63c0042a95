"""The one owner of DFPO's option values and of the table of TRL's loss types; it imports nothing from ``dfpo_trl``.

Each closed option is a ``typing.Literal``: ``DFPOConfig`` annotates its field with it (TRL's argument parser, i.e.
transformers' ``HfArgumentParser``, turns it into argparse ``choices``), the field checks and the math read the
tuple of its values from here, and the help lists them. Values stay plain strings, as users write them in a recipe
or on the command line. ``group_transform`` is open (the transform registry, :mod:`dfpo_trl.transforms`,
owns its names) and ``delta_gamma`` also takes a number, so neither is a Literal.

:data:`LOSS_TYPES` is the one table of TRL's loss types DFPO can rewrite: all of them are the clipped surrogate
-min(r A, clip(r) A); each row says how the loss aggregates a row's tokens (the factor c_i of
docs/source/concepts/cancellation.md, eq. C3) and where DelTA's λ̄ must average 1 (docs/source/concepts/delta.md, step
6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "AGGREGATION_CONSTANT",
    "AGGREGATION_MICRO_BATCH_TOKENS",
    "AGGREGATION_SEQUENCE_MEAN",
    "ASSIGNMENTS",
    "CANCELLATION_TARGETS",
    "CLIPPED_LOSS_TYPES",
    "CONTRASTS",
    "DELTA_LOSS_TYPES",
    "DOMAIN_MICRO_BATCH",
    "DOMAIN_ROLLOUT",
    "DOMAIN_SEQUENCE",
    "ENERGY_FORMS",
    "GAMMA_RULES",
    "GAMMA_UPDATES",
    "GROUP_LAYOUTS",
    "GROUP_LAYOUT_AUTO",
    "GROUP_LAYOUT_PRE_PASS",
    "GROUP_LAYOUT_REDISTRIBUTED",
    "IMPORTANCE_SAMPLING_SUPPORTS",
    "LOSS_TYPES",
    "NO_TRANSFORM",
    "ONE_SIDED_POLICIES",
    "SCOPES",
    "TOKEN_LEVEL_CLIPPED_LOSS_TYPES",
    "TOKEN_WEIGHTINGS",
    "TRANSFORM_GRADIENTS",
    "ZERO_ADVANTAGE_RULES",
    "Assignment",
    "CancellationTarget",
    "Contrast",
    "DeltaScope",
    "EnergyForm",
    "GammaRule",
    "GammaUpdate",
    "GroupLayout",
    "ImportanceSamplingSupport",
    "LossType",
    "OneSidedPolicy",
    "TokenWeighting",
    "TransformGradient",
    "ZeroAdvantageRule",
]

# ---- closed options; the first value of each is the field's default
TransformGradient = Literal["ratio", "score"]  # DFPO eq. 59–62 (ratio) or 16/68/85 (score)
# the paper's balance, or docs/source/concepts/cancellation.md's (eq. C1)
CancellationTarget = Literal["weights", "gradient"]
OneSidedPolicy = Literal["keep", "zero"]  # docs/source/concepts/cancellation.md (C8)
# docs/source/concepts/layouts.md; "auto": the cheapest exact one
GroupLayout = Literal["auto", "redistributed", "pre_pass"]
EnergyForm = Literal["aggregate", "per_position"]  # eq. 24's readings (docs/source/concepts/metrics.md)
TokenWeighting = Literal["none", "delta"]
# DelTA's options (docs/source/concepts/delta.md); the first of each is the authors' released code's behaviour.
GammaRule = Literal["std", "mean_abs"]  # delta_gamma may also be a fixed number > 0
GammaUpdate = Literal["lagged", "current"]
ZeroAdvantageRule = Literal["lambda_min", "one"]
DeltaScope = Literal["global", "process"]  # "global" is ours (all processes); "process" is the released code's
Assignment = Literal["soft", "hard"]
Contrast = Literal["opposite", "within"]
# what TRL's vLLM importance-sampling ratio divides (dfpo_trl/trl_hooks/sampling_support.py): TRL's, or ours
ImportanceSamplingSupport = Literal["full", "truncated"]

TRANSFORM_GRADIENTS: tuple[str, ...] = get_args(TransformGradient)
CANCELLATION_TARGETS: tuple[str, ...] = get_args(CancellationTarget)
ONE_SIDED_POLICIES: tuple[str, ...] = get_args(OneSidedPolicy)
GROUP_LAYOUTS: tuple[str, ...] = get_args(GroupLayout)
#: group_layout's values by name, unpacked from the Literal so that each is spelled once (groups/choice.py reads them)
GROUP_LAYOUT_AUTO, GROUP_LAYOUT_REDISTRIBUTED, GROUP_LAYOUT_PRE_PASS = GROUP_LAYOUTS
ENERGY_FORMS: tuple[str, ...] = get_args(EnergyForm)
TOKEN_WEIGHTINGS: tuple[str, ...] = get_args(TokenWeighting)
GAMMA_RULES: tuple[str, ...] = get_args(GammaRule)
GAMMA_UPDATES: tuple[str, ...] = get_args(GammaUpdate)
ZERO_ADVANTAGE_RULES: tuple[str, ...] = get_args(ZeroAdvantageRule)
SCOPES: tuple[str, ...] = get_args(DeltaScope)
ASSIGNMENTS: tuple[str, ...] = get_args(Assignment)
CONTRASTS: tuple[str, ...] = get_args(Contrast)
IMPORTANCE_SAMPLING_SUPPORTS: tuple[str, ...] = get_args(ImportanceSamplingSupport)

NO_TRANSFORM = "none"  # group_transform's default: GSPO's weights, untransformed

# ---- TRL's clipped-surrogate loss types
AGGREGATION_SEQUENCE_MEAN = "sequence_mean"  # c_i = 1/L_i: the per-sequence token mean (TRL's "grpo")
AGGREGATION_MICRO_BATCH_TOKENS = "micro_batch_tokens"  # divided by the micro-batch's own token count ("bnpo")
AGGREGATION_CONSTANT = "constant"  # a token sum with a normaliser shared by every row of a group
DOMAIN_SEQUENCE = "sequence"  # λ̄ averages 1 per sequence
DOMAIN_MICRO_BATCH = "micro_batch"  # ... over the local micro-batch's tokens (redone at loss time)
DOMAIN_ROLLOUT = "rollout"  # ... over the tokens of the whole (global) rollout batch


@dataclass(frozen=True)
class LossType:
    """One of TRL's clipped-surrogate loss types, as DFPO's objectives read it.

    ``aggregation``: how the loss weights row i's tokens, which gives the factor c_i of eq. C3;
    ``token_level``: one clipped term per token (GRPO-fix and DelTA need it; ``luspo`` is sequence-level);
    ``delta_domain``: where DelTA's λ̄ averages 1 so that the loss keeps its own normaliser (None: DelTA cannot
    weight it)."""

    name: str
    aggregation: str
    token_level: bool
    delta_domain: str | None


LOSS_TYPES: dict[str, LossType] = {
    t.name: t
    for t in (
        LossType("grpo", AGGREGATION_SEQUENCE_MEAN, True, DOMAIN_SEQUENCE),
        LossType("bnpo", AGGREGATION_MICRO_BATCH_TOKENS, True, DOMAIN_MICRO_BATCH),
        # DAPO divides by the token count of the whole generation batch over all processes, Dr. GRPO by a constant.
        LossType("dr_grpo", AGGREGATION_CONSTANT, True, DOMAIN_ROLLOUT),
        LossType("dapo", AGGREGATION_CONSTANT, True, DOMAIN_ROLLOUT),
        # LUSPO's per-row token sum cancels the 1/L_i of its sequence ratio (docs/source/concepts/cancellation.md).
        LossType("luspo", AGGREGATION_CONSTANT, False, None),
    )
}
#: The loss types whose policy term is TRL's clipped surrogate; DFPO rewrites only those.
CLIPPED_LOSS_TYPES: tuple[str, ...] = tuple(LOSS_TYPES)
#: The token-level ones: GRPO-fix's symmetric clip applies to them.
TOKEN_LEVEL_CLIPPED_LOSS_TYPES: tuple[str, ...] = tuple(n for n, t in LOSS_TYPES.items() if t.token_level)
#: The ones DelTA weights, each with a known normalisation domain.
DELTA_LOSS_TYPES: tuple[str, ...] = tuple(n for n, t in LOSS_TYPES.items() if t.delta_domain is not None)

