"""``DFPOTrainer``: TRL's ``GRPOTrainer`` with DFPO's objectives, wired into TRL's hooks and nothing else.

``__init__`` builds the parts from the config: the objective's plan, the run's shape, the group layout and its
pre-pass, the metric store and DelTA's weighting. TRL's ``_compute_loss`` runs unchanged: right after its policy
forward, :func:`~dfpo_trl.objectives.step.micro_step_objective` turns the inputs TRL reads next into DFPO's objective
and :func:`~dfpo_trl.metrics.objective.log_micro_step` logs it (docs/source/concepts/architecture.md, "How a
micro-step flows"). Every touch point is declared and checked at import in :mod:`dfpo_trl.trl_hooks.compat`; each
DFPO part runs under a ``torch.profiler`` label of :data:`~dfpo_trl.profiling.PROFILE_LABELS`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from trl import GRPOTrainer

from .delta.rollout import DELTA_WEIGHTS_KEY
from .delta.weighting import DeltaWeighting
from .groups.choice import LAYOUT_PRE_PASS, choose_layout, describe_layout, refuse_multimodal_model
from .groups.layout import GroupDelivery
from .groups.prepass import PrePass
from .groups.shape import run_shape
from .metrics.clip import CLIP_RATIO_METRICS
from .metrics.hooks import energy_capture, watch_backward
from .metrics.objective import log_micro_step
from .metrics.step_reward import attach_row_rewards, log_step_reward, row_rewards
from .metrics.store import MetricStore
from .objectives.plan import ObjectivePlan
from .objectives.step import TRLLoss, WholeGroups, micro_step_objective
from .objectives.weights import loss_mask
from .profiling import profiled
from .rewards import SafeReward
from .trl_hooks.callback import DFPOCallback
from .trl_hooks.compat import (
    MULTIMODAL_KEYS,
    applied_is_ratio,
    applies_is_ratio,
    bind_call,
    check_one_value_each,
    check_rewrite_ran,
    check_trainer_attributes,
    disable_gradient_checkpointing,
    diverted_metrics,
    eval_forward_chunks,
    generate_every,
    off_policy_step,
    on_policy_identity_warning,
    trl_off_policy_keep,
    trl_runs_old_logps_forward,
)
from .trl_hooks.lm_head import HiddenCapture, capture_log_prob_forward
from .trl_hooks.model_card import DFPOModelCard, card_tags
from .trl_hooks.no_reward import held_no_reward_warning, one_line_no_reward_warning
from .trl_hooks.pending import PendingCall, chain_forwards, trainer_config
from .trl_hooks.resume import RolloutResume
from .trl_hooks.sampling_ratio import RatioWatch
from .trl_hooks.sampling_support import finish_rollout, rollout_kept_mass
from .trl_hooks.sync_watchdog import watched_vllm_generation

logger = logging.getLogger(__name__)


class DFPOTrainer(RolloutResume, DFPOModelCard, GRPOTrainer):
    """`trl.GRPOTrainer` with DFPO objectives. Takes the same arguments; `args` must be a [`DFPOConfig`] (built
    from the model's name, every DFPO option off, when not given, as `GRPOTrainer` builds its default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        arguments = bind_call("__init__", *args, **kwargs)
        arguments["args"] = config = trainer_config(arguments.get("args"), arguments["model"])
        # Before TRL's __init__, which tags the model with _tag_names (a hub push carries the model's tags).
        self._tag_names = card_tags(config.token_weighting)
        # In vLLM server mode TRL's set-up and weight sync run under a deadline (trl_hooks/sync_watchdog.py).
        with watched_vllm_generation(config.vllm_sync_timeout, config.vllm_generation_timeout):
            super().__init__(**arguments)
        check_trainer_attributes(self)
        for reward in self.reward_funcs:  # a failing reward's message names the completion's group
            if isinstance(reward, SafeReward):
                reward.group_size = self.num_generations
        self._pending: PendingCall | None = None  # see PendingCall
        self._unwrapped: tuple[torch.nn.Module, torch.nn.Module] | None = None  # see unwrapped_model
        self.plan = ObjectivePlan.from_config(self.args)
        if self.plan.form.grpo_fix:
            self.epsilon_low = 1.0  # clip(r, 1 - 1, 1 + eps_high) = clip(r, 0, 1 + eps_high): eq. 79's lower bound
        self.dfpo_metrics = MetricStore()  # device tensors until a logging step
        shape = run_shape(self)
        name = choose_layout(self.args, shape.num_processes)
        refuse_multimodal_model(name, self.plan.active_options, self.accelerator.unwrap_model(self.model),
                                self.processing_class)
        self.layout = GroupDelivery(name, shape, self.accelerator, self.plan.needs_groups, self.plan.active_options)
        self.pre_pass = PrePass(shape, self.plan, self.accelerator, self.dfpo_metrics,
                                self._get_per_token_logps_and_entropies, self.args.gradient_checkpointing_kwargs) \
            if name == LAYOUT_PRE_PASS else None
        # every process: the layout, why it was chosen and what it costs, in one line
        logger.info(describe_layout(name, self.args, shape.num_processes))
        self.delta_weighting = DeltaWeighting(self.args, shape, self.dfpo_metrics) if self.plan.uses_delta else None
        self.ratio_watch = RatioWatch()  # one line when TRL's vLLM IS ratio shrinks the loss (trl_hooks/sampling_ratio)
        warning = on_policy_identity_warning(self, self.plan.transform.name) if self.plan.rewrites_sequences else None
        if warning:
            logger.warning(warning)

    # help(), inspect.signature and IDEs show GRPOTrainer's own parameters, read from the installed TRL, not copied:
    # __init__ takes *args/**kwargs only to bind them against that same signature (bind_call).
    __init__.__signature__ = inspect.signature(GRPOTrainer.__init__)  # type: ignore[attr-defined]

    @property
    def group_layout(self) -> str:
        """The group layout this trainer resolved (docs/source/concepts/layouts.md): never ``"auto"``, unlike the config
        field of that name, which says what was asked for."""
        return self.layout.name

    @property
    def delta_token_table(self) -> list[dict[str, Any]]:
        """DelTA's latest table of highest/lowest-weighted tokens ([] when DelTA is off)."""
        return self.delta_weighting.token_table if self.delta_weighting is not None else []

    @contextmanager
    def _expecting(self, call: PendingCall) -> Iterator[PendingCall]:
        """Leave ``call`` for the TRL methods that TRL calls inside the ``with`` block; restored on the way out."""
        previous, self._pending = self._pending, call
        try:
            yield call
        finally:
            self._pending = previous

    # ------------------------------------------------------------------------------------------- rollout
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's rollout, plus DelTA's λ̄, each row's reward and its explicit group and row ids; the first rollout
        whose vLLM importance-sampling ratio would shrink the loss gets one line (trl_hooks/sampling_ratio.py); TRL's
        ratio against vLLM's truncated support where asked (trl_hooks/sampling_support.py)."""
        training = self.model.training
        weigh = self.delta_weighting is not None and training
        capture = HiddenCapture() if weigh and trl_runs_old_logps_forward(self) else None
        kept = rollout_kept_mass(self)  # outermost: DelTA's capture reads the untruncated log-probs
        on_forward = chain_forwards(kept.run if kept else None,
                                    partial(capture_log_prob_forward, capture) if capture else None)
        with self._expecting(PendingCall(on_forward, self.model)) as call:
            output = super()._generate_and_score_completions(inputs)
        if kept is not None:
            finish_rollout(output, kept, loss_mask(output), "train" if training else "eval",
                           self.vllm_importance_sampling_mode, self.dfpo_metrics)
        if weigh:
            hidden = capture if capture is not None and capture.done else self.capture_hidden_states(output)
            self.delta_weighting.weigh(output, hidden, loss_mask(output), self.state, self.processing_class)
        if training:
            self.ratio_watch.check(output, loss_mask(output), self.args, self.accelerator)
        attach_row_rewards(output, call.rewards, self.accelerator.process_index)
        self.layout.add_ids(output, "train" if self.model.training else "eval")
        return output

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> torch.Tensor:
        """TRL's rewards; TRL's warning for completions no reward scores comes as one line with their count, and the
        run trains on as TRL's does (trl_hooks/no_reward.py): a rollout no reward applies to teaches nothing."""
        with held_no_reward_warning() as held:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if held:
            unscored = int(torch.isnan(rewards_per_func).all(dim=1).sum())
            one_line_no_reward_warning(held[0], unscored, rewards_per_func.shape[0])
        if self._pending is not None:
            self._pending.rewards = row_rewards(rewards_per_func, self.reward_weights)
        return rewards_per_func

    def capture_hidden_states(self, batch: dict[str, Any], batch_size: int | None = None) -> HiddenCapture:
        """h (the LM-head input) and log p of a rollout batch's completion tokens from one no-grad policy forward
        through TRL's log-prob helper, in chunks of ``batch_size`` rows (DelTA's forward when TRL runs none)."""
        capture = HiddenCapture()
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        extra = {key: batch[key] for key in MULTIMODAL_KEYS if key in batch}
        with self._expecting(PendingCall(partial(capture_log_prob_forward, capture), self.model)), torch.no_grad(), \
                disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            self._get_per_token_logps_and_entropies(
                model=self.model, input_ids=input_ids, attention_mask=attention_mask,
                logits_to_keep=batch["completion_ids"].size(1),
                batch_size=batch_size or self.args.per_device_train_batch_size, **extra,
            )
        return capture

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's buffering, with each rollout regrouped for the layout and, in the pre-pass layout, the pre-pass's
        one call (it runs at the first micro-step of each optimizer step: groups/prepass.py)."""
        with profiled("dfpo/prepare_inputs"):
            regenerated = self.model.training and (
                self._step % generate_every(self) == 0 or self._buffered_inputs is None
            )
            inputs = super()._prepare_inputs(generation_batch)
            if not self.model.training:
                return inputs
            if regenerated:
                self._buffered_inputs = self.layout.regroup(self._buffered_inputs, self.state.global_step)
            if self.pre_pass is not None:  # s̄ and s̃ at the optimizer step's θ, attached to its micro-batches
                values = self.pre_pass.before_micro_step(self._buffered_inputs, self._step, self.model,
                                                         self._trl_loss(), applies_is_ratio(self))
                if values is not None:  # it ran: the first micro-step of an optimizer step
                    self._call_dfpo_callbacks("on_pre_pass", values=values)
            return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _trl_loss(self) -> TRLLoss:
        """TRL's loss settings as its loss reads them now; its off-policy mask through this trainer's
        ``get_off_policy_mask`` (None when off)."""
        threshold = self.off_policy_mask_threshold
        keep = None if threshold is None else partial(trl_off_policy_keep, self.get_off_policy_mask, threshold)
        return TRLLoss(self.epsilon_low, self.epsilon_high, self.args.delta, keep)

    # ---------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss on a shallow copy of ``inputs`` that DFPO rewrites right after the policy forward pass; where
        the rewrite is active, TRL's clip fractions of this call (counted on the rewritten inputs) go to a sink and
        DFPO's count, pending in its store, is the one logged (metrics/clip.py)."""
        with profiled("dfpo/compute_loss"):
            inputs = dict(inputs)  # the buffered rollout is reused across iterations: never mutate it
            if self.model.training:
                with profiled("dfpo/log_step_reward"):
                    log_step_reward(self.dfpo_metrics, inputs)
            mode = "train" if self.model.training else "eval"
            recount = diverted_metrics(self._metrics, mode, CLIP_RATIO_METRICS) \
                if self.plan.recounts_clip_fractions else nullcontext()
            rewrite = PendingCall(partial(self._rewrite_after_forward, inputs))
            with recount as trl_counts, self._expecting(rewrite) as call:
                loss = super()._compute_loss(model=model, inputs=inputs)
            check_rewrite_ran(call.on_forward, self.plan.active_options)
            if trl_counts is not None:
                check_one_value_each(trl_counts)  # then dropped
            return loss

    def _get_per_token_logps_and_entropies(self, model: torch.nn.Module, *args: Any, **kwargs: Any):
        """TRL's helper; the first policy forward inside a DFPO override also runs what that override left. In
        evaluation, in chunks of the training's batch (trl_hooks/compat.py, eval_forward_chunks)."""
        with profiled("dfpo/get_per_token_logps_and_entropies"):
            kwargs = eval_forward_chunks(self, args, kwargs)
            forward = partial(super()._get_per_token_logps_and_entropies, model, *args, **kwargs)
            call = self._pending
            if call is None or call.on_forward is None or (call.model is not None and model is not call.model):
                return forward()
            on_forward, call.on_forward = call.on_forward, None
            return on_forward(self.unwrapped_model(model), ((model, *args), kwargs), forward)

    def unwrapped_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``accelerator.unwrap_model(model)``, computed once per wrapper object: accelerate walks every submodule
        and probes for packages on each call (docs/source/concepts/decisions.md, "The loss path's cost")."""
        if self._unwrapped is None or self._unwrapped[0] is not model:
            self._unwrapped = (model, self.accelerator.unwrap_model(model))
        return self._unwrapped[1]

    def _rewrite_after_forward(self, inputs: dict[str, Any], model: torch.nn.Module, arguments: Any, forward: Any):
        """The loss's policy forward (h kept for the energy metric when it is on), DFPO's objective written into the
        inputs TRL reads next and its metrics logged, then the backward hooks of the token-coefficient metrics."""
        with profiled("dfpo/rewrite_after_forward"):
            plan, training = self.plan, self.model.training
            mode = "train" if training else "eval"
            capture = energy_capture(plan.energy_buckets, training)
            out = forward() if capture is None else capture_log_prob_forward(capture, model, arguments, forward)
            logps, mask, advantages = out[0], loss_mask(inputs), inputs["advantages"]
            groups = self.layout.whole_groups(inputs, mode) if plan.needs_groups else WholeGroups()
            with profiled("dfpo/micro_step_objective"):
                step = micro_step_objective(
                    plan, logps, inputs.get("old_per_token_logps"), advantages, mask, groups, self._trl_loss(),
                    sampling=inputs.get("sampling_per_token_logps"), is_ratio=applied_is_ratio(self, inputs),
                    lambda_bar=inputs.get(DELTA_WEIGHTS_KEY) if plan.uses_delta else None,
                )
            self._call_dfpo_callbacks("on_micro_step", step=step)
            inputs["advantages"] = step.loss_inputs.advantages
            if step.loss_inputs.old_per_token_logps is not None:
                inputs["old_per_token_logps"] = step.loss_inputs.old_per_token_logps
            with profiled("dfpo/log_micro_step"):
                log_micro_step(self.dfpo_metrics, mode, step, advantages, mask, plan, training=training,
                               off_policy=training and off_policy_step(self))
            watch_backward(self.dfpo_metrics, mode, plan, model, logps, inputs, mask, groups.index,
                           step.values.weights, capture, self.temperature)
            return out

    def _call_dfpo_callbacks(self, event: str, **values: Any) -> None:
        """Hand DFPO's values to each :class:`~dfpo_trl.trl_hooks.callback.DFPOCallback` among the trainer's
        callbacks, as transformers hands its own events: an observer reads them without replacing a name."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, DFPOCallback):
                getattr(callback, event)(self.args, self.state, self.control, **values)

    # ------------------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, after DFPO's metrics are reduced over every process and handed to TRL's averaging."""
        with profiled("dfpo/log"):
            self.flush_dfpo_metrics("train" if self.model.training else "eval")
            super().log(logs, start_time)

    def flush_dfpo_metrics(self, mode: str = "train") -> None:
        """Move DFPO's pending metrics of ``mode`` into TRL's ``_metrics`` (collective: every process calls it)."""
        with profiled("dfpo/flush_metrics"):
            self.dfpo_metrics.flush_into(self._metrics[mode], mode, self.accelerator)
