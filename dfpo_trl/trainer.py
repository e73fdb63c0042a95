"""``DFPOTrainer``: TRL's ``GRPOTrainer`` with DFPO's in-group transforms, GRPO-fix and mechanism metrics.

The trainer only wires the pure modules (``transforms``, ``metrics``, ``layout``) into TRL. It never
re-implements TRL's loss: TRL's own ``_compute_loss`` runs unchanged, and DFPO enters through the two inputs
that TRL reads *after* its policy forward pass, the advantages and the old log-probabilities:

* ratio form (DESIGN.md §3): advantages Â_i → Â_i φ_i with φ_i = s̃_i / s̄_i under stop-gradient. For φ_i ≥ 0,
  TRL's -min(s Â φ, c Â φ) = -φ Â s̄(θ), which is eq. 59–62; φ ≡ 1 for ``"none"``, so that is GSPO exactly.
* score form: old log-probs → the detached current ones (ratio 1 in value, ∇ρ in gradient, never clipped) and
  advantages → Â_i s̃_i, so the policy term is -Â_i sg(s̃_i) ρ_i(θ) (eq. 16/68/85).
* GRPO-fix (Appendix H): ε_low := 1 turns TRL's clip into clip(r, 0, 1+ε_high) for Â ≥ 0; for Â < 0 tokens
  with r > 1+ε_high the old log-prob is rewritten so that r is the constant 1+ε_high (zero gradient), which
  makes the weight the same operator for both signs (eq. 79–80).

β-KL, the vLLM importance-sampling correction, the entropy bonus, ``top_entropy_quantile``, truncation
masking and ``delta`` clipping are TRL's code paths and apply on top unchanged.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from . import metrics as mech
from .config import DFPOConfig
from .layout import (
    GROUP_IDS_KEY,
    concat_sequence_dicts,
    consecutive_group_ids,
    group_granular_order,
    group_index,
    permute_sequence_dict,
    scatter_from_groups,
)
from .transforms import apply_group_transform, sequence_log_ratio, sign_aware_post_clip

logger = logging.getLogger(__name__)

LAYOUT_GROUP_GRANULAR = "group_granular"
LAYOUT_PER_SAMPLE = "per_sample"
MAX_LOG_RATIO = 20.0


class DFPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with DFPO objectives. Takes the same arguments; `args` must be a [`DFPOConfig`]."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None and not isinstance(config, DFPOConfig):
            raise TypeError(
                f"DFPOTrainer needs args=DFPOConfig(...), got {type(config).__name__}; DFPOConfig takes every "
                "GRPOConfig field plus the DFPO ones."
            )
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DFPOConfig):
            raise TypeError("DFPOTrainer needs args=DFPOConfig(...).")
        self._dfpo_pending: dict[str, Any] | None = None
        if self.args.symmetric_clip:
            # clip(r, 1 - 1, 1 + eps_high) = clip(r, 0, 1 + eps_high): the lower bound of eq. 79.
            self.epsilon_low = 1.0
        self.group_layout = self._choose_group_layout()
        logger.info("DFPO group layout: %s", self.group_layout)
        if self.args.sequence_rewrite_active and not self._is_off_policy():
            logger.warning(
                "group_transform=%r runs on-policy (steps_per_generation <= gradient_accumulation_steps, "
                "num_iterations=1, no vLLM importance sampling): every post-clip weight is 1 and the transform "
                "is the identity. Raise steps_per_generation or num_iterations for it to act.",
                self.args.group_transform,
            )

    # ----------------------------------------------------------------------------------------------- layout
    def _is_off_policy(self) -> bool:
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _choose_group_layout(self) -> str:
        """Whole groups in every micro-batch when the batch sizes allow it; refuse transforms otherwise."""
        per_device = self.args.per_device_train_batch_size
        group_size = self.num_generations
        if per_device % group_size == 0 and self.accelerator.num_processes == 1:
            return LAYOUT_GROUP_GRANULAR
        if per_device % group_size == 0:
            # Local generation batches hold whole groups because TRL slices the global batch in blocks of
            # per_device * steps_per_generation rows, a multiple of G.
            return LAYOUT_GROUP_GRANULAR
        if self.args.sequence_rewrite_active:
            raise ValueError(
                f"group_transform={self.args.group_transform!r} needs every group's {group_size} completions in "
                f"the same micro-batch, but per_device_train_batch_size={per_device} is not a multiple of "
                f"num_generations={group_size}: groups would be cut apart. Set per_device_train_batch_size to a "
                f"multiple of {group_size} (and lower steps_per_generation or gradient_accumulation_steps to "
                "keep the generation batch)."
            )
        return LAYOUT_PER_SAMPLE

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's rollout, plus an explicit group id per row (global row // G, as TRL's sampler lays rows out)."""
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        local_rows = output["prompt_ids"].size(0)
        output[GROUP_IDS_KEY] = consecutive_group_ids(
            local_rows, group_size, offset=self.accelerator.process_index * local_rows,
            device=output["prompt_ids"].device,
        )
        return output

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's buffering, with its per-sample shuffle replaced by a group-granular one (DESIGN.md §4)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        regenerated = self.model.training and (
            self._step % generate_every == 0 or self._buffered_inputs is None
        )
        inputs = super()._prepare_inputs(generation_batch)
        if regenerated and self.group_layout == LAYOUT_GROUP_GRANULAR:
            full = concat_sequence_dicts(self._buffered_inputs)
            full = permute_sequence_dict(full, group_granular_order(full[GROUP_IDS_KEY]))
            self._buffered_inputs = split_tensor_dict(full, self.args.steps_per_generation)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    # ------------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss on a shallow copy of ``inputs`` that DFPO rewrites right after the policy forward pass."""
        inputs = dict(inputs)  # the buffered rollout is reused across iterations: never mutate it
        self._dfpo_pending = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._dfpo_pending = None

    def _get_per_token_logps_and_entropies(self, model: torch.nn.Module, *args: Any, **kwargs: Any):
        """TRL's helper; on the loss's policy forward, also rewrite the inputs TRL reads next (see module doc)."""
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        pending, self._dfpo_pending = self._dfpo_pending, None
        if pending is not None:
            self._rewrite_loss_inputs(pending, logps)
        return logps, entropies, aux_loss

    def _group_index(self, inputs: dict[str, Any], mode: str) -> torch.Tensor | None:
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        group_ids = inputs.get(GROUP_IDS_KEY)
        if group_ids is None:  # a hand-built batch: consecutive blocks of num_generations
            rows = inputs["completion_ids"].size(0)
            group_ids = consecutive_group_ids(rows, group_size, device=inputs["completion_ids"].device)
        if self.group_layout != LAYOUT_GROUP_GRANULAR and not self.args.sequence_rewrite_active:
            return None  # groups are not whole here; metrics that need them are skipped
        return group_index(group_ids, group_size)

    def _rewrite_loss_inputs(self, inputs: dict[str, Any], per_token_logps: torch.Tensor) -> None:
        args: DFPOConfig = self.args
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        if old is not None:
            old = self._bounded_old_logps(per_token_logps, old, mask)
            inputs["old_per_token_logps"] = old
        else:
            old = per_token_logps.detach()
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError("DFPO needs one advantage per sequence (shape (B,)), as TRL's rollout produces.")

        if args.symmetric_clip:
            inputs["old_per_token_logps"] = self._symmetric_clip_old_logps(per_token_logps, old, advantages, mode)
        index = None
        if args.log_mechanism_metrics or args.sequence_rewrite_active:
            index = self._group_index(inputs, mode)
        if self.importance_sampling_level == "sequence" and index is not None:
            self._rewrite_sequence_level(inputs, per_token_logps, old, mask, advantages, index, mode)
        if args.log_mechanism_metrics and index is not None and per_token_logps.requires_grad:
            self._watch_token_coefficients(per_token_logps, inputs["completion_ids"], mask, index, mode)

    def _bounded_old_logps(
        self, per_token_logps: torch.Tensor, old: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Shift the old log-probs so that TRL's log-ratio (ρ_i at sequence level, per token otherwise) lies in
        ±MAX_LOG_RATIO: exp() never overflows and Â = 0 rows never give inf·0. Gradients are unchanged; values
        change only where the log-ratio was beyond e^±20 (DESIGN.md §2, "clamp log-ratios before exp")."""
        log_ratio = per_token_logps.detach() - old
        if self.importance_sampling_level == "sequence":
            rho = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            excess = rho - rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            if not bool((excess != 0).any()):
                return old
            return old + excess.unsqueeze(1) * mask
        excess = log_ratio - log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        if not bool((excess != 0).any()):
            return old
        return old + excess

    def _symmetric_clip_old_logps(
        self, per_token_logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mode: str
    ) -> torch.Tensor:
        """GRPO-fix for Â < 0: freeze r at 1+ε_high (value kept, gradient 0) where r > 1+ε_high (eq. 79)."""
        log_cap = math.log1p(self.epsilon_high)
        over = (advantages < 0).unsqueeze(1) & ((per_token_logps.detach() - old) > log_cap)
        self._metrics[mode]["grpo_fix/negative_capped_fraction"].append(
            over.float().mean().item() if over.numel() else 0.0
        )
        # For capped tokens: log r = logp - (logp - log_cap) = log_cap exactly, with no gradient path left.
        return torch.where(over, per_token_logps - log_cap, old)

    def _rewrite_sequence_level(
        self,
        inputs: dict[str, Any],
        per_token_logps: torch.Tensor,
        old: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        index: torch.Tensor,
        mode: str,
    ) -> None:
        args: DFPOConfig = self.args
        differentiate = not args.transform_stop_gradient
        logps = per_token_logps if differentiate else per_token_logps.detach()
        with torch.set_grad_enabled(differentiate and torch.is_grad_enabled()):
            rho = sequence_log_ratio(logps, old, mask)
            s = torch.exp(rho)
            s_bar = sign_aware_post_clip(s, advantages, self.epsilon_low, self.epsilon_high)
            adv_g = advantages[index].to(s_bar.dtype)
            s_bar_g = s_bar[index]
            s_tilde_g = apply_group_transform(
                args.group_transform,
                s_bar_g,
                adv_g,
                scale_factor=args.transform_scale,
                truncate_floor=args.transform_truncate_floor,
            )
            s_tilde = scatter_from_groups(s_tilde_g, index)
        if args.log_mechanism_metrics:
            self._log_sequence_metrics(s_bar_g.detach(), s_tilde_g.detach(), adv_g.detach(), mode)
        if args.transform_gradient == "score":
            # coef_1 = exp(ρ - sg(ρ)) = 1 in value, ∇ρ in gradient: never clipped, -Â sg(s̃) ρ(θ) after TRL's min.
            inputs["old_per_token_logps"] = per_token_logps.detach()
            inputs["advantages"] = advantages * s_tilde.detach().to(advantages.dtype)
        elif differentiate:
            # -min(s Â s̃/s̄, c Â s̃/s̄) = -Â s̃(θ) on both branches: the transform is differentiated.
            inputs["advantages"] = advantages * (s_tilde / s_bar).to(advantages.dtype)
        elif args.group_transform != "none":
            phi = s_tilde / s_bar
            inputs["advantages"] = advantages * phi.to(advantages.dtype)

    def _log_sequence_metrics(
        self, s_bar_g: torch.Tensor, s_tilde_g: torch.Tensor, adv_g: torch.Tensor, mode: str
    ) -> None:
        store = self._metrics[mode]
        store["asym/before"].append(mech.asym(s_bar_g, adv_g).item())
        store["asym/after"].append(mech.asym(s_tilde_g, adv_g).item())
        store["transform/orth_residual"].append(mech.orth_residual(s_tilde_g, adv_g).item())
        phi_min, phi_mean = mech.phi_stats(s_tilde_g, s_bar_g)
        store["transform/phi_min"].append(float(phi_min))
        store["transform/phi_mean"].append(float(phi_mean))

    def _watch_token_coefficients(
        self,
        per_token_logps: torch.Tensor,
        completion_ids: torch.Tensor,
        mask: torch.Tensor,
        index: torch.Tensor,
        mode: str,
    ) -> None:
        """Measure shared-prefix cancellation from the exact scalar on ∇ℓ_{i,t}: the gradient of the loss
        w.r.t. the per-token log-probs, read in the backward pass TRL already runs (DESIGN.md §6)."""
        ids_g, mask_g = completion_ids[index], mask[index]
        if not bool(mech.shared_prefix_mask(ids_g, mask_g).any()):
            return
        store = self._metrics[mode]

        def on_grad(grad: torch.Tensor) -> None:
            value, count = mech.shared_prefix_residual(grad.detach()[index].float(), ids_g, mask_g)
            if int(count) > 0:
                store["cancellation/shared_prefix_residual"].append(float(value))

        per_token_logps.register_hook(on_grad)
