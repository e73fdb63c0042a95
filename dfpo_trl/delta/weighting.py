"""DeltaWeighting: DelTA's component of the trainer, λ̄ of each training rollout from h, attached and logged.

With ``token_weighting="delta"``, once per *training* rollout batch, after TRL has computed the advantages
(docs/source/concepts/delta.md):

* h, the final hidden state that feeds the LM head, is read by a forward hook on the backbone whose
  ``last_hidden_state`` TRL's fused LM head consumes (:class:`~dfpo_trl.trl_hooks.lm_head.HiddenCapture`; the
  output of the decoder's final norm, logits never exist in full). The trainer hooks it around one policy
  log-prob forward: TRL's own old-log-prob forward when TRL runs it
  (:func:`~dfpo_trl.trl_hooks.compat.trl_runs_old_logps_forward`: off-policy, vLLM importance sampling: zero
  extra forwards), otherwise one no-grad forward through TRL's ``_get_per_token_logps_and_entropies``
  (``DFPOTrainer.capture_hidden_states``: on-policy, one extra forward).
  That forward also gives p = exp(log p) of every sampled token at the rollout-time parameters. TRL scores the
  last T positions of ``log_probs``, whose position j is predicted from hidden position j, so completion token t
  uses ``last_hidden_state[:, -(T+1) + t]``.
* :meth:`DeltaWeighting.weigh` computes λ and λ̄ (:func:`~dfpo_trl.delta.rollout._rollout_weights`; statistics
  all-reduced over processes unless ``delta_scope="process"``) and stores λ̄ per row in ``output["delta_weights"]``
  (B, T). TRL's buffering, shuffling and splitting carry it with its row, so the weights stay fixed across
  ``num_iterations``; the loss-input rewrite applies it (eq. DelTA-weighted-objective).
* It logs ``delta/lambda_{pos,neg}_mean`` and ``delta/lambda_bar_{pos,neg}_mean`` through the metric store every
  rollout, and the table of highest/lowest-weighted tokens (``token_table``) at the first rollout of each logging
  interval.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..groups.ids import DELTA_RANDOM_STREAM, rollout_generator
from ..groups.shape import RunShape
from ..metrics.store import MetricStore
from ..trl_hooks.lm_head import HiddenCapture
from .rollout import (
    DELTA_WEIGHTS_KEY,
    _rollout_weights,
    format_token_table,
    side_means,
    sum_over_processes,
    token_table,
    weight_reducer,
)

if TYPE_CHECKING:
    from ..config import DFPOConfig

__all__ = ["DeltaWeighting"]

logger = logging.getLogger(__name__)


class DeltaWeighting:
    """DelTA token weighting of one run: its ``config`` (the DelTA options), ``shape`` (seed, process index and
    count) and the metric ``store``. ``token_table`` holds the latest table of highest/lowest-weighted tokens (made
    at logging steps)."""

    def __init__(self, config: DFPOConfig, shape: RunShape, store: MetricStore) -> None:
        self.config, self.shape, self.store = config, shape, store
        self.token_table: list[dict[str, Any]] = []
        self._last_table_step: int | None = None

    def weigh(
        self, output: dict[str, Any], capture: HiddenCapture, mask: Tensor, state: Any, processing_class: Any
    ) -> None:
        """λ̄ of a training rollout from the h and log p of its ``capture``, stored in ``output["delta_weights"]``
        (B, T). ``mask``: the rollout's loss mask (B, T); ``state``: TRL's ``TrainerState`` (the optimizer step, and
        the logging interval: the token table is made at the first rollout of each, its token ids decoded with
        ``processing_class``)."""
        config, shape = self.config, self.shape
        step = int(state.global_step)
        table_every = max(1, int(getattr(state, "logging_steps", 0) or config.logging_steps or 1))
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        assert capture.hidden is not None and capture.logps is not None
        advantages = output["advantages"]
        hidden, capture.hidden = capture.hidden, None  # the (B, T, d) copy lives only until the weights exist
        generator = None
        if config.delta_random:  # seeded per rollout: no state a checkpoint would have to save
            generator = rollout_generator(shape.seed, shape.process_index, step, stream=DELTA_RANDOM_STREAM,
                                          device=hidden.device)
        raw, weights = _rollout_weights(
            hidden, capture.logps.float(), advantages, mask, config,
            all_reduce=weight_reducer(config, shape.num_processes), generator=generator,
        )
        del hidden
        output[DELTA_WEIGHTS_KEY] = weights.to(advantages.device)
        self._log(raw, weights, advantages, mask, output["completion_ids"], step, table_every,
                  lambda i: tokenizer.decode([i]))

    def _log(
        self, raw: Tensor, weights: Tensor, advantages: Tensor, mask: Tensor, completion_ids: Tensor, step: int,
        every: int, decode: Callable[[int], str],
    ) -> None:
        """``delta/lambda_{pos,neg}_mean`` (λ ∈ [λ_min, λ_max]) and ``delta/lambda_bar_{pos,neg}_mean`` (after
        self-normalisation): each rollout's mean over every process's tokens of the side (one collective), logged
        as the mean over the interval's rollouts whose side has tokens; the token table at the first rollout of
        each logging interval."""
        all_reduce = sum_over_processes if self.shape.num_processes > 1 else None  # whatever delta_scope
        adv = advantages.to(raw.device)
        means = side_means(torch.stack([raw, weights.to(raw.device)]), adv, mask, all_reduce)  # [pos, neg]
        for label, row in zip(("lambda", "lambda_bar"), means, strict=True):
            for side, value in zip(("pos", "neg"), row, strict=True):
                has_tokens = ~torch.isnan(value)  # a device flag: no host read per rollout
                self.store.add_mean("train", f"delta/{label}_{side}_mean", torch.where(has_tokens, value, 0.0),
                                    has_tokens.to(value.dtype))
        if self._last_table_step is not None and step // every <= self._last_table_step // every:
            return
        self._last_table_step = step
        self.token_table = token_table(raw, completion_ids.to(raw.device), adv, mask.to(raw.device), decode)
        if self.token_table and self.shape.process_index == 0:
            logger.info("DelTA token weights at step %d (this process's rollout):\n%s", step,
                        format_token_table(self.token_table))
