"""``DFPOConfig``: TRL's ``GRPOConfig`` plus the DFPO fields, each with meaning, default and source."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import TrainingArguments
from trl import GRPOConfig

from .config_checks import read_delta_gamma, validate

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
        self.delta_gamma = read_delta_gamma(self.delta_gamma)
        validate(self)
        super().__post_init__()

    @property
    def sequence_rewrite_active(self) -> bool:
        """Whether the sequence-level loss is rewritten (any transform, the score form, or no stop-gradient)."""
        return (
            self.group_transform != "none"
            or self.transform_gradient == "score"
            or not self.transform_stop_gradient
        )

    @property
    def dfpo_options_active(self) -> bool:
        """Whether any DFPO option changes the loss or needs the loss's policy forward (the trainer refuses to
        go on when TRL's loss did not let DFPO rewrite its inputs)."""
        return bool(self.describe_active_options())

    def describe_active_options(self) -> str:
        """The DFPO options that are on, as they are set (empty when DFPO is off)."""
        parts = [self.describe_sequence_options()] if self.sequence_rewrite_active else []
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

    def describe_sequence_options(self) -> str:
        """The options that rewrite the sequence-level loss, as they are set (for messages)."""
        parts = []
        if self.group_transform != "none":
            parts.append(f"group_transform={self.group_transform!r}")
        if self.transform_gradient == "score":
            parts.append("transform_gradient='score'")
        if not self.transform_stop_gradient:
            parts.append("transform_stop_gradient=False")
        return " with ".join(parts)

    def _resolve_checkpointing_alias(self) -> None:
        """Accept either checkpointing name without transformers' deprecation warning (TRL set the old name by
        default, so every run warned with nothing for the user to change); unset means on, TRL's default."""
        if not HAS_ACTIVATION_CHECKPOINTING:
            return
        if self.activation_checkpointing is None:
            on = self.gradient_checkpointing
            self.activation_checkpointing = True if on is None else bool(on)
        self.gradient_checkpointing = None  # transformers mirrors the new name into it after resolving
