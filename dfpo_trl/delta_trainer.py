"""DelTA token weights wired into ``DFPOTrainer`` (docs/delta.md).

``DeltaMixin`` sits between ``DFPOTrainer`` and ``trl.GRPOTrainer`` in the method resolution order. With
``token_weighting="delta"``, once per *training* rollout batch, after TRL has computed the advantages:

* h, the final hidden state that feeds the LM head, is read by a forward hook on the backbone whose
  ``last_hidden_state`` TRL's fused LM head consumes (the output of the decoder's final norm; logits never
  exist in full). The hook is registered only around one policy log-prob forward: TRL's own old-log-prob
  forward when TRL runs it (off-policy, vLLM importance sampling: zero extra forwards), otherwise one no-grad
  forward through TRL's ``_get_per_token_logps_and_entropies`` (on-policy: one extra forward, never three).
  That forward also gives p = exp(log p) of every sampled token at the rollout-time parameters.
* Alignment: TRL scores the last ``logits_to_keep`` = T positions of ``log_probs``, whose position j is
  predicted from hidden position j; so completion token t uses ``last_hidden_state[:, -(T+1) + t]``.
* λ and λ̄ = ``dfpo_trl.delta.delta_weights`` (v = (1 − p) h, the rules of the config's ``delta_*`` fields;
  statistics all-reduced over processes unless ``delta_scope="process"``), λ̄ self-normalised over the loss's
  normalisation domain (:func:`normalisation_domain`) and 0 outside the loss mask, stored per row in
  ``output["delta_weights"]`` (B, T). On one process with ``loss_type="dapo"`` this is exactly
  ``dfpo_trl.delta.delta_token_weights``. TRL's buffering, shuffling and splitting carry it with its row, so the
  weights stay fixed across ``num_iterations``.
* In the loss, ``apply_delta_weights`` turns TRL's advantages into Â_i λ̄_{i,t} (shape (B, T), which TRL's
  ``_compute_loss`` accepts). Since λ̄ > 0, -min(r Â λ̄, clip(r) Â λ̄) = -λ̄ min(r Â, clip(r) Â): a stop-gradient
  per-token multiplier on TRL's clipped surrogate (eq. DelTA-weighted-objective). The β-KL term and the
  entropy bonus are not weighted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .delta import delta_weights, self_normalise
from .layout import rollout_generator
from .lm_head import HiddenCapture, capture_log_prob_forward
from .loss_inputs import loss_mask
from .trl_compat import MULTIMODAL_KEYS, disable_gradient_checkpointing, trl_runs_old_logps_forward

logger = logging.getLogger(__name__)

DELTA_WEIGHTS_KEY = "delta_weights"
TOKEN_TABLE_SIZE = 10
DOMAIN_SEQUENCE = "sequence"  # loss_type="grpo": per-sequence token mean
DOMAIN_MICRO_BATCH = "micro_batch"  # loss_type="bnpo": token mean of the local micro-batch
DOMAIN_ROLLOUT = "rollout"  # loss_type="dapo" / "dr_grpo": tokens of the whole (global) rollout batch
Reducer = Callable[[Tensor], Tensor]


def normalisation_domain(loss_type: str) -> str:
    """Where λ̄ must average 1 so that the loss's own normaliser is kept (DelTA's λ̄ = λ N / Z, docs/delta.md step 6).

    ``grpo`` divides each sequence by its length: per sequence. ``bnpo`` divides the micro-batch by its
    (local) token count: per micro-batch, done at loss time. ``dapo`` divides by the token count of the whole
    generation batch over all processes, ``dr_grpo`` by a constant: over the global rollout batch.
    """
    if loss_type == "grpo":
        return DOMAIN_SEQUENCE
    if loss_type == "bnpo":
        return DOMAIN_MICRO_BATCH
    if loss_type in ("dapo", "dr_grpo"):
        return DOMAIN_ROLLOUT
    raise ValueError(f"token_weighting='delta' has no normalisation domain for loss_type={loss_type!r}.")


def sum_over_processes(t: Tensor) -> Tensor:
    """The ``all_reduce`` hook of ``dfpo_trl.delta``: element-wise sum over every process (in place)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def weight_reducer(args: Any, num_processes: int) -> Reducer | None:
    """The ``all_reduce`` of the weights' statistics: over every process for ``delta_scope="global"``, none (each
    process's shard alone, the released code's scope) for ``"process"`` or a single process."""
    if num_processes > 1 and args.delta_scope == "global":
        return sum_over_processes
    return None


