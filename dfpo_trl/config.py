"""``DFPOConfig``: TRL's ``GRPOConfig`` plus the DFPO fields, each with meaning, default and source."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import TrainingArguments
from trl import GRPOConfig

from .delta import GAMMA_RULES, GAMMA_UPDATES, SCOPES, ZERO_ADVANTAGE_RULES
from .objectives.cancellation import BALANCING_TRANSFORMS, CANCELLATION_TARGETS, ONE_SIDED_POLICIES
from .objectives.transforms import GROUP_TRANSFORMS

TRANSFORM_GRADIENTS = ("ratio", "score")
# docs/layouts.md: what group_layout may force ("auto": the cheapest exact layout for the batch sizes).
GROUP_LAYOUTS = ("auto", "redistributed", "pre_pass")
# TRL loss types whose policy term is TRL's clipped surrogate -min(r A, clip(r) A); DFPO rewrites only those.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
TOKEN_WEIGHTINGS = ("none", "delta")
# Token-level clipped loss types DelTA weights, each with a known normalisation domain (delta_trainer).
DELTA_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# transformers >= 5.24 renamed gradient_checkpointing to activation_checkpointing and warns whenever the old name
# is set, which TRL's config does by default (True), so every run warned. Older 5.x releases know only the old name.
HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}


def gradient_checkpointing_metadata(has_activation_checkpointing: bool) -> dict[str, object]:
    """The ``gradient_checkpointing`` field's metadata for TRL's argument parser.

    With a ``None`` default (transformers >= 5.24) ``--gradient_checkpointing`` alone must still mean True, so the
    flag takes an optional value (``nargs``/``const``). With a ``True`` default (older 5.x) the parser adds those
    itself and also a ``--no_gradient_checkpointing`` flag built from this metadata, where ``nargs`` is an error:
    ``dfpo-train`` failed at start-up on transformers 5.17 until this was split."""
    help_text = (
        "Activation checkpointing (trades compute for memory); default on, as in TRL. Same as "
        "activation_checkpointing on transformers >= 5.24; this name also works on older 5.x releases."
    )
    if has_activation_checkpointing:
        return {"help": help_text, "nargs": "?", "const": True}
    return {"help": help_text}


@dataclass
class DFPOConfig(GRPOConfig):
    r"""
    Configuration for [`DFPOTrainer`]: every field of `trl.GRPOConfig`, plus the DFPO fields below.

    DFPO ("Design Conditions for Intra-Group Learning of Sequence-Level Rewards: Token Gradient
    Cancellation", arXiv 2604.13088) keeps token updates exchangeable inside a group so that shared,
    reward-irrelevant tokens cancel. Equation numbers refer to that paper; `docs/design.md` describes what we implement.

    Parameters:
        group_transform (`str`, *optional*, defaults to `"none"`):
            In-group transform of the sign-aware post-clip sequence weights s̄ (eq. 47), applied under
            stop-gradient. One of `"none"` (GSPO, eq. 49), `"min_replace"` (eq. 50), `"orth_proj"` (eq. 18),
            `"positive_orth_proj"` (exact QP of eq. 51), `"truncate_rebalance"` (eq. 52–55, β sign fixed, see
            docs/design.md), `"scale"` (Table 3 ablation). Needs `importance_sampling_level="sequence"`. Acts
            only off-policy (`steps_per_generation > gradient_accumulation_steps` or `num_iterations > 1`, or
            vLLM importance sampling): on-policy every s̄ is 1 and every transform is the identity.
        transform_scale (`float`, *optional*, defaults to `0.5`):
            κ of the `"scale"` ablation, s̃ = κ s̄ (Table 3 uses 0.5).
        transform_truncate_floor (`float`, *optional*, defaults to `1e-6`):
            ϵ of eq. 52, s⁺ = max(s̄, ϵ); the paper gives no value. s̄ is positive by construction, so the floor
            only guards against underflow of extreme negative log-ratios.
        transform_gradient (`str`, *optional*, defaults to `"ratio"`):
            `"ratio"`: J_i = Â_i φ_i s̄_i(θ), φ = s̃/s̄ under stop-gradient (eq. 59–62, 87–88); `"none"` is then
            TRL's GSPO exactly and clipped sequences keep GSPO's zero gradient. `"score"`: J_i = Â_i sg(s̃_i) ρ_i(θ)
            (eq. 16/68/85 read literally), every sequence gets the gradient Â_i s̃_i ∇ρ_i, clipped or not
            (docs/design.md). Compare a transform with `"none"` in the same form.
        transform_stop_gradient (`bool`, *optional*, defaults to `True`):
            `False` is the paper's "no stop-grad" ablation (Table 3): the transform is differentiated, J_i =
            Â_i s̃_i(θ). With `"min_replace"` and zero-mean advantages this makes the policy gradient exactly
            zero under per-sequence aggregation (`loss_type="grpo"`). Ratio form only.
        cancellation_target (`str`, *optional*, defaults to `"weights"`):
            What the transform balances (docs/cancellation.md). `"weights"`: Σ_i Â_i s̃_i = 0 over the whole group,
            the paper's transforms exactly. `"gradient"`: Σ_i a_i s̃_i = 0 with a_i = Â_i c_i 1[i ∈ U], U the members
            whose gradient survives the sign-aware clip (eq. 44–47) and c_i the loss aggregation's per-member factor
            (1/L_i for `loss_type="grpo"`, 1/N for `"bnpo"`, 1 for `"dapo"`, `"dr_grpo"`, `"luspo"`), so the
            gradients that survive cancel exactly on shared tokens whenever U holds both advantage signs (eq. C1).
            Members outside U keep φ = 1; Min-Replace becomes its minimal-change balanced form (eq. C4–C7). Needs
            a balancing `group_transform` (`min_replace`, `orth_proj`, `positive_orth_proj`,
            `truncate_rebalance`). O(batch) scalar work, no extra pass; equal to `"weights"` when nothing is
            clipped and c is constant. Beyond the paper.
        cancellation_one_sided (`str`, *optional*, defaults to `"keep"`):
            With `cancellation_target="gradient"`, a group with non-zero advantages whose surviving members share
            one sign (or none survive) has no exact non-zero balance with one weight per sequence. `"keep"`: such
            a group gets the `"weights"` result; `"zero"`: s̃ = 0 for its members (exact cancellation, at the
            price of the group's update this step). The fraction of such groups is logged as
            `cancellation/one_sided_groups`.
        symmetric_clip (`bool`, *optional*, defaults to `False`):
            GRPO-fix (Appendix H, eq. 79–80): per-token objective Â_i clip(r_{i,t}, 0, 1 + ε_high), the same
            operator whatever the sign of Â_i, aggregated by TRL's `loss_type`. Token-level only
            (`importance_sampling_level="token"`); `epsilon` (ε_low) is not used.
        group_granular_batches (`bool` or `None`, *optional*, defaults to `None`):
            Whether TRL's per-sample shuffle of each rollout is replaced by a shuffle of whole groups, so that every
            micro-batch holds whole groups (layout 1 of docs/layouts.md; needs `per_device_train_batch_size` a
            multiple of `num_generations`). `None` (automatic): only when a DFPO option needs whole groups (a
            `group_transform`, the score form, `transform_stop_gradient=False`) and the batch sizes allow it;
            with every DFPO option off the run is then TRL's own, bit for bit (same micro-batch order, same RNG
            stream). `True`: always, e.g. to log the group mechanism metrics of a baseline (GSPO through
            `DFPOTrainer`) on every micro-batch; this changes the micro-batch order against `GRPOTrainer`'s.
            `False`: never; transforms then use the cross-process, redistributed or pre-pass layouts, and
            `transform_stop_gradient=False` (which needs whole groups) is refused. The group shuffle draws from
            DFPO's own generator, seeded per rollout from (`seed`, process, optimizer step), never from
            torch's global RNG. Source: issue #11 (a drop-in for `GRPOTrainer`).
        group_layout (`str`, *optional*, defaults to `"auto"`):
            How a transform gets every member's post-clip weight when a micro-batch does not hold whole groups
            (docs/layouts.md). `"auto"`: the cheapest exact layout for the batch sizes, i.e. `"redistributed"`
            when `per_device_train_batch_size × num_processes` is a multiple of `num_generations`, with several
            processes and `steps_per_generation > 1`, else `"pre_pass"` (or the cross-process gather when
            `steps_per_generation` is 1). `"redistributed"`: each rollout is moved once between processes (one
            all-to-all of the rollout tensors) so that every micro-step holds whole groups across processes; the
            coefficients then cost one all-gather of a few floats a row and no extra forward. `"pre_pass"`: one
            extra no-grad forward over the step's groups at every off-policy optimizer step. Forcing a layout the
            batch sizes cannot make exact is refused at start-up. Not used when micro-batches hold whole groups
            (group-granular) or no DFPO option is on. Source: issue #12 (the paper's layout at full speed).
        prepass_batch_size (`int` or `None`, *optional*, defaults to `None`):
            Rows per forward chunk of the pre-pass (no gradient, so no activations kept for a backward).
            `None`: 4 × `per_device_train_batch_size`. Under ZeRO-3 every chunk gathers the partitioned weights
            again, so fewer, larger chunks cost less; lower it if the pre-pass runs out of memory. Source: issue #12.
        log_mechanism_metrics (`bool`, *optional*, defaults to `True`):
            Log `asym/before`, `asym/after` (eq. 23), `transform/orth_residual`, `transform/phi_min|mean` and
            `cancellation/shared_prefix_residual` (docs/metrics.md) every step. O(batch) scalar work. The group
            metrics need whole groups in a micro-batch: without group-granular batches (see
            `group_granular_batches`) they are computed only on micro-batches that happen to hold whole groups
            and are skipped on the others.
        log_energy_buckets (`int`, *optional*, defaults to `0`):
            Gradient energy on frequent tokens (eq. 24, docs/metrics.md). `0`: off, at no cost. k >= 2: every training
            micro-batch logs `energy/freq_bucket_0` ... `energy/freq_bucket_{k-1}`, the share Σ_{t∈B_b} ‖∇_W ℓ_t‖ /
            Σ_t ‖∇_W ℓ_t‖ of each frequency bucket, averaged over the logging interval like the other metrics.
            ‖∇_W ℓ_t‖ is the exact per-token gradient norm of the LM-head weight W (a stand-in for all of θ):
            |c_t| · ‖h_t‖ · ‖e_y − p_t‖ / τ, with c_t = ∂loss/∂log p_t read by a backward hook (policy and KL
            terms; not the entropy bonus), h_t the backbone output, p_t at TRL's `temperature` τ (and the model's
            logit scale / softcapping, as TRL's fused head applies them). Buckets: the distinct ids of the
            micro-batch's loss tokens (`completion_mask` × `tool_mask`) ranked by their count in that micro-batch
            (ties by smaller id), their occurrences cut into k slices of equal mass, each id in the bucket of its
            first occurrence (never split), so bucket 0 holds the most frequent ids and each bucket about 1/k of
            the tokens: a share above 1/k means more than that bucket's share of the gradient. Costs, per
            micro-step, a copy of h (B × T × d) and one no-grad float32 pass of h over the LM head; loss and
            gradients are unchanged. `1` is refused (a single bucket's share is always 1).
        token_weighting (`str`, *optional*, defaults to `"none"`):
            `"delta"`: DelTA token weights (docs/delta.md): per rollout batch, with the
            rollout-time model, λ_{i,t} from the LM-head-row proxy (1 − p) h (statistics over all processes, or
            per process with `delta_scope="process"`), self-normalised over the loss's normalisation domain (per
            sequence for `loss_type="grpo"`, per micro-batch for `"bnpo"`, over the rollout batch for
            `"dapo"`/`"dr_grpo"`), held fixed across `num_iterations` and applied as stop-gradient per-token
            multipliers on TRL's clipped surrogate (not on the KL term). The defaults of the `delta_*` rules are the
            authors' released code; each earlier rule of ours is one option away (docs/delta.md). Costs no extra
            forward when TRL computes old log-probs (off-policy), one otherwise.
            Token-level only: with `importance_sampling_level="sequence"` a per-token multiplier on the broadcast
            sequence-level loss only rescales each sequence, so it is refused. Works with `symmetric_clip`.
        delta_lambda_min (`float`, *optional*, defaults to `0.8`):
            λ_min of λ = λ_min + (λ_max − λ_min) α (the paper's [0.8, 1.2]); must be > 0.
        delta_lambda_max (`float`, *optional*, defaults to `1.2`):
            λ_max; must be >= `delta_lambda_min`.
        delta_refine_steps (`int`, *optional*, defaults to `1`):
            K, the number of centroid refinements (the paper and its released recipe use 1; 0 is the
            "w/o refinement" ablation).
        delta_gamma (`str` or `float`, *optional*, defaults to `"std"`):
            γ_side of α = σ(margin / γ_side); the paper calls it adaptive without defining it (docs/delta.md).
            `"std"`: the population standard deviation of the side's margins over its tokens, variance floored
            at 1e-8 (the authors' released code). `"mean_abs"`: the mean |margin| of the side (our earlier rule).
            A number fixes γ for both sides (the "w/o adaptive γ" ablation); a numeric string (command line) is
            read as a number. `None` (the earlier spelling of the adaptive γ) is refused with the two names.
        delta_gamma_update (`str`, *optional*, defaults to `"lagged"`):
            Which margins γ comes from during refinement. `"lagged"` (released code): refinement step k scores with
            μ^(k) and γ^(k) and takes γ^(k+1) from the margins at μ^(k), before the update, so with K = 1 the final
            scores use the refined centroids with the initial γ. `"current"` (our earlier rule): γ^(k) from the
            margins at μ^(k).
        delta_zero_advantage (`str`, *optional*, defaults to `"lambda_min"`):
            Tokens outside the between-side contrast. `"lambda_min"` (released code): tokens of Â = 0 completions
            get λ = λ_min and count in the normaliser N/Z; a batch with one side empty goes on with the zero
            centroid for that side. `"one"` (our earlier rule): those tokens get λ = 1, and a batch with one side
            empty gets λ = 1 everywhere.
        delta_scope (`str`, *optional*, defaults to `"global"`):
            Where the centroids, γ and N/Z are computed. `"global"`: over every process's rollout (all-reduced), the
            same weights at any world size. `"process"`: on each data-parallel process's shard alone, as the
            released code computes them. No effect on one process.
        delta_assignment (`str`, *optional*, defaults to `"soft"`):
            `"soft"`: α = σ(margin / γ); `"hard"`: α = 1[margin > 0] (the "w/o h(α)" ablation).
        delta_contrast (`str`, *optional*, defaults to `"opposite"`):
            `"opposite"`: margin against the opposite side's centroid (eq. DelTA-alpha); `"within"`: own-side
            centrality only (the "within-side only" ablation).
        delta_random (`bool`, *optional*, defaults to `False`):
            The "random λ" control: λ ~ U[λ_min, λ_max] on the same tokens, seeded from `seed`.
    """

    # TRL's default (on), kept; None here so that only an explicit setting reaches transformers' deprecated alias.
    gradient_checkpointing: bool | None = field(
        default=None if HAS_ACTIVATION_CHECKPOINTING else True,
        metadata=gradient_checkpointing_metadata(HAS_ACTIVATION_CHECKPOINTING),
    )
    group_transform: str = field(
        default="none",
        metadata={
            "help": "In-group transform of the post-clip sequence weights (DFPO, stop-gradient): 'none' (GSPO), "
            "'min_replace' (eq. 50), 'orth_proj' (eq. 18), 'positive_orth_proj' (eq. 51, exact QP), "
            "'truncate_rebalance' (eq. 52-55), 'scale' (ablation). Needs importance_sampling_level='sequence'; "
            "acts only off-policy (steps_per_generation > gradient_accumulation_steps or num_iterations > 1)."
        },
    )
    transform_scale: float = field(
        default=0.5, metadata={"help": "Factor of the 'scale' ablation: s~ = factor * s_bar (Table 3 uses 0.5)."}
    )
    transform_truncate_floor: float = field(
        default=1e-6, metadata={"help": "Floor eps of 'truncate_rebalance' (eq. 52): s+ = max(s_bar, eps)."}
    )
    transform_gradient: str = field(
        default="ratio",
        metadata={
            "help": "'ratio': J = A * phi * s_bar(theta), phi = s~/s_bar stop-gradient, 'none' equals TRL's GSPO; "
            "'score': J = A * sg(s~) * rho(theta), clipped sequences keep their gradient (docs/design.md)."
        },
    )
    transform_stop_gradient: bool = field(
        default=True,
        metadata={"help": "False = the paper's 'no stop-grad' ablation (the transform is differentiated)."},
    )
    cancellation_target: str = field(
        default="weights",
        metadata={
            "help": "'weights': the transform balances sum_i A_i s~_i = 0 (the paper). 'gradient': it balances the "
            "gradients that survive the clip, sum_i A_i c_i 1[i in U] s~_i = 0 (c_i = 1/L_i for loss_type='grpo'), "
            "so shared tokens cancel exactly in two-sided groups (docs/cancellation.md)."
        },
    )
    cancellation_one_sided: str = field(
        default="keep",
        metadata={
            "help": "With cancellation_target='gradient': groups whose surviving members share one sign keep the "
            "'weights' result ('keep') or get s~ = 0 ('zero': exact cancellation, no update from that group)."
        },
    )
    symmetric_clip: bool = field(
        default=False,
        metadata={
            "help": "GRPO-fix (Appendix H): per-token weight clip(r, 0, 1 + epsilon_high) for both advantage "
            "signs; token-level importance sampling only."
        },
    )
    group_granular_batches: bool | None = field(
        default=None,
        metadata={
            "help": "Shuffle whole groups instead of TRL's per-sample shuffle, so every micro-batch holds whole "
            "groups. None = automatic (only when a DFPO transform needs it; DFPO off = TRL's run bit for bit); "
            "True = always (e.g. mechanism metrics of a GSPO baseline; changes the micro-batch order vs TRL); "
            "False = never (transforms use the cross-process, redistributed or pre-pass layouts)."
        },
    )
    group_layout: str = field(
        default="auto",
        metadata={
            "help": "Layout when micro-batches do not hold whole groups: 'auto' (cheapest exact one), "
            "'redistributed' (one all-to-all per rollout so every micro-step holds whole groups across "
            "processes; needs per_device_train_batch_size x num_processes a multiple of num_generations) or "
            "'pre_pass' (an extra no-grad forward at every off-policy optimizer step)."
        },
    )
    prepass_batch_size: int | None = field(
        default=None,
        metadata={"help": "Rows per no-grad forward chunk of the pre-pass; None = 4 x per_device_train_batch_size."},
    )
    log_mechanism_metrics: bool = field(
        default=True,
        metadata={"help": "Log asym/*, transform/*, cancellation/shared_prefix_residual every step."},
    )
    log_energy_buckets: int = field(
        default=0,
        metadata={
            "help": "Gradient energy on frequent tokens (eq. 24): 0 = off; k >= 2 logs energy/freq_bucket_0..k-1, "
            "each frequency bucket's share of the exact per-token LM-head gradient norm (bucket 0 = most frequent "
            "ids of the micro-batch). Costs one no-grad pass over the LM head per micro-step."
        },
    )
    token_weighting: str = field(
        default="none",
        metadata={
            "help": "'delta': DelTA token weights (docs/delta.md): lambda from the (1 - p) h proxy once per "
            "rollout batch, self-normalised over the loss's normalisation domain, fixed across num_iterations, "
            "stop-gradient per-token multipliers on the clipped surrogate. Token-level only. 'none': off."
        },
    )
    delta_lambda_min: float = field(
        default=0.8, metadata={"help": "DelTA lambda_min of lambda = min + (max - min) * alpha; must be > 0."}
    )
    delta_lambda_max: float = field(
        default=1.2, metadata={"help": "DelTA lambda_max; must be >= delta_lambda_min."}
    )
    delta_refine_steps: int = field(
        default=1, metadata={"help": "DelTA centroid refinement steps K (paper: 1; 0 = 'w/o refinement')."}
    )
    # A str field so that the command line accepts the names; a number (or a numeric string) is a fixed gamma.
    delta_gamma: str = field(
        default="std",
        metadata={
            "help": "DelTA gamma per side: 'std' (std of the side's margins, variance floored at 1e-8; the authors' "
            "released code), 'mean_abs' (mean |margin|; our earlier rule) or a number (fixed gamma, ablation)."
        },
    )
    delta_gamma_update: str = field(
        default="lagged",
        metadata={
            "help": "DelTA gamma during refinement: 'lagged' (from the margins before each centroid update; released "
            "code) or 'current' (from the margins at the current centroids; our earlier rule)."
        },
    )
    delta_zero_advantage: str = field(
        default="lambda_min",
        metadata={
            "help": "DelTA tokens outside the contrast: 'lambda_min' (zero-advantage tokens get lambda_min, an empty "
            "side has the zero centroid; released code) or 'one' (lambda = 1; our earlier rule)."
        },
    )
    delta_scope: str = field(
        default="global",
        metadata={
            "help": "DelTA statistics: 'global' (over all processes) or 'process' (each process's shard alone, as "
            "the released code)."
        },
    )
    delta_assignment: str = field(
        default="soft", metadata={"help": "DelTA alpha: 'soft' = sigmoid(margin / gamma); 'hard' = 1[margin > 0]."}
    )
    delta_contrast: str = field(
        default="opposite",
        metadata={"help": "DelTA margin: 'opposite' (eq. DelTA-alpha) or 'within' (own side only, ablation)."},
    )
    delta_random: bool = field(
        default=False, metadata={"help": "DelTA 'random lambda' control: lambda ~ U[lambda_min, lambda_max]."}
    )

    def __post_init__(self) -> None:
        self._resolve_checkpointing_alias()
        self._validate_dfpo_fields()
        super().__post_init__()

    @property
    def sequence_rewrite_active(self) -> bool:
        """Whether the sequence-level loss is rewritten (any transform, the score form, or no stop-gradient)."""
        return (
            self.group_transform != "none"
            or self.transform_gradient == "score"
            or not self.transform_stop_gradient
        )

    def _validate_dfpo_fields(self) -> None:
        """Refuse bad values and conflicting TRL settings with a message naming the fields and the fix."""
        if self.group_transform not in GROUP_TRANSFORMS:
            raise ValueError(
                f"group_transform={self.group_transform!r} is not a DFPO transform; use one of "
                f"{', '.join(repr(n) for n in GROUP_TRANSFORMS)}."
            )
        if self.transform_gradient not in TRANSFORM_GRADIENTS:
            raise ValueError(
                f"transform_gradient={self.transform_gradient!r} is not valid; use 'ratio' or 'score'."
            )
        if self.num_generations is not None and self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: a group needs at least 2 completions per prompt for "
                "group-relative advantages and in-group transforms; set num_generations >= 2."
            )
        self._validate_cancellation_fields()
        if self.group_granular_batches not in (None, True, False):
            raise ValueError(
                f"group_granular_batches={self.group_granular_batches!r} is not valid; use None (automatic), True "
                "or False."
            )
        if self.group_granular_batches is False and not self.transform_stop_gradient:
            raise ValueError(
                "transform_stop_gradient=False differentiates the transform through every member's s̄, so whole "
                "groups must be in one micro-batch, but group_granular_batches=False. Set "
                "group_granular_batches=None (automatic) or True."
            )
        if self.group_layout not in GROUP_LAYOUTS:
            raise ValueError(
                f"group_layout={self.group_layout!r} is not valid; use one of "
                f"{', '.join(repr(n) for n in GROUP_LAYOUTS)}."
            )
        if self.prepass_batch_size is not None and (
            isinstance(self.prepass_batch_size, bool) or not isinstance(self.prepass_batch_size, int)
            or self.prepass_batch_size < 1
        ):
            raise ValueError(
                f"prepass_batch_size={self.prepass_batch_size!r} must be a positive integer (rows per no-grad "
                "forward chunk of the pre-pass), or None for 4 x per_device_train_batch_size."
            )
        if self.transform_scale <= 0:
            raise ValueError(f"transform_scale must be > 0, got {self.transform_scale}.")
        if self.transform_truncate_floor <= 0:
            raise ValueError(f"transform_truncate_floor must be > 0, got {self.transform_truncate_floor}.")
        buckets = self.log_energy_buckets
        if not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 0 or buckets == 1:
            raise ValueError(
                f"log_energy_buckets={self.log_energy_buckets!r} is not valid: use 0 to turn the gradient-energy "
                "metric (eq. 24) off, or the number of frequency buckets k >= 2 (e.g. 3) to log "
                "energy/freq_bucket_0..k-1 (a single bucket's share is always 1)."
            )
        if self.sequence_rewrite_active:
            what = self._describe_sequence_options()
            if self.importance_sampling_level != "sequence":
                raise ValueError(
                    f"{what} acts on sequence weights and needs importance_sampling_level='sequence' (GSPO), but "
                    f"importance_sampling_level={self.importance_sampling_level!r}. Set "
                    "importance_sampling_level='sequence', or use symmetric_clip=True for the token-level fix."
                )
            self._require_clipped_loss_type(what)
            if not self.transform_stop_gradient and self.transform_gradient == "score":
                raise ValueError(
                    "transform_stop_gradient=False is the ablation of the ratio form; it does not apply to "
                    "transform_gradient='score' (whose weight is sg(s~) by definition). Use "
                    "transform_gradient='ratio'."
                )
        if self.symmetric_clip:
            if self.importance_sampling_level != "token":
                raise ValueError(
                    "symmetric_clip=True (GRPO-fix, Appendix H) is a token-level objective, but "
                    f"importance_sampling_level={self.importance_sampling_level!r}. Set "
                    "importance_sampling_level='token', or use group_transform for sequence-level DFPO."
                )
            if self.sequence_rewrite_active:
                raise ValueError(
                    "symmetric_clip=True cannot be combined with group_transform/transform_gradient/"
                    "transform_stop_gradient options, which are sequence-level; choose one of the two."
                )
            self._require_clipped_loss_type("symmetric_clip=True")
            if self.loss_type == "luspo":
                raise ValueError(
                    "symmetric_clip=True cannot be combined with loss_type='luspo' (a sequence-level loss); use "
                    "loss_type 'dapo', 'grpo', 'bnpo' or 'dr_grpo'."
                )
        # Orth-Proj under the gradient target hands TRL the score representation for rows whose weight flips sign.
        flips_to_score = self.cancellation_target == "gradient" and self.group_transform == "orth_proj"
        rewrites_old_logps = self.symmetric_clip or self.transform_gradient == "score" or flips_to_score
        if rewrites_old_logps:
            what = (
                "symmetric_clip=True" if self.symmetric_clip
                else "transform_gradient='score'" if self.transform_gradient == "score"
                else "group_transform='orth_proj' with cancellation_target='gradient'"
            )
            if self.use_bias_correction_kl and self.beta != 0.0:
                raise ValueError(
                    f"{what} cannot be combined with beta != 0 and use_bias_correction_kl=True: the KL term "
                    "would be weighted by the rewritten importance ratio. Set use_bias_correction_kl=False."
                )
            if self.off_policy_mask_threshold is not None:
                raise ValueError(
                    f"{what} cannot be combined with off_policy_mask_threshold: the off-policy mask would read "
                    "the rewritten old log-probabilities. Set off_policy_mask_threshold=None."
                )
        self._validate_delta_fields()
        self._validate_ranges()

    def _validate_cancellation_fields(self) -> None:
        """cancellation_target / cancellation_one_sided (docs/cancellation.md): valid values and combinations."""
        if self.cancellation_target not in CANCELLATION_TARGETS:
            raise ValueError(
                f"cancellation_target={self.cancellation_target!r} is not valid; use 'weights' (the paper) or "
                "'gradient' (balance the gradients that survive the clip)."
            )
        if self.cancellation_one_sided not in ONE_SIDED_POLICIES:
            raise ValueError(
                f"cancellation_one_sided={self.cancellation_one_sided!r} is not valid; use 'keep' or 'zero'."
            )
        if self.cancellation_target == "weights":
            if self.cancellation_one_sided != "keep":
                raise ValueError(
                    f"cancellation_one_sided={self.cancellation_one_sided!r} applies only with "
                    "cancellation_target='gradient' (with 'weights' no group is one-sided); set "
                    "cancellation_target='gradient' or leave cancellation_one_sided='keep'."
                )
            return
        if self.group_transform not in BALANCING_TRANSFORMS:
            raise ValueError(
                f"cancellation_target='gradient' retargets a transform's balance condition, but group_transform="
                f"{self.group_transform!r} has none. Set group_transform to one of "
                f"{', '.join(repr(n) for n in BALANCING_TRANSFORMS)}."
            )
        if not self.transform_stop_gradient:
            raise ValueError(
                "cancellation_target='gradient' balances stop-gradient weights; transform_stop_gradient=False "
                "differentiates the transform, whose gradient is then not a_i s~_i. Set transform_stop_gradient=True "
                "or cancellation_target='weights'."
            )
        if self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"cancellation_target='gradient' cannot be combined with top_entropy_quantile="
                f"{self.top_entropy_quantile}: TRL's entropy mask is chosen per micro-batch after the weights are "
                "fixed, so it changes which tokens carry gradient. Set top_entropy_quantile=1.0 or "
                "cancellation_target='weights'."
            )

    @property
    def dfpo_options_active(self) -> bool:
        """Whether any DFPO option changes the loss or needs the loss's policy forward (the trainer refuses to
        go on when TRL's loss did not let DFPO rewrite its inputs)."""
        return bool(self.describe_active_options())

    def describe_active_options(self) -> str:
        """The DFPO options that are on, as they are set (empty when DFPO is off)."""
        parts = [self._describe_sequence_options()] if self.sequence_rewrite_active else []
        if self.symmetric_clip:
            parts.append("symmetric_clip=True")
        if self.token_weighting != "none":
            parts.append(f"token_weighting={self.token_weighting!r}")
        if self.log_energy_buckets:
            parts.append(f"log_energy_buckets={self.log_energy_buckets}")
        return ", ".join(parts)

    @property
    def wants_group_granular_batches(self) -> bool:
        """Whether the group shuffle should run when the batch sizes allow it: forced on, or automatic with a
        DFPO option that reads whole groups (a transform, the score form, no stop-gradient)."""
        if self.group_granular_batches is None:
            return self.sequence_rewrite_active
        return bool(self.group_granular_batches)

    def _describe_sequence_options(self) -> str:
        parts = []
        if self.group_transform != "none":
            parts.append(f"group_transform={self.group_transform!r}")
        if self.transform_gradient == "score":
            parts.append("transform_gradient='score'")
        if not self.transform_stop_gradient:
            parts.append("transform_stop_gradient=False")
        return " with ".join(parts)

    def _require_clipped_loss_type(self, what: str) -> None:
        if self.loss_type not in CLIPPED_LOSS_TYPES:
            raise ValueError(
                f"{what} rewrites TRL's clipped surrogate, which loss_type={self.loss_type!r} does not use. Set "
                f"loss_type to one of {', '.join(repr(t) for t in CLIPPED_LOSS_TYPES)}."
            )

    def _validate_delta_fields(self) -> None:
        """DelTA (docs/delta.md): valid options, token-level clipped loss types only."""
        if self.token_weighting not in TOKEN_WEIGHTINGS:
            raise ValueError(
                f"token_weighting={self.token_weighting!r} is not valid; use 'none' or 'delta' (DelTA)."
            )
        # The numeric fields (delta_lambda_min/max, delta_refine_steps, delta_gamma) are checked in _validate_ranges.
        for name, allowed in (
            ("delta_gamma_update", GAMMA_UPDATES),
            ("delta_zero_advantage", ZERO_ADVANTAGE_RULES),
            ("delta_scope", SCOPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not valid; use {' or '.join(repr(a) for a in allowed)}."
                )
        if self.delta_assignment not in ("soft", "hard"):
            raise ValueError(f"delta_assignment={self.delta_assignment!r} is not valid; use 'soft' or 'hard'.")
        if self.delta_contrast not in ("opposite", "within"):
            raise ValueError(f"delta_contrast={self.delta_contrast!r} is not valid; use 'opposite' or 'within'.")
        if self.token_weighting != "delta":
            changed = [
                f.name for f in fields(self) if f.name.startswith("delta_") and getattr(self, f.name) != f.default
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)}: DelTA options have no effect unless token_weighting='delta', but "
                    f"token_weighting={self.token_weighting!r}. Set token_weighting='delta' or leave them at their "
                    "defaults."
                )
            return
        if self.importance_sampling_level != "token":
            raise ValueError(
                "token_weighting='delta' weights tokens, but importance_sampling_level="
                f"{self.importance_sampling_level!r}: TRL's sequence-level loss is one term per sequence broadcast "
                "over its tokens, so a per-token multiplier would only rescale each sequence by its mean weight. "
                "Set importance_sampling_level='token'."
            )
        if self.loss_type not in DELTA_LOSS_TYPES:
            raise ValueError(
                f"token_weighting='delta' multiplies TRL's per-token clipped surrogate and keeps the normaliser of "
                f"loss_type, but loss_type={self.loss_type!r} is not a token-level clipped loss. Set loss_type to "
                f"one of {', '.join(repr(t) for t in DELTA_LOSS_TYPES)}."
            )

    def _validate_ranges(self) -> None:
        """Refuse out-of-range numbers of every field DFPO relies on, at start-up, naming the field and the fix.

        TRL and transformers accept most of these silently (a negative clip range, a zero temperature, a
        negative learning rate) and fail, if at all, minutes later inside a rollout or the loss.
        """
        problems: list[str] = []

        def require(name: str, ok: bool, rule: str, fix: str) -> None:
            if not ok:
                problems.append(f"{name}={getattr(self, name)!r} {rule}; {fix}")

        def finite(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        require(
            "epsilon", finite(self.epsilon) and 0 < self.epsilon <= 1,
            "is out of range: the clip range [1 - epsilon, 1 + epsilon_high] needs 0 < epsilon <= 1",
            "GSPO and DFPO use 3e-4, token-level GRPO 0.2",
        )
        if self.epsilon_high is not None:
            require(
                "epsilon_high", finite(self.epsilon_high) and self.epsilon_high > 0,
                "is out of range: the upper clip bound 1 + epsilon_high needs epsilon_high > 0",
                "GSPO and DFPO use 4e-4, DAPO 0.28, or leave it unset (= epsilon)",
            )
        if self.delta is not None:
            require(
                "delta", finite(self.delta) and self.delta > 1,
                "is out of range: the two-sided clip bound on the ratio must exceed 1 (at 1 or below it clips "
                "on-policy tokens)", "TRL recommends more than 1 + epsilon_high, or leave it unset (None)",
            )
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations"):
            value = getattr(self, name)
            require(name, isinstance(value, int) and value >= 1, "must be an integer >= 1", f"set {name} >= 1")
        if self.steps_per_generation is not None:
            require(
                "steps_per_generation", isinstance(self.steps_per_generation, int) and self.steps_per_generation >= 1,
                "must be an integer >= 1", "set it >= 1, or leave it unset (= gradient_accumulation_steps)",
            )
        if self.max_completion_length is not None:
            require(
                "max_completion_length",
                isinstance(self.max_completion_length, int) and self.max_completion_length >= 1,
                "must be an integer >= 1 (tokens per completion)", "e.g. 16 for the arithmetic task",
            )
        require(
            "temperature", finite(self.temperature) and self.temperature > 0,
            "must be > 0 (sampling divides the logits by it; the log-probs use it too)", "use 1.0 or e.g. 0.6",
        )
        require("top_p", finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]", "use 1.0 to keep all tokens")
        require("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be >= 0", "use 0 to disable top-k")
        require("beta", finite(self.beta) and self.beta >= 0, "must be >= 0 (KL coefficient)", "use 0.0 for no KL")
        require(
            "learning_rate", finite(self.learning_rate) and self.learning_rate > 0,
            "must be > 0", "e.g. 5e-5 for the CPU main job, 1e-6 for large models",
        )
        require(
            "transform_scale", finite(self.transform_scale) and self.transform_scale > 0,
            "must be a finite number > 0 (the factor of the 'scale' ablation)", "the paper uses 0.5",
        )
        require(
            "transform_truncate_floor", finite(self.transform_truncate_floor) and 0 < self.transform_truncate_floor < 1,
            "must be in (0, 1) (a floor far below the weights, which are near 1)", "the default is 1e-6",
        )
        for name in ("delta_lambda_min", "delta_lambda_max"):
            require(name, finite(getattr(self, name)), "must be a finite number", "the paper uses 0.8 and 1.2")
        if finite(self.delta_lambda_min) and finite(self.delta_lambda_max):
            require(
                "delta_lambda_min", 0 < self.delta_lambda_min <= self.delta_lambda_max,
                f"with delta_lambda_max={self.delta_lambda_max!r} must satisfy 0 < delta_lambda_min <= "
                "delta_lambda_max (the weights multiply advantages and must stay positive)",
                "the paper uses 0.8 and 1.2",
            )
        self._read_delta_gamma()
        if self.delta_gamma is None:
            require(
                "delta_gamma", False, "is no longer accepted (it meant the adaptive mean-|margin| gamma)",
                "use 'std' (the authors' released code, the default) or 'mean_abs' (the former rule)",
            )
        elif not (self.delta_gamma in GAMMA_RULES or finite(self.delta_gamma) and self.delta_gamma > 0):
            require(
                "delta_gamma", False,
                "is not valid: it must be 'std', 'mean_abs' or a finite number > 0 (a fixed gamma)",
                "the default 'std' is the authors' released code",
            )
        require(
            "delta_refine_steps",
            isinstance(self.delta_refine_steps, int) and not isinstance(self.delta_refine_steps, bool)
            and self.delta_refine_steps >= 0,
            "must be an integer >= 0", "the paper uses 1",
        )
        if problems:
            raise ValueError("out-of-range value(s): " + " | ".join(problems) + ".")

    def _read_delta_gamma(self) -> None:
        """A fixed delta_gamma given as a numeric string (the command line) or an int becomes a float."""
        gamma = self.delta_gamma
        if isinstance(gamma, str) and gamma not in GAMMA_RULES:
            try:
                self.delta_gamma = float(gamma)
            except ValueError:
                pass
        elif isinstance(gamma, int) and not isinstance(gamma, bool):
            self.delta_gamma = float(gamma)

    def _resolve_checkpointing_alias(self) -> None:
        """Accept either checkpointing name without transformers' deprecation warning (TRL set the old name by
        default, so every run warned with nothing for the user to change); unset means on, TRL's default."""
        if not HAS_ACTIVATION_CHECKPOINTING:
            return
        if self.activation_checkpointing is None:
            on = self.gradient_checkpointing
            self.activation_checkpointing = True if on is None else bool(on)
        self.gradient_checkpointing = None  # transformers mirrors the new name into it after resolving
