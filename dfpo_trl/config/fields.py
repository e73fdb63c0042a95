"""``DFPOConfig``: TRL's ``GRPOConfig`` plus the DFPO fields, each documented once, in its ``metadata["help"]``.

A DFPO field's help is its one documentation: what it means, then ``Source:`` (a DFPO paper equation, DelTA, or
the docs/ page); its default is the field's own. The class docstring is generated from them below, the reference
page docs/source/reference/config.md by ``python -m dfpo_trl.config.docs``; the rules a value must meet live in
:mod:`.checks` (each field) and :mod:`.combinations` (between fields).
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import Field, dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, get_args, get_origin, get_type_hints

from transformers import TrainingArguments
from trl import GRPOConfig

from ..transforms import GROUP_TRANSFORMS, TRANSFORMS
from ..transforms.builtins import SCALE_FACTOR_DEFAULT, TRUNCATE_FLOOR_DEFAULT
from .checks import check_fields
from .combinations import check_combinations
from .delta_rules import (
    DELTA_GAMMA_DEFAULT,
    DELTA_LAMBDA_MAX_DEFAULT,
    DELTA_LAMBDA_MIN_DEFAULT,
    DELTA_REFINE_STEPS_DEFAULT,
    read_gamma,
)
from .method import method_in_use
from .options import (
    Assignment,
    CancellationTarget,
    Contrast,
    DeltaScope,
    EnergyForm,
    GammaUpdate,
    GroupLayout,
    ImportanceSamplingSupport,
    OneSidedPolicy,
    TokenWeighting,
    TransformGradient,
    ZeroAdvantageRule,
)
from .trl_field_rules import launched_processes, whole_groups_problem

# transformers >= 5.24 renamed gradient_checkpointing to activation_checkpointing and warns whenever the old name
# is set, which TRL's config does by default (True), so every run warned. Older 5.x releases know only the old name.
HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}
SOURCE = " Source: "  # separates a DFPO field's meaning from its source in metadata["help"]


def gradient_checkpointing_metadata(has_activation_checkpointing: bool) -> dict[str, object]:
    """The ``gradient_checkpointing`` field's metadata for TRL's argument parser.

    With a ``None`` default (transformers >= 5.24) ``--gradient_checkpointing`` alone must still mean True, so the
    flag takes an optional value (``nargs``/``const``). With a ``True`` default (older 5.x) the parser adds those
    itself and also a ``--no_gradient_checkpointing`` flag built from this metadata, where ``nargs`` is an error
    (docs/source/concepts/decisions.md, "TRL features on top")."""
    help_text = (
        "Activation checkpointing (trades compute for memory); default on, as in TRL. Same as "
        "activation_checkpointing on transformers >= 5.24; this name also works on older 5.x releases."
    )
    if has_activation_checkpointing:
        return {"help": help_text, "nargs": "?", "const": True}
    return {"help": help_text}


def documented(default: Any, meaning: str, source: str) -> Any:
    """A DFPO field whose help (shown by ``dfpo-train --help``, the docstring and the reference page) is its meaning and
    its source; TRL's argument parser passes every metadata key to argparse, so both live in the one help."""
    return field(default=default, metadata={"help": f"{meaning}{SOURCE}{source}."})


def builtin_transforms_help() -> str:
    """The built-in transforms as ``group_transform``'s help lists them, each with its source, from the registry."""
    return ", ".join(f'`"{name}"` ({TRANSFORMS[name].source})' for name in GROUP_TRANSFORMS)


def annotation(name: str, hint: Any) -> str:
    """A DFPO field's type as the docstring shows it: a ``Literal`` option as ``str`` with its values, any other as
    written (transformers' argument parser rewrites ``spec.type``: int | None becomes int)."""
    if get_origin(hint) is Literal:
        return "`str`: " + ", ".join(f'`"{c}"`' for c in get_args(hint))
    return " or ".join(f"`{t}`" for t in DFPOConfig.__annotations__[name].split(" | "))