def rollout_weights(
    hidden: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    args: Any,
    *,
    all_reduce: Reducer | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """λ (B, T) of one rollout batch and λ̄, λ self-normalised over the rollout-time domain of ``args.loss_type``.

    Per sequence for ``grpo``; over the whole rollout batch (all processes through ``all_reduce``) for
    ``dapo``, ``dr_grpo`` and ``bnpo`` (whose micro-batch normalisation is redone at loss time by
    :func:`apply_delta_weights`). ``args`` is the ``DFPOConfig`` whose ``delta_*`` fields choose the rules.
    """
    per_sequence = normalisation_domain(args.loss_type) == DOMAIN_SEQUENCE
    return delta_weights(
        hidden, logprobs, advantages, mask, args, per_sequence=per_sequence, all_reduce=all_reduce,
        generator=generator,
    )


def apply_delta_weights(inputs: dict[str, Any], mask: Tensor, loss_type: str) -> None:
    """Â_i → Â_i λ̄_{i,t} in a loss-input dict that carries ``delta_weights`` (no-op otherwise).

    For ``bnpo`` λ̄ is first renormalised to average 1 over this micro-batch's loss tokens, the domain of
    bnpo's normaliser. Must run after everything that reads the 1-D advantages.
    """
    weights = inputs.get(DELTA_WEIGHTS_KEY)
    if weights is None:
        return
    if normalisation_domain(loss_type) == DOMAIN_MICRO_BATCH:
        weights = self_normalise(weights, mask)
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    inputs["advantages"] = advantages * weights.to(device=advantages.device, dtype=advantages.dtype)


def side_means(values: Tensor, advantages: Tensor, mask: Tensor, all_reduce: Reducer | None = None) -> Tensor:
    """Means of ``values`` ((B, T), or (k, B, T) for k quantities at once) over the loss tokens of the Â > 0
    and the Â < 0 rows, global through ``all_reduce`` (one collective): shape (2,) or (k, 2), [pos, neg],
    NaN for an empty side."""
    v = values.detach().to(torch.float64)
    single = v.dim() == 2
    if single:
        v = v.unsqueeze(0)
    m = (mask != 0).to(device=v.device, dtype=torch.float64)
    adv = advantages.to(v.device)
    sides = torch.stack([(adv > 0)[:, None] * m, (adv < 0)[:, None] * m])  # (2, B, T)
    sums = torch.einsum("kbt,sbt->ks", v, sides)
    stats = torch.cat([sums.reshape(-1), sides.sum((1, 2))])
    if all_reduce is not None:
        stats = all_reduce(stats)
    sums, counts = stats[:-2].view(-1, 2), stats[-2:]
    means = torch.where(counts > 0, sums / counts.clamp_min(1.0), torch.full_like(sums, float("nan")))
    return means[0] if single else means


def token_table(
    weights: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    mask: Tensor,
    decode: Callable[[int], str],
    k: int = TOKEN_TABLE_SIZE,
) -> list[dict[str, Any]]:
    """The ``k`` token ids with the highest and the ``k`` with the lowest mean λ over the weighted tokens
    (loss tokens of Â ≠ 0 rows) of a batch: rows ``{"rank", "token", "token_id", "mean_lambda", "count"}``.
    The paper's Figure 4 reports reasoning tokens ("prime", "=y", "forward") high and entity names low."""
    active = (mask != 0) & (advantages != 0)[:, None]
    ids, w = completion_ids[active], weights.detach()[active].to(torch.float64)
    if ids.numel() == 0:
        return []
    unique, inverse = torch.unique(ids, return_inverse=True)
    sums = torch.zeros(unique.numel(), dtype=torch.float64, device=w.device).index_add_(0, inverse, w)
    counts = torch.zeros_like(sums).index_add_(0, inverse, torch.ones_like(w))
    means = sums / counts
    order = torch.argsort(means, descending=True, stable=True).tolist()
    k = min(k, len(order))
    rows = []
    for rank, positions in (("high", order[:k]), ("low", order[::-1][:k])):
        for p in positions:
            tid = int(unique[p])
            rows.append(
                {"rank": rank, "token": decode(tid), "token_id": tid, "mean_lambda": float(means[p]),
                 "count": int(counts[p])}
            )
    return rows


def format_token_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'rank':<5} {'mean λ':>7} {'count':>6}  token"]
    lines += [f"{r['rank']:<5} {r['mean_lambda']:7.4f} {r['count']:6d}  {r['token']!r}" for r in rows]
    return "\n".join(lines)


