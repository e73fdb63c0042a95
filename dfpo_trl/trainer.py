"""``DFPOTrainer``: TRL's ``GRPOTrainer`` with DFPO's in-group transforms, GRPO-fix and mechanism metrics.

The trainer only wires the pure modules (``loss_inputs``, ``transforms``, ``cancellation``, ``metrics``,
``layout``) into TRL, through the touch points declared in ``trl_compat``. It never re-implements TRL's loss:
TRL's own ``_compute_loss`` runs unchanged, and DFPO enters through the two inputs that TRL reads *after* its
policy forward pass, the advantages and the old log-probabilities (``loss_inputs``, pure functions of tensors):

* ratio form (docs/design.md): advantages Â_i → Â_i φ_i with φ_i = s̃_i / s̄_i under stop-gradient. For φ_i ≥ 0,
  TRL's -min(s Â φ, c Â φ) = -φ Â s̄(θ), which is eq. 59–62; φ ≡ 1 for ``"none"``, so that is GSPO exactly.
* score form: old log-probs → the detached current ones (ratio 1 in value, ∇ρ in gradient, never clipped) and
  advantages → Â_i s̃_i, so the policy term is -Â_i sg(s̃_i) ρ_i(θ) (eq. 16/68/85).
* GRPO-fix (Appendix H): ε_low := 1 turns TRL's clip into clip(r, 0, 1+ε_high) for Â ≥ 0; for Â < 0 tokens
  with r > 1+ε_high the old log-prob is rewritten so that r is the constant 1+ε_high (zero gradient), which
  makes the weight the same operator for both signs (eq. 79–80).
* DelTA (docs/delta.md, ``token_weighting="delta"``, wired by ``delta_trainer.DeltaMixin``): advantages →
  Â_i λ̄_{i,t} (B, T) last, with λ̄ > 0 computed once per rollout, so the policy term is -λ̄ min(rÂ, clip(r)Â).

* Gradient energy on frequent tokens (eq. 24, docs/metrics.md, ``log_energy_buckets=k``, off by default): the loss's
  policy forward also keeps h (the backbone output TRL's fused head projects), a no-grad pass gives the per-token
  LM-head gradient scale ‖∂ log p_t/∂W‖, and a backward hook on the per-token log-probs multiplies it by |c_t|
  and logs each frequency bucket's share. Nothing in the loss or its gradients changes.

β-KL, the vLLM importance-sampling correction, the entropy bonus, ``top_entropy_quantile``, truncation
masking and ``delta`` clipping are TRL's code paths and apply on top unchanged.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, NamedTuple

import torch
import trl
from accelerate.utils import gather_object
from trl import GRPOTrainer

from . import metrics as mech
from .cancellation import (
    FACTOR_LOSS_TYPES,
    GroupSides,
    aggregation_factor,
    transform_group_weights,
)
from .config import DFPOConfig
from .delta_trainer import DeltaMixin
from .layout import (
    GROUP_IDS_KEY,
    ROW_IDS_KEY,
    WHOLE_GROUPS_KEY,
    concat_sequence_dicts,
    consecutive_group_ids,
    group_granular_order,
    group_index,
    holds_whole_groups,
    permute_sequence_dict,
    positions_of,
    redistribution_plan,
    rollout_generator,
    scatter_from_groups,
)
from .lm_head import HiddenCapture, capture_log_prob_forward, fused_lm_head, gathered_for_reading
from .loss_inputs import (
    bounded_old_logps,
    grpo_fix_old_logps,
    loss_mask,
    post_clip_weights,
    sequence_level_inputs,
)
from .metric_store import MetricStore
from .redistribute import exchange_plan, exchange_rows, pad_to_widths, per_row_keys, trim_padding
from .step_reward import StepRewardMixin
from .trl_compat import (
    MULTIMODAL_KEYS,
    SUPPORTED_TRL_TEXT,
    TRLCompatibilityError,
    check_trainer_attributes,
    disable_gradient_checkpointing,
    generate_every,
    get_config_model_id,
    split_tensor_dict,
    trl_runs_old_logps_forward,
)

logger = logging.getLogger(__name__)

# Group layouts of docs/layouts.md, cheapest first. The trainer picks one at start-up and logs it.
LAYOUT_GROUP_GRANULAR = "group_granular"  # whole groups in every micro-batch: free
LAYOUT_CROSS_PROCESS = "cross_process"  # groups spread over processes in one micro-step: all-gather scalars
LAYOUT_REDISTRIBUTED = "redistributed"  # rollout moved once so micro-steps hold whole groups across processes
LAYOUT_PRE_PASS = "pre_pass"  # groups spread over micro-steps: no-grad pre-pass at each optimizer step
LAYOUT_PER_SAMPLE = "per_sample"  # no transform: TRL's per-sample shuffle, group metrics off
# Keys the pre-pass attaches to each micro-batch of the optimizer step: s̄ and s̃ at the step's θ.
PRE_PASS_S_BAR = "dfpo_s_bar"
PRE_PASS_S_TILDE = "dfpo_s_tilde"
PRE_PASS_SURVIVES = "dfpo_survives"
PRE_PASS_TWO_SIDED = "dfpo_two_sided"
PRE_PASS_KEYS = (PRE_PASS_S_BAR, PRE_PASS_S_TILDE, PRE_PASS_SURVIVES, PRE_PASS_TWO_SIDED)
GROUP_SHUFFLE_STREAM = 1  # DelTA's random-λ control is stream 0
REDISTRIBUTION_STREAM = 2  # the redistributed layout's group order: one draw shared by every process


def default_config(model: Any) -> DFPOConfig:
    """The config of a trainer built without ``args``, named as ``GRPOTrainer`` names its default
    (``GRPOConfig(f"{model_name}-GRPO")``): ``DFPOConfig(f"{model_name}-DFPO")``, every DFPO option off."""
    model_name = model if isinstance(model, str) else get_config_model_id(model.config)
    return DFPOConfig(f"{model_name.split('/')[-1]}-DFPO")


class RowWeights(NamedTuple):
    """Per-row sequence weights of one micro-batch: s̄ (eq. 47), s̃ (the transform's output), whether the row's
    gradient survives the clip (U, eq. C2) and whether its group is two-sided (eq. C8)."""

    s_bar: torch.Tensor
    s_tilde: torch.Tensor
    survives: torch.Tensor
    two_sided: torch.Tensor


class DFPOTrainer(StepRewardMixin, DeltaMixin, GRPOTrainer):
    """`trl.GRPOTrainer` with DFPO objectives. Takes the same arguments; `args` must be a [`DFPOConfig`] (built
    from the model's name, every DFPO option off, when not given, as `GRPOTrainer` builds its default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        arguments = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        arguments.pop("self")
        config = arguments.get("args")
        if config is None:
            config = default_config(arguments["model"])
        elif not isinstance(config, DFPOConfig):
            raise TypeError(
                f"DFPOTrainer needs args=DFPOConfig(...), got {type(config).__name__}; DFPOConfig takes every "
                "GRPOConfig field plus the DFPO ones."
            )
        arguments["args"] = config
        super().__init__(**arguments)
        check_trainer_attributes(self)
        self._dfpo_pending: dict[str, Any] | None = None
        self.dfpo_metrics = MetricStore()  # device tensors until a logging step (metric_store)
        if self.args.symmetric_clip:
            # clip(r, 1 - 1, 1 + eps_high) = clip(r, 0, 1 + eps_high): the lower bound of eq. 79.
            self.epsilon_low = 1.0
        self.group_layout = self._choose_group_layout()
        logger.info("DFPO group layout: %s", self.group_layout)
        if self._regroups_batches() and self._model_is_multimodal():
            raise ValueError(self._multimodal_refusal("the model or its processor is multimodal"))
        if self.args.sequence_rewrite_active and not trl_runs_old_logps_forward(self):
            logger.warning(
                "group_transform=%r runs on-policy (steps_per_generation <= gradient_accumulation_steps, "
                "num_iterations=1, no vLLM importance sampling): every post-clip weight is 1 and the transform "
                "is the identity. Raise steps_per_generation or num_iterations for it to act.",
                self.args.group_transform,
            )

    # ----------------------------------------------------------------------------------------------- layout
    def _choose_group_layout(self) -> str:
        """The cheapest exact layout for these batch sizes (docs/layouts.md); refuse only what cannot be exact.
        With every DFPO option off (and ``group_granular_batches`` not forced) TRL's per-sample order is kept."""
        args: DFPOConfig = self.args
        per_device, group_size = args.per_device_train_batch_size, self.num_generations
        whole = per_device % group_size == 0
        if args.group_granular_batches is True and not whole:
            raise ValueError(
                f"group_granular_batches=True needs whole groups in every micro-batch, but "
                f"per_device_train_batch_size={per_device} is not a multiple of num_generations={group_size}. "
                f"Set per_device_train_batch_size to a multiple of {group_size}, or group_granular_batches=None."
            )
        if whole and args.wants_group_granular_batches:
            # TRL slices the global generation batch per process in blocks of per_device * steps_per_generation
            # rows, a multiple of G, so a group-granular split keeps every group inside one micro-batch.
            return LAYOUT_GROUP_GRANULAR
        if not args.sequence_rewrite_active:
            if args.group_layout != "auto":
                logger.warning("group_layout=%r has no effect: no DFPO option needs in-group coefficients.",
                               args.group_layout)
            return LAYOUT_PER_SAMPLE
        if not args.transform_stop_gradient:
            raise ValueError(
                "transform_stop_gradient=False differentiates the transform through every member's s̄, so the "
                "whole group must be in one micro-batch, but per_device_train_batch_size="
                f"{per_device} is not a multiple of num_generations={group_size}. Set "
                f"per_device_train_batch_size to a multiple of {group_size}."
            )
        processes = self.accelerator.num_processes
        redistributable = processes > 1 and (per_device * processes) % group_size == 0
        if args.group_layout == LAYOUT_REDISTRIBUTED and not redistributable:
            raise ValueError(
                f"group_layout='redistributed' needs per_device_train_batch_size × num_processes = {per_device} × "
                f"{processes} to be a multiple of num_generations={group_size} (every micro-step then holds whole "
                "groups across processes). Change the per-device batch or the process count, or use "
                "group_layout='auto'."
            )
        if args.steps_per_generation == 1 and args.group_layout == "auto":
            # Each micro-step trains on the whole global generation batch: groups may straddle processes but
            # are whole across them, so gathering (group id, s̄, Â) in the micro-step is exact.
            return LAYOUT_CROSS_PROCESS
        if redistributable and args.group_layout in ("auto", LAYOUT_REDISTRIBUTED):
            return LAYOUT_REDISTRIBUTED
        if args.steps_per_generation % args.gradient_accumulation_steps != 0:
            raise ValueError(
                f"group_transform={args.group_transform!r} with groups spread over micro-steps "
                f"(per_device_train_batch_size={per_device} is not a multiple of num_generations={group_size}) "
                "needs every optimizer step inside one generation batch: set steps_per_generation to a multiple "
                f"of gradient_accumulation_steps={args.gradient_accumulation_steps}, or "
                f"per_device_train_batch_size to a multiple of {group_size}."
            )
        return LAYOUT_PRE_PASS

    def _regroups_batches(self) -> bool:
        """Whether this layout concatenates, permutes or re-forwards TRL's buffered rollout (group shuffle,
        pre-pass): code that treats every tensor as one row per sample."""
        return self.group_layout in (LAYOUT_GROUP_GRANULAR, LAYOUT_PRE_PASS, LAYOUT_REDISTRIBUTED)

    def _model_is_multimodal(self) -> bool:
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        has_vision = getattr(config, "vision_config", None) is not None
        return has_vision or getattr(self.processing_class, "image_processor", None) is not None

    def _multimodal_refusal(self, why: str) -> str:
        option = self.args.describe_active_options() or "group_granular_batches=True"
        return (
            f"{option} needs the {self.group_layout!r} layout, which regroups TRL's rollout into whole groups "
            "(or re-forwards it in a pre-pass) as if every tensor had one row per sample, but "
            f"{why}: {', '.join(MULTIMODAL_KEYS[:4])}, ... are not one row per sample (pixel_values rows are "
            "image patches) and the pre-pass does not pass them to the model. Vision-language batches are not "
            "supported with this layout: use a text-only model, or turn the option off."
        )

    def _refuse_multimodal_batch(self, batch: dict[str, Any]) -> None:
        present = [key for key in MULTIMODAL_KEYS if batch.get(key) is not None]
        if present:
            raise ValueError(self._multimodal_refusal(f"the rollout carries {', '.join(present)}"))

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's rollout, plus an explicit group id per row (global row // G, as TRL's sampler lays rows out)."""
        output = super()._generate_and_score_completions(inputs)
        mode = self._mode()
        group_size = self._group_size(mode)
        local_rows = output["prompt_ids"].size(0)
        offset = self.accelerator.process_index * local_rows
        device = output["prompt_ids"].device
        output[GROUP_IDS_KEY] = consecutive_group_ids(local_rows, group_size, offset=offset, device=device)
        output[ROW_IDS_KEY] = torch.arange(offset, offset + local_rows, device=device)
        return output

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's buffering, with its per-sample shuffle replaced by a group-granular one (docs/layouts.md)."""
        regenerated = self.model.training and (
            self._step % generate_every(self) == 0 or self._buffered_inputs is None
        )
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            return inputs
        spg = self.args.steps_per_generation
        if regenerated:
            if self._regroups_batches():
                self._refuse_multimodal_batch(self._buffered_inputs[0])
            if self.group_layout == LAYOUT_GROUP_GRANULAR:
                full = concat_sequence_dicts(self._buffered_inputs)
                order = group_granular_order(full[GROUP_IDS_KEY], self._group_shuffle_generator())
                self._buffered_inputs = split_tensor_dict(permute_sequence_dict(full, order), spg)
            elif self.group_layout == LAYOUT_REDISTRIBUTED:
                self._buffered_inputs = split_tensor_dict(self._redistribute(self._buffered_inputs), spg)
            self._mark_whole_groups()
        if self.group_layout == LAYOUT_PRE_PASS and self._step % self.args.gradient_accumulation_steps == 0:
            self._pre_pass()
        return self._buffered_inputs[self._step % spg]

    def _mark_whole_groups(self) -> None:
        """Record in each buffered micro-batch whether it holds whole groups (one host read per rollout, not
        one per micro-step); in the group-granular layout, check that it does."""
        if not (self.args.log_mechanism_metrics or self.args.sequence_rewrite_active):
            return
        for micro in self._buffered_inputs:
            group_ids = micro[GROUP_IDS_KEY]
            if self.group_layout == LAYOUT_REDISTRIBUTED:
                micro[WHOLE_GROUPS_KEY] = False  # whole across processes by construction, not locally
            elif self.group_layout == LAYOUT_GROUP_GRANULAR:
                group_index(group_ids, self.num_generations)  # raises with the fix if a group is cut apart
                micro[WHOLE_GROUPS_KEY] = True
            else:
                micro[WHOLE_GROUPS_KEY] = holds_whole_groups(group_ids, self.num_generations)

    def _group_shuffle_generator(self) -> torch.Generator:
        """DFPO's own generator for the group shuffle, seeded per rollout: torch's global RNG stream stays TRL's,
        and a run resumed at a generation boundary draws the same order (no state for a checkpoint to hold)."""
        return rollout_generator(
            self.args.seed, self.accelerator.process_index, self.state.global_step, stream=GROUP_SHUFFLE_STREAM
        )

    # ------------------------------------------------------------------------ redistributed (docs/layouts.md)
    def _redistribute(self, buffered: list[dict[str, Any]]) -> dict[str, Any]:
        """Move this rollout between processes once so that micro-step k of every process holds whole groups
        across processes (docs/layouts.md): gather every row's (row id, group id) and the batch widths (one
        small all-gather and host read per rollout), plan with one group order shared by all processes, pad to
        common widths, one all-to-all per rollout tensor, trim. Returns the local batch in micro-step order."""
        full = concat_sequence_dicts(buffered)
        rows = full["advantages"].size(0)
        keys = per_row_keys(full, rows)
        device = full["advantages"].device
        widths = torch.tensor([[full["prompt_ids"].size(1), full["completion_mask"].size(1)]], device=device)
        ids = torch.stack([full[ROW_IDS_KEY], full[GROUP_IDS_KEY]], dim=1)
        all_ids = self.accelerator.gather(ids).cpu()
        all_widths = self.accelerator.gather(widths).cpu()
        generator = rollout_generator(self.args.seed, 0, self.state.global_step, stream=REDISTRIBUTION_STREAM)
        destination, index = redistribution_plan(
            all_ids[:, 0], all_ids[:, 1], self.num_generations, self.args.per_device_train_batch_size,
            self.accelerator.num_processes, generator,
        )
        plan = exchange_plan(destination, index, self.accelerator.process_index, self.accelerator.num_processes)
        padded = pad_to_widths(full, keys, int(all_widths[:, 0].max()), int(all_widths[:, 1].max()))
        return trim_padding(exchange_rows(padded, keys, plan), keys)

    # ------------------------------------------------------------------------------------ pre-pass (layout 3)
    def _policy_unchanged_since_rollout(self) -> bool:
        """True in the first optimizer step after a rollout: θ = θ_old, so every s is 1 and the pre-pass forward
        can be skipped (its old log-probs were computed by this model at this θ)."""
        return self._step % generate_every(self) == 0

    def _pre_pass(self) -> None:
        """At the start of an optimizer step, compute s̄ at the step's θ for every member of every group that has
        a row in the step (on any process), transform the complete groups, and attach s̄, s̃ to the step's
        micro-batches, so each micro-step's loss uses exact in-group coefficients (docs/layouts.md, pre-pass)."""
        spg, accumulation = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        start = self._step % spg
        for micro in self._buffered_inputs:  # the previous optimizer step's coefficients are stale now
            for key in PRE_PASS_KEYS:
                micro.pop(key, None)
        window = [self._buffered_inputs[(start + j) % spg] for j in range(accumulation)]
        full = concat_sequence_dicts(self._buffered_inputs)
        window_groups = torch.cat([micro[GROUP_IDS_KEY] for micro in window])
        active = torch.unique(self._gather_rows(window_groups.double().unsqueeze(1))[:, 0]).to(torch.int64)
        rows = torch.isin(full[GROUP_IDS_KEY], active.to(full[GROUP_IDS_KEY].device)).nonzero().squeeze(1)
        if self._policy_unchanged_since_rollout():
            s_bar = torch.ones(rows.numel(), device=full["advantages"].device)
            survives = torch.ones(rows.numel(), dtype=torch.bool, device=s_bar.device)  # s = 1: inside the clip
            self._metrics["train"]["prepass/forward_skipped"].append(1.0)
        else:
            s_bar, survives = self._post_clip_weights_no_grad(full, rows)
            self._metrics["train"]["prepass/forward_skipped"].append(0.0)
        micro_tokens = torch.cat(
            [loss_mask(micro).sum().expand(micro["advantages"].size(0)) for micro in self._buffered_inputs]
        )
        factor = self._aggregation_factor(full, loss_mask(full), micro_tokens)[rows]
        row_ids, weights = self._transform_across_processes(
            full[ROW_IDS_KEY][rows], full[GROUP_IDS_KEY][rows], s_bar, full["advantages"][rows], survives, factor,
            "train",
        )
        for micro in window:
            position = positions_of(micro[ROW_IDS_KEY], row_ids)
            for key, values in zip(PRE_PASS_KEYS, weights, strict=True):
                micro[key] = values[position]

    def _post_clip_weights(
        self, logps: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """s̄ and U (loss_inputs.post_clip_weights) with the trainer's clip range; counts the sequences whose
        NaN/Inf token log-ratios were sanitised (never silent)."""
        weights = post_clip_weights(
            logps, old, mask, advantages, self.epsilon_low, self.epsilon_high, self.args.delta,
            score_form=self.args.transform_gradient == "score",
        )
        self.dfpo_metrics.add_sum(self._mode(), "transform/sanitised_weights", weights.sanitised.sum())
        return weights.s_bar, weights.survives

    def _aggregation_factor(
        self, inputs: dict[str, Any], mask: torch.Tensor, micro_batch_tokens: torch.Tensor
    ) -> torch.Tensor:
        """c_i (eq. C3) of every row of ``inputs``: TRL's per-member aggregation factor, with TRL's vLLM
        importance-sampling ratio where TRL applies it to the loss. Loss types that are not a clipped surrogate
        (only reachable with no transform, for the metrics) get c = 1."""
        if self.loss_type not in FACTOR_LOSS_TYPES:
            return torch.ones(mask.size(0), dtype=torch.float64, device=mask.device)
        ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
            ratio = inputs["importance_sampling_ratio"]
        return aggregation_factor(mask, self.loss_type, ratio, micro_batch_tokens)

    @torch.no_grad()
    def _post_clip_weights_no_grad(
        self, full: dict[str, Any], rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """s̄ of the selected rows at the current θ. Every process runs the same number of forward chunks (a
        ZeRO-3 forward is collective), padding with a repeat of one row where it has fewer."""
        chunk = self.args.prepass_batch_size or 4 * self.args.per_device_train_batch_size
        local_chunks = math.ceil(rows.numel() / chunk)
        counts = self._gather_rows(torch.tensor([[float(local_chunks)]], device=rows.device))
        total_chunks = int(counts.max().item())
        fallback = torch.zeros(1, dtype=rows.dtype, device=rows.device)
        s_bars, survives = [], []
        full_mask = loss_mask(full)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for k in range(total_chunks):
                part = rows[k * chunk : (k + 1) * chunk]
                real = part.numel() > 0
                part = part if real else fallback
                ids = torch.cat([full["prompt_ids"][part], full["completion_ids"][part]], dim=1)
                attention = torch.cat([full["prompt_mask"][part], full["completion_mask"][part]], dim=1)
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    model=self.model, input_ids=ids, attention_mask=attention,
                    logits_to_keep=full["completion_ids"].size(1), batch_size=chunk,
                )
                if not real:
                    continue
                mask = full_mask[part]
                old = full.get("old_per_token_logps")
                old = logps if old is None else old[part]
                s_bar, survive = self._post_clip_weights(logps, old, mask, full["advantages"][part])
                s_bars.append(s_bar)
                survives.append(survive)
        if not s_bars:
            return torch.ones(0, device=rows.device), torch.ones(0, dtype=torch.bool, device=rows.device)
        return torch.cat(s_bars), torch.cat(survives)

    # --------------------------------------------------------------------------------- cross-process groups
    def _gather_rows(self, values: torch.Tensor) -> torch.Tensor:
        """All-gather (n_p, k) float64 rows from every process, n_p may differ: a few floats per sequence."""
        if self.accelerator.num_processes == 1:
            return values
        count = torch.tensor([values.size(0)], device=values.device)
        counts = self.accelerator.gather(count)
        padded = self.accelerator.pad_across_processes(values, dim=0)
        gathered = self.accelerator.gather(padded).view(self.accelerator.num_processes, -1, values.size(1))
        return torch.cat([gathered[p, : int(n)] for p, n in enumerate(counts.tolist())])

    def _transform_across_processes(
        self, row_ids: torch.Tensor, group_ids: torch.Tensor, s_bar: torch.Tensor, advantages: torch.Tensor,
        survives: torch.Tensor, factor: torch.Tensor, mode: str, equal_rows: bool = False,
    ) -> tuple[torch.Tensor, RowWeights]:
        """Gather (row id, group id, s̄, Â, U, c) from all processes (6 floats a row), transform the complete
        groups, log the metrics. Returns every gathered row's id and weights (the same on every process).
        ``equal_rows``: every process holds the same number of rows, whose groups are whole across processes by
        construction (the redistributed layout): one plain all-gather, no size exchange or group check, so no
        host read in the loss."""
        packed = torch.stack(
            [row_ids.double(), group_ids.double(), s_bar.double(), advantages.double(), survives.double(),
             factor.double()], 1,
        )
        if equal_rows and self.accelerator.num_processes > 1:
            gathered = self.accelerator.gather(packed)
        else:
            gathered = self._gather_rows(packed)
        group_size = self._group_size(mode)
        index = group_index(gathered[:, 1].to(torch.int64), group_size, validate=not equal_rows)
        weights = self._transform_groups(
            gathered[:, 2].float(), gathered[:, 3].float(), gathered[:, 4] > 0.5, gathered[:, 5], index, mode
        )
        return gathered[:, 0].to(torch.int64), weights

    def _transform_groups(
        self, s_bar: torch.Tensor, advantages: torch.Tensor, survives: torch.Tensor, factor: torch.Tensor,
        index: torch.Tensor, mode: str,
    ) -> RowWeights:
        """The configured transform on the (num_groups, G) view given by ``index``, balancing Â (``"weights"``) or
        the surviving gradient coefficients a = Â c 1[U] (``"gradient"``, eq. C1); returns rows in row order."""
        args: DFPOConfig = self.args
        s_bar_g, adv_g, survives_g = s_bar[index], advantages[index].to(s_bar.dtype), survives[index]
        s_tilde_g, sides = transform_group_weights(
            args.group_transform, s_bar_g, adv_g, survives_g, factor[index], args.cancellation_target,
            args.cancellation_one_sided, scale_factor=args.transform_scale,
            truncate_floor=args.transform_truncate_floor,
        )
        if args.log_mechanism_metrics:
            self._log_sequence_metrics(s_bar_g.detach(), s_tilde_g.detach(), adv_g.detach(), sides, mode)
        two_sided_g = sides.two_sided.unsqueeze(-1).expand_as(survives_g)
        return RowWeights(
            s_bar, scatter_from_groups(s_tilde_g, index), survives, scatter_from_groups(two_sided_g, index)
        )

    # ---------------------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, after DFPO's metrics are reduced over every process and handed to TRL's averaging."""
        self.flush_dfpo_metrics("train" if self.model.training else "eval")
        super().log(logs, start_time)

    def flush_dfpo_metrics(self, mode: str = "train") -> None:
        """Move DFPO's pending metrics of ``mode`` into TRL's ``_metrics`` (one value each, reduced over all
        processes: the same meaning at any world size). Collective: every process must call it together, as
        every process calls ``log``."""
        gather = None
        if self.accelerator.num_processes > 1:
            def gather(names: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
                return [[tuple(item) for item in per] for per in gather_object([names])]
        for name, value in self.dfpo_metrics.flush(mode, self.accelerator.device, gather).items():
            self._metrics[mode][name].append(value)

    # ------------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss on a shallow copy of ``inputs`` that DFPO rewrites right after the policy forward pass."""
        inputs = dict(inputs)  # the buffered rollout is reused across iterations: never mutate it
        self._dfpo_pending = inputs
        try:
            loss = super()._compute_loss(model=model, inputs=inputs)
            rewritten = self._dfpo_pending is None  # consumed by the policy forward's hook
        finally:
            self._dfpo_pending = None
        if not rewritten and self.args.dfpo_options_active:
            raise TRLCompatibilityError(
                f"TRL's _compute_loss never ran its policy forward through _get_per_token_logps_and_entropies, so "
                f"DFPO's input rewrite did not run and {self.args.describe_active_options()} would be silently "
                f"ignored (trl {trl.__version__}; dfpo_trl supports trl{SUPPORTED_TRL_TEXT})."
            )
        return loss

    def _get_per_token_logps_and_entropies(self, model: torch.nn.Module, *args: Any, **kwargs: Any):
        """TRL's helper; on the loss's policy forward, also rewrite the inputs TRL reads next (see module doc)."""
        capture = None
        if self._dfpo_pending is not None and self._energy_active():
            capture = HiddenCapture("log_energy_buckets")
            logps, entropies, aux_loss = capture_log_prob_forward(
                capture, self.accelerator.unwrap_model(model), ((model, *args), kwargs),
                lambda: super(DFPOTrainer, self)._get_per_token_logps_and_entropies(model, *args, **kwargs),
            )
        else:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        pending, self._dfpo_pending = self._dfpo_pending, None
        if pending is not None:
            self._rewrite_loss_inputs(pending, logps)
            if capture is not None:
                self._watch_gradient_energy(model, logps, pending, capture)
        return logps, entropies, aux_loss

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _group_size(self, mode: str) -> int:
        """G of the batches of ``mode``: TRL's ``num_generations`` in training, ``num_generations_eval`` else."""
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _group_ids(self, inputs: dict[str, Any], mode: str) -> torch.Tensor:
        group_ids = inputs.get(GROUP_IDS_KEY)
        if group_ids is None:  # a hand-built batch: consecutive blocks of num_generations
            group_size = self._group_size(mode)
            rows = inputs["completion_ids"].size(0)
            group_ids = consecutive_group_ids(rows, group_size, device=inputs["completion_ids"].device)
        return group_ids

    def _group_index(self, inputs: dict[str, Any], mode: str) -> torch.Tensor | None:
        """The (num_groups, G) row index when this micro-batch holds whole groups, else None."""
        group_size = self._group_size(mode)
        group_ids = self._group_ids(inputs, mode)
        whole = inputs.get(WHOLE_GROUPS_KEY)  # known for buffered training micro-batches (_mark_whole_groups)
        if whole is not None:
            return group_index(group_ids, group_size, validate=False) if whole else None
        if self.group_layout == LAYOUT_GROUP_GRANULAR and mode == "train":
            return group_index(group_ids, group_size)  # raises with the fix if a group is cut apart
        return group_index(group_ids, group_size) if holds_whole_groups(group_ids, group_size) else None

    def _rewrite_loss_inputs(self, inputs: dict[str, Any], per_token_logps: torch.Tensor) -> None:
        args: DFPOConfig = self.args
        mode = self._mode()
        mask = loss_mask(inputs)
        old = inputs.get("old_per_token_logps")
        if old is not None:
            old = bounded_old_logps(per_token_logps, old, mask, self.importance_sampling_level == "sequence")
            inputs["old_per_token_logps"] = old
        else:
            old = per_token_logps.detach()
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError("DFPO needs one advantage per sequence (shape (B,)), as TRL's rollout produces.")

        if args.symmetric_clip:
            inputs["old_per_token_logps"], capped = grpo_fix_old_logps(
                per_token_logps, old, advantages, self.epsilon_high
            )
            # the fraction of scored tokens capped, pooled over the logging interval's tokens on every process
            self.dfpo_metrics.add_mean(
                mode, "grpo_fix/negative_capped_fraction", (capped & mask.bool()).sum(), mask.sum()
            )
        index = None
        if args.log_mechanism_metrics or args.sequence_rewrite_active:
            index = self._group_index(inputs, mode)
        two_sided = None
        if self.importance_sampling_level == "sequence" and (index is not None or args.sequence_rewrite_active):
            two_sided = self._rewrite_sequence_level(inputs, per_token_logps, old, mask, advantages, index, mode)
        if args.log_mechanism_metrics and index is not None and per_token_logps.requires_grad:
            self._watch_token_coefficients(per_token_logps, inputs["completion_ids"], mask, index, two_sided, mode)
        self._apply_delta_weights(inputs, mask)  # DelTA: Â_i → Â_i λ̄_{i,t}, after every read of the 1-D Â

    def _rewrite_sequence_level(
        self,
        inputs: dict[str, Any],
        per_token_logps: torch.Tensor,
        old: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        index: torch.Tensor | None,
        mode: str,
    ) -> torch.Tensor:
        """s̄ and s̃ of this micro-batch's rows (from the pre-pass, this forward, or gathered across processes),
        then the advantage / old-log-prob rewrite of the configured gradient form (module docstring). Returns
        the rows' two-sided flags (eq. C8) for the residual split."""
        args: DFPOConfig = self.args
        differentiate = not args.transform_stop_gradient and index is not None and torch.is_grad_enabled()
        if PRE_PASS_S_TILDE in inputs:  # layout 3: computed at this optimizer step's θ for whole groups
            weights = RowWeights(*(inputs[key] for key in PRE_PASS_KEYS))
        else:
            logps = per_token_logps if differentiate else per_token_logps.detach()
            with torch.set_grad_enabled(differentiate):
                s_bar, survives = self._post_clip_weights(logps, old, mask, advantages)
                factor = self._aggregation_factor(inputs, mask, mask.sum().expand(mask.size(0)))
                if index is not None:
                    weights = self._transform_groups(s_bar, advantages, survives, factor, index, mode)
                else:  # layout 2: the group's other members are on other processes in this micro-step
                    weights = self._transform_gathered_rows(inputs, s_bar, advantages, survives, factor, mode)
        self.last_sequence_weights = {"row_ids": inputs.get(ROW_IDS_KEY), **{
            key: value.detach() for key, value in weights._asdict().items()
        }}
        rewritten = sequence_level_inputs(
            per_token_logps, old, advantages, weights.s_bar, weights.s_tilde, weights.survives, weights.two_sided,
            score_form=args.transform_gradient == "score",
            differentiate=differentiate,
            transform_active=args.group_transform != "none",
            flip_to_score=args.cancellation_target == "gradient" and args.group_transform == "orth_proj",
        )
        inputs["advantages"] = rewritten.advantages
        if rewritten.old_per_token_logps is not None:
            inputs["old_per_token_logps"] = rewritten.old_per_token_logps
        return weights.two_sided

    def _transform_gathered_rows(
        self, inputs: dict[str, Any], s_bar: torch.Tensor, advantages: torch.Tensor, survives: torch.Tensor,
        factor: torch.Tensor, mode: str,
    ) -> RowWeights:
        rows = s_bar.size(0)
        row_ids = inputs.get(ROW_IDS_KEY)
        if row_ids is None:
            offset = self.accelerator.process_index * rows
            row_ids = torch.arange(offset, offset + rows, device=s_bar.device)
        all_ids, gathered = self._transform_across_processes(
            row_ids, self._group_ids(inputs, mode), s_bar, advantages, survives, factor, mode,
            equal_rows=self.group_layout == LAYOUT_REDISTRIBUTED and self.model.training,
        )
        position = positions_of(row_ids, all_ids)
        return RowWeights(
            s_bar, gathered.s_tilde[position].to(s_bar.dtype), survives, gathered.two_sided[position]
        )

    def _log_sequence_metrics(
        self, s_bar_g: torch.Tensor, s_tilde_g: torch.Tensor, adv_g: torch.Tensor, sides: GroupSides, mode: str
    ) -> None:
        """Group metrics of one (num_groups, G) batch, as device tensors pooled over groups (metric_store)."""
        store, groups = self.dfpo_metrics, s_bar_g.size(0)
        # eq. C8: the share of groups with signal that no per-sequence weight can balance
        store.add_mean(mode, "cancellation/one_sided_groups", sides.one_sided.sum(), sides.has_signal.sum())
        store.add_mean(mode, "asym/before", mech.asym(s_bar_g, adv_g) * groups, groups)
        store.add_mean(mode, "asym/after", mech.asym(s_tilde_g, adv_g) * groups, groups)
        store.add_mean(mode, "transform/orth_residual", mech.orth_residual(s_tilde_g, adv_g) * groups, groups)
        phi_min, phi_mean = mech.phi_stats(s_tilde_g, s_bar_g)
        store.add_min(mode, "transform/phi_min", phi_min, s_bar_g.numel())
        store.add_mean(mode, "transform/phi_mean", phi_mean * s_bar_g.numel(), s_bar_g.numel())

    def _watch_token_coefficients(
        self,
        per_token_logps: torch.Tensor,
        completion_ids: torch.Tensor,
        mask: torch.Tensor,
        index: torch.Tensor,
        two_sided: torch.Tensor | None,
        mode: str,
    ) -> None:
        """Measure shared-prefix cancellation from the exact scalar on ∇ℓ_{i,t}: the gradient of the loss
        w.r.t. the per-token log-probs, read in the backward pass TRL already runs (docs/metrics.md); also over the
        two-sided groups alone (docs/cancellation.md, eq. C8), where the gradient target cancels exactly."""
        store = self.dfpo_metrics
        shared = mech.shared_prefix_mask(completion_ids[index], mask[index])
        # One-sided groups' positions leave the two-sided residual (a mask, not boolean indexing: no host sync).
        subsets = () if two_sided is None else (two_sided[index[:, 0]].bool(),)

        def on_grad(grad: torch.Tensor) -> None:
            sums = mech.shared_prefix_residual_sums(grad.detach()[index], shared, *subsets)
            store.add_mean(mode, "cancellation/shared_prefix_residual", *sums[0])
            if subsets:
                store.add_mean(mode, "cancellation/shared_prefix_residual_two_sided", *sums[1])

        per_token_logps.register_hook(on_grad)

    # ---------------------------------------------------------------------------------- eq. 24 gradient energy
    def _energy_active(self) -> bool:
        """``log_energy_buckets`` on, and this is a training forward that will be differentiated."""
        return self.args.log_energy_buckets > 0 and self.model.training and torch.is_grad_enabled()

    def _watch_gradient_energy(
        self, model: torch.nn.Module, per_token_logps: torch.Tensor, inputs: dict[str, Any], capture: HiddenCapture
    ) -> None:
        """Energy on frequent tokens (eq. 24, docs/metrics.md): ‖∇_W ℓ_t‖ = |c_t| · ‖∂ log p_t/∂W‖ with the scale from
        this forward's h (no grad, the LM head gathered read-only under ZeRO-3) and c_t = ∂loss/∂log p_t read in
        the backward pass TRL already runs; logs each frequency bucket's share of Σ_t ‖∇_W ℓ_t‖."""
        hidden, capture.hidden = capture.hidden, None
        if hidden is None or not per_token_logps.requires_grad:
            return
        num_buckets = self.args.log_energy_buckets
        completion_ids = inputs["completion_ids"]
        mask = loss_mask(inputs)
        head = fused_lm_head(self.accelerator.unwrap_model(model))
        with gathered_for_reading(head.weight, head.bias):
            scale = mech.lm_head_grad_scale(
                hidden,
                head.weight,
                completion_ids,
                self.temperature,
                bias=head.bias,
                logit_scale=head.logit_scale,
                final_logit_softcapping=head.final_logit_softcapping,
            )
        del hidden
        bucket = mech.frequency_buckets(completion_ids, mask, num_buckets)
        store = self.dfpo_metrics

        def on_grad(grad: torch.Tensor) -> None:
            energy = grad.detach().float().abs() * scale.to(grad.device)
            sums = mech.energy_sums_by_bucket(energy, bucket.to(grad.device), num_buckets)
            total = sums.sum()  # each bucket's share of the energy pooled over micro-steps and processes
            for b in range(num_buckets):
                store.add_mean("train", f"energy/freq_bucket_{b}", sums[b], total)

        per_token_logps.register_hook(on_grad)