def dfpo_fields() -> list[Field]:
    """The fields DFPOConfig adds to GRPOConfig, in declaration order."""
    inherited = {f.name for f in fields(GRPOConfig)}
    return [f for f in fields(DFPOConfig) if f.name not in inherited]


def split_help(spec: Field) -> tuple[str, str]:
    """A DFPO field's (meaning, source), as :func:`documented` joined them."""
    meaning, _, source = spec.metadata["help"].rpartition(SOURCE)
    return meaning, source.removesuffix(".")


def render_default(value: Any) -> str:
    """A default as the docstring and the reference page show it: strings in double quotes, the rest as Python
    writes it."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def parameters_section() -> str:
    """The docstring's ``Parameters:`` section, TRL's layout, one entry per DFPO field from its metadata."""
    lines = ["", "    Parameters:"]
    hints = get_type_hints(DFPOConfig)
    for spec in dfpo_fields():
        kind, default = annotation(spec.name, hints[spec.name]), render_default(spec.default)
        lines.append(f"        {spec.name} ({kind}, *optional*, defaults to `{default}`):")
        lines.append(textwrap.fill(spec.metadata["help"], width=120, initial_indent=" " * 12,
                                   subsequent_indent=" " * 12, break_on_hyphens=False))
    return "\n".join(lines) + "\n"


@dataclass
class DFPOConfig(GRPOConfig):
    r"""
    Configuration for [`DFPOTrainer`]: every field of `trl.GRPOConfig`, plus the DFPO fields below.

    DFPO ("Design Conditions for Intra-Group Learning of Sequence-Level Rewards: Token Gradient
    Cancellation", arXiv 2604.13088) keeps token updates exchangeable inside a group so that shared,
    reward-irrelevant tokens cancel. Equation numbers refer to that paper; `docs/source/concepts/design.md` describes
    what we implement, `docs/source/concepts/delta.md` DelTA's token weights (`token_weighting`, `delta_*`).
    """

    # TRL's default (on), kept; None here so that only an explicit setting reaches transformers' deprecated alias.
    gradient_checkpointing: bool | None = field(
        default=None if HAS_ACTIVATION_CHECKPOINTING else True,
        metadata=gradient_checkpointing_metadata(HAS_ACTIVATION_CHECKPOINTING),
    )
    # transformers' default is on; unset here is on where torch has an accelerator and off where it has none, where
    # torch cannot pin and warned "'pin_memory' argument is set as true but no accelerator is found" (data loading
    # only: what is trained and computed does not change). An explicit value stands.
    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={
            "help": "Whether or not to pin memory for DataLoader. Unset: on where torch has an accelerator "
            "(transformers' default), off on a machine without one, where torch cannot pin (and warned that it "
            "could not).",
            "nargs": "?",
            "const": True,
        },
    )
    group_transform: str = documented(
        "none",
        f"In-group transform of the post-clip sequence weights s̄ (stop-gradient): {builtin_transforms_help()}, "
        "or one registered by `register_transform`. Needs "
        "`importance_sampling_level=\"sequence\"`; acts only off-policy.",
        "DFPO eq. 47, 49, 50, 18, 51, 52–55, Table 3; docs/source/concepts/design.md, "
        "docs/source/guides/custom_transform.md",
    )
    transform_scale: float = documented(
        SCALE_FACTOR_DEFAULT, "κ of the `\"scale\"` ablation, s̃ = κ s̄; finite and > 0.", "DFPO Table 3 (κ = 0.5)"
    )
    transform_truncate_floor: float = documented(
        TRUNCATE_FLOOR_DEFAULT,
        "ϵ of `\"truncate_rebalance\"`, s⁺ = max(s̄, ϵ): an underflow guard in (0, 1), below the on-policy weight 1.",
        "DFPO eq. 52 (no value given there)",
    )
    transform_gradient: TransformGradient = documented(
        "ratio",
        "`\"ratio\"`: J_i = Â_i φ_i s̄_i(θ), φ = sg(s̃/s̄), so `\"none\"` is TRL's GSPO; `\"score\"`: "
        "J_i = Â_i sg(s̃_i) ρ_i(θ), clipped sequences keep their gradient.",
        "DFPO eq. 59–62 (ratio), 16/68/85 (score); docs/source/concepts/design.md",
    )
    transform_stop_gradient: bool = documented(
        True,
        "`False` differentiates the transform, J_i = Â_i s̃_i(θ) (ratio form; needs whole groups).",
        "DFPO Table 3 (\"no stop-grad\")",
    )
    cancellation_target: CancellationTarget = documented(
        "weights",
        "What the transform balances: `\"weights\"` Σ_i Â_i s̃_i = 0 (the paper); `\"gradient\"` Σ_i a_i s̃_i = 0 "
        "over the gradients that survive the clip (a_i = Â_i c_i 1[i ∈ U]), exact on shared tokens.",
        "ours, docs/source/concepts/cancellation.md (C1–C7)",
    )
    cancellation_one_sided: OneSidedPolicy = documented(
        "keep",
        "Under `\"gradient\"`, a group whose survivors share one sign keeps the `\"weights\"` result "
        "(`\"keep\"`) or gets s̃ = 0 (`\"zero\"`).",
        "docs/source/concepts/cancellation.md (C8)",
    )
    symmetric_clip: bool = documented(
        False,
        "GRPO-fix: per-token weight clip(r, 0, 1 + ε_high) for both advantage signs; token level only.",
        "DFPO App. H, eq. 79–80",
    )
    group_granular_batches: bool | None = documented(
        None,
        "Shuffle whole groups so that every micro-batch holds them: `None` only when a DFPO option needs it "
        "(DFPO off = TRL's run bit for bit), `True` always (TRL's batch order changes), `False` never.",
        "ours, docs/source/concepts/layouts.md",
    )
    group_layout: GroupLayout = documented(
        "auto",
        "How a transform gets whole groups that a micro-batch lacks: `\"auto\"` (the cheapest exact way), "
        "`\"redistributed\"` (one all-to-all per rollout), `\"pre_pass\"` (an extra no-grad forward).",
        "ours, docs/source/concepts/layouts.md",
    )
    prepass_batch_size: int | None = documented(
        None,
        "Rows per no-grad forward chunk of the pre-pass; `None`: 4 × `per_device_train_batch_size`.",
        "docs/source/concepts/layouts.md",
    )
    log_mechanism_metrics: bool = documented(
        True,
        "Log `asym/*`, `transform/*`, `cancellation/*`, `diagnostics/*`.",
        "DFPO eq. 23; docs/source/concepts/metrics.md",
    )
    log_energy_buckets: int = documented(
        0,
        "k ≥ 2 frequency buckets' energy shares; `0` off.",
        "DFPO eq. 24; docs/source/concepts/metrics.md",
    )
    energy_form: EnergyForm = documented(
        "aggregate",
        "`aggregate` (per token type) or `per_position`.",
        "DFPO eq. 24; docs/source/concepts/metrics.md",
    )
    token_weighting: TokenWeighting = documented(
        "none",
        "`\"delta\"`: DelTA's per-token weights λ̄ on the clipped surrogate (token level; loss types `grpo`, "
        "`bnpo`, `dr_grpo`, `dapo`).",
        "DelTA; docs/source/concepts/delta.md",
    )
    delta_lambda_min: float = documented(
        DELTA_LAMBDA_MIN_DEFAULT, "λ_min of λ = λ_min + (λ_max − λ_min) α; 0 < λ_min ≤ λ_max.", "DelTA"
    )
    delta_lambda_max: float = documented(DELTA_LAMBDA_MAX_DEFAULT, "λ_max of that range; finite.", "DelTA")
    delta_refine_steps: int = documented(
        DELTA_REFINE_STEPS_DEFAULT,
        "K, the centroid refinements (≥ 0; 0: \"w/o refinement\").",
        "DelTA, its released recipe",
    )
    # A str field so that the command line accepts the names; a number (or a numeric string) is a fixed gamma.
    delta_gamma: str = documented(
        DELTA_GAMMA_DEFAULT,
        "γ of α = σ(margin / γ): `\"std\"` (the side's margins' std), `\"mean_abs\"` (their mean |margin|; ours) "
        "or a fixed number > 0.",
        "DelTA's released code; docs/source/concepts/delta.md",
    )
    delta_gamma_update: GammaUpdate = documented(
        "lagged",
        "Refinement takes γ from the margins before each update (`\"lagged\"`) or after it (`\"current\"`, ours).",
        "DelTA's released code; docs/source/concepts/delta.md",
    )
    delta_zero_advantage: ZeroAdvantageRule = documented(
        "lambda_min",
        "Tokens of Â = 0 completions get λ_min (`\"lambda_min\"`) or 1 (`\"one\"`, ours).",
        "DelTA's released code; docs/source/concepts/delta.md",
    )
    delta_scope: DeltaScope = documented(
        "global",
        "Centroids, γ and N/Z over all processes (`\"global\"`, ours) or per process (`\"process\"`).",
        "DelTA's released code; docs/source/concepts/delta.md",
    )
    delta_assignment: Assignment = documented(
        "soft", "α = σ(margin / γ) (`\"soft\"`) or 1[margin > 0] (`\"hard\"`).", "DelTA ablation"
    )
    delta_contrast: Contrast = documented(
        "opposite",
        "Margin to the opposite side's centroid (`\"opposite\"`) or own side only (`\"within\"`).",
        "DelTA ablation; docs/source/concepts/delta.md",
    )
    delta_random: bool = documented(
        False, "Control: λ ~ U[λ_min, λ_max] on the same tokens, seeded from `seed`.", "DelTA ablation"
    )
    vllm_sync_timeout: float = documented(
        600.0,
        "Seconds a server-mode weight sync to vLLM may take before the run stops with one line naming the "
        "addresses and variables to check, instead of hanging (the set-up gets `vllm_server_timeout` on top); 0: "
        "no limit. The default is a wide margin over a measured sync (0.17 s for 538 MB on one host, about 21 s for "
        "Qwen3-32B's weights scaled linearly; docs/source/concepts/decisions.md)",
        "ours; docs/source/guides/cli.md#several-nodes-the-preflight-and-a-stalled-weight-sync",
    )
    vllm_generation_timeout: float | None = documented(
        None,
        "Seconds a server-mode generation request may take before the run stops with one line and exit code 124 "
        "instead of hanging; `None`: 600 + its completions × `max_completion_length` / 500 tokens/s (estimated); "
        "0: no limit",
        "ours; docs/source/guides/vllm.md#a-server-that-stops-answering",
    )
    vllm_importance_sampling_support: ImportanceSamplingSupport = documented(
        "full",
        "TRL's vLLM importance-sampling ratio over the trainer's untruncated distribution (`\"full\"`, TRL's) or "
        "renormalised over the support vLLM sampled from (`\"truncated\"`: 1 when the engines agree, whatever the "
        "top-k / top-p / min-p; one log K_t per token). Any `vllm_importance_sampling_mode`",
        "ours; docs/source/guides/vllm.md#which-correction",
    )

    def __post_init__(self) -> None:
        self._resolve_checkpointing_alias()
        self.delta_gamma = read_gamma(self.delta_gamma)
        check_fields(self)  # every field's own rule first, all problems at once
        check_combinations(self)  # then the rules between fields, the first one broken
        self._check_whole_groups()
        self._resolve_precision()
        self._resolve_pin_memory()
        self._cpu_group_with_ddp_timeout()
        super().__post_init__()

    def _cpu_group_with_ddp_timeout(self) -> None:
        """transformers 5.24 hands ``ddp_timeout`` to accelerate only off the CPU: with ``use_cpu`` (or ``accelerate
        launch --cpu``) the gloo process group got accelerate's default, 1800 s, whatever ``ddp_timeout`` said, so a
        process waiting in a collective for a peer that hangs, or a node that is gone, waited 30 minutes. Under a
        multi-process launch on the CPU the group is created here, with ``ddp_timeout``; transformers' set-up, next,
        finds it initialised and keeps it (tests/cli/test_killed_rank.py)."""
        on_cpu = self.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
        if not on_cpu or (launched_processes() or 1) < 2:
            return
        import torch.distributed as dist
        from accelerate import PartialState

        if dist.is_available() and not dist.is_initialized():
            PartialState(cpu=True, backend=self.ddp_backend, timeout=timedelta(seconds=self.ddp_timeout))

    def _check_whole_groups(self) -> None:
        """TRL's whole-groups rule in the words ``dfpo-train`` uses (the fields a user sets and the nearest values
        that fix it), instead of TRL's bare "generation_batch_size must be divisible by num_generations"; left to
        TRL when another launcher started the processes without ``WORLD_SIZE``."""
        processes = launched_processes()
        names = ("per_device_train_batch_size", "steps_per_generation", "gradient_accumulation_steps",
                 "generation_batch_size", "num_generations")
        problem = None if processes is None else whole_groups_problem({n: getattr(self, n) for n in names}, processes)
        if problem is not None:
            raise ValueError(f"{problem}.")

    def _resolve_pin_memory(self) -> None:
        """Unset ``dataloader_pin_memory``: on where torch has an accelerator (transformers' default, so no GPU run
        changes), off on a machine without one. transformers' on made every CPU run (the README's Python example)
        print torch's "'pin_memory' argument is set as true but no accelerator is found"; pinning needs an
        accelerator, so off changes nothing but the warning (transformers itself turns it off with ``use_cpu``)."""
        if self.dataloader_pin_memory is None:
            import torch

            self.dataloader_pin_memory = bool(torch.accelerator.is_available())

    def _resolve_precision(self) -> None:
        """TRL turns ``bf16`` on when it is unset, and transformers then refuses a machine without a bfloat16 GPU
        ("Your setup doesn't support bf16/gpu"), so ``DFPOConfig(output_dir=...)`` failed on every CPU. Unset
        ``bf16`` on such a machine means float32 (what the CPU recipe sets); an explicit ``bf16=True`` there without
        ``use_cpu`` is refused naming both fixes. With a bfloat16 GPU, or ``use_cpu``, TRL's default stands."""
        if self.fp16 or self.use_cpu or self.bf16 is False:
            return
        from transformers import training_args as hf_args  # the very check transformers' refusal makes

        if hf_args.is_torch_bf16_gpu_available() or hf_args.is_torch_xla_available():
            return
        if self.bf16 is None:
            self.bf16 = False
            return
        raise ValueError(
            "bf16=True needs a GPU with bfloat16 support, and this machine has none; set use_cpu=True to train in "
            "bfloat16 on the CPU, or leave bf16 unset (float32 here, TRL's bfloat16 default on such a GPU)"
        )

    @property
    def sequence_rewrite_active(self) -> bool:
        """Whether the sequence-level loss is rewritten (any transform, the score form, or no stop-gradient)."""
        return method_in_use(self).rewrites_sequences

    @property
    def wants_group_granular_batches(self) -> bool:
        """Whether the group shuffle should run when the batch sizes allow it: forced on, or automatic with a
        DFPO option that reads whole groups (a transform, the score form, no stop-gradient)."""
        if self.group_granular_batches is None:
            return self.sequence_rewrite_active
        return bool(self.group_granular_batches)

    def _resolve_checkpointing_alias(self) -> None:
        """Accept either checkpointing name without transformers' deprecation warning (TRL set the old name by
        default, so every run warned with nothing for the user to change); unset means on, TRL's default."""
        if not HAS_ACTIVATION_CHECKPOINTING:
            return
        if self.activation_checkpointing is None:
            on = self.gradient_checkpointing
            self.activation_checkpointing = True if on is None else bool(on)
        self.gradient_checkpointing = None  # transformers mirrors the new name into it after resolving


DFPOConfig.__doc__ = (DFPOConfig.__doc__ or "") + parameters_section()