class DeltaMixin:
    """DelTA token weighting for a ``GRPOTrainer`` subclass whose args are a ``DFPOConfig`` (docs/delta.md).

    The subclass calls :meth:`_apply_delta_weights` on the loss inputs after its own advantage rewrites.
    ``delta_token_table`` holds the latest table of highest/lowest-weighted tokens (made at logging steps).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._delta_armed: HiddenCapture | None = None
        self._delta_last_table_step: int | None = None
        self.delta_token_table: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------------- rollout
    def _delta_enabled(self) -> bool:
        return getattr(self.args, "token_weighting", "none") == "delta" and self.model.training

    def _delta_all_reduce(self) -> Reducer | None:
        """The metrics' reduction: logged means are over every process, whatever ``delta_scope``."""
        return sum_over_processes if self.accelerator.num_processes > 1 else None

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's rollout, capturing h in TRL's old-log-prob forward when it runs; then λ̄ per token."""
        if not self._delta_enabled():
            return super()._generate_and_score_completions(inputs)
        capture = HiddenCapture()
        # Armed only when TRL will run the old-log-prob forward: the first policy forward of the rollout is then
        # that one (with a PEFT reference, the later reference forward also goes through the policy).
        self._delta_armed = capture if trl_runs_old_logps_forward(self) else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._delta_armed = None
        if not capture.done:
            self._delta_policy_forward(output, capture)
        self._delta_store_weights(output, capture)
        return output

    def _get_per_token_logps_and_entropies(self, model: torch.nn.Module, *args: Any, **kwargs: Any):
        capture = getattr(self, "_delta_armed", None)
        if capture is None or model is not self.model:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self._delta_armed = None
        return capture_log_prob_forward(
            capture, self.accelerator.unwrap_model(model), ((model, *args), kwargs),
            lambda: super(DeltaMixin, self)._get_per_token_logps_and_entropies(model, *args, **kwargs),
        )

    def _delta_policy_forward(self, output: dict[str, Any], capture: HiddenCapture) -> None:
        """The one extra no-grad forward of the on-policy case, through TRL's own log-prob helper."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        extra = {key: output[key] for key in MULTIMODAL_KEYS if key in output}
        self._delta_armed = capture
        try:
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                self._get_per_token_logps_and_entropies(
                    model=self.model, input_ids=input_ids, attention_mask=attention_mask,
                    logits_to_keep=output["completion_ids"].size(1), batch_size=self.args.per_device_train_batch_size,
                    **extra,
                )
        finally:
            self._delta_armed = None

    def _delta_store_weights(self, output: dict[str, Any], capture: HiddenCapture) -> None:
        assert capture.hidden is not None and capture.logps is not None
        mask = loss_mask(output)
        advantages = output["advantages"]
        hidden = capture.hidden
        capture.hidden = None  # the (B, T, d) copy lives only until the weights exist
        raw, weights = rollout_weights(
            hidden, capture.logps.float(), advantages, mask, self.args,
            all_reduce=weight_reducer(self.args, self.accelerator.num_processes),
            generator=self._delta_rng(hidden.device),
        )
        del hidden
        output[DELTA_WEIGHTS_KEY] = weights.to(advantages.device)
        self._delta_log(raw, weights, advantages, mask, output["completion_ids"], self._delta_all_reduce())

    def _delta_rng(self, device: torch.device) -> torch.Generator | None:
        """The random-λ control's generator, seeded per rollout from (seed, process, optimizer step): it holds
        no state a checkpoint would have to save, so a resumed run draws the same λ as an uninterrupted one."""
        if not self.args.delta_random:
            return None
        return rollout_generator(self.args.seed, self.accelerator.process_index, self.state.global_step, device=device)

    # ------------------------------------------------------------------------------------------- logging
    def _delta_log(
        self, raw: Tensor, weights: Tensor, advantages: Tensor, mask: Tensor, completion_ids: Tensor,
        all_reduce: Reducer | None,
    ) -> None:
        """``delta/lambda_{pos,neg}_mean`` (λ ∈ [λ_min, λ_max]) and ``delta/lambda_bar_{pos,neg}_mean`` (after
        self-normalisation) every rollout; the token table at the first rollout of each logging interval."""
        adv = advantages.to(raw.device)
        means = side_means(torch.stack([raw, weights.to(raw.device)]), adv, mask, all_reduce).tolist()
        store = self._metrics["train"]
        for label, (pos, neg) in zip(("lambda", "lambda_bar"), means, strict=True):
            for side, value in (("pos", pos), ("neg", neg)):
                if value == value:  # not NaN: the side has tokens
                    store[f"delta/{label}_{side}_mean"].append(value)
        step = int(self.state.global_step)
        every = max(1, int(getattr(self.state, "logging_steps", 0) or self.args.logging_steps or 1))
        if self._delta_last_table_step is not None and step // every <= self._delta_last_table_step // every:
            return
        self._delta_last_table_step = step
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.delta_token_table = token_table(
            raw, completion_ids.to(raw.device), adv, mask.to(raw.device), lambda i: tokenizer.decode([i])
        )
        if self.delta_token_table and self.accelerator.is_main_process:
            logger.info("DelTA token weights at step %d (this process's rollout):\n%s", step,
                        format_token_table(self.delta_token_table))

    # ---------------------------------------------------------------------------------------------- loss
    def _apply_delta_weights(self, inputs: dict[str, Any], mask: Tensor) -> None:
        """Â → Â λ̄ on the loss inputs (see :func:`apply_delta_weights`); call after all other rewrites."""
        if getattr(self.args, "token_weighting", "none") == "delta":
            apply_delta_weights(inputs, mask, self.args.loss_type)
