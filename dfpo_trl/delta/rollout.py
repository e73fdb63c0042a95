"""DelTA at rollout time, as pure functions: λ̄ of a batch, in its loss's domain, and what DelTA logs of it.

The steps are those of docs/source/concepts/delta.md:

* :func:`delta_token_weights`, DelTA's one public entry point: λ̄ of one batch under a ``DFPOConfig``'s ``delta_*``
  fields, self-normalised over the batch (the token-mean loss's domain);
* :func:`normalisation_domain`: where λ̄ must average 1 so that the loss's own normaliser is kept;
* :func:`_rollout_weights`: the trainer's call, λ and λ̄ of one rollout batch in that domain, through the same
  computation (on one process with ``loss_type="dapo"`` its λ̄ is exactly :func:`delta_token_weights`'s);
* :func:`sum_over_processes` / :func:`weight_reducer`: the ``all_reduce`` of the weights' statistics;
* :func:`side_means` and :func:`token_table`: what DelTA logs.

The trainer's DelTA component (:mod:`dfpo_trl.delta.weighting`) reads h, computes the weights with these functions
and stores them per row in ``output["delta_weights"]`` (B, T), where the loss-input rewrite reads them
(:func:`~dfpo_trl.objectives.rewrite.token_weighted_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..config.options import DELTA_LOSS_TYPES, DOMAIN_SEQUENCE, LOSS_TYPES
from ..config.rules import quoted
from ..objectives.normalise import self_normalise
from ..precision import compute_dtype as _compute_dtype
from .centroids import Reducer
from .weights import _DEFAULT_CHUNK, DeltaFields, _weights_core

__all__ = [
    "DELTA_WEIGHTS_KEY",
    "delta_token_weights",
    "format_token_table",
    "normalisation_domain",
    "side_means",
    "sum_over_processes",
    "token_table",
    "weight_reducer",
]

DELTA_WEIGHTS_KEY = "delta_weights"
TOKEN_TABLE_SIZE = 10


@torch.no_grad()
def _lambda_and_bar(
    hidden: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: DeltaFields,
    per_sequence: bool,
    all_reduce: Reducer | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """(λ, λ̄) of one batch under ``config``'s DelTA options (docs/source/concepts/delta.md steps 1–6), the one
    computation behind
    :func:`delta_token_weights` and :func:`_rollout_weights`; the options were checked when the config was built.

    λ from the proxy v = (1 − p) h with p = exp(``logprobs``); λ̄ = λ N / Z over the masked tokens of the whole
    batch (over all processes through ``all_reduce``) or, with ``per_sequence``, of each row; λ̄ is 0 outside
    ``mask``.
    """
    probs = logprobs.detach().to(_compute_dtype(hidden, logprobs)).exp()
    coef = 1.0 - probs.detach().to(_compute_dtype(hidden))
    raw = _weights_core(
        hidden, coef, advantages, mask, config.delta_lambda_min, config.delta_lambda_max, config.delta_refine_steps,
        config.delta_gamma, config.delta_gamma_update, config.delta_zero_advantage, config.delta_assignment,
        config.delta_contrast, generator, config.delta_random, all_reduce, _DEFAULT_CHUNK,
    )
    if per_sequence:
        bar = self_normalise(raw, mask, dim=-1)
    else:
        bar = self_normalise(raw, mask, all_reduce=all_reduce)
    return raw, torch.where(mask.to(bar.device) != 0, bar, torch.zeros_like(bar))


def delta_token_weights(
    hidden: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: DeltaFields,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """DelTA's λ̄ (B, T) for the token-mean (``dapo``) loss, on one process (docs/source/concepts/delta.md).

    ``hidden`` (B, T, d): the LM-head inputs before each sampled token; ``logprobs`` (B, T): the sampled tokens'
    log-probabilities at the sampling temperature; ``advantages`` (B,); ``mask`` (B, T): nonzero on response
    tokens; ``config``: a ``DFPOConfig`` whose ``delta_*`` fields choose the rules (defaults: the authors'
    released code). Returns λ̄ = λ N / Z, N and Z summed over the batch's response tokens, 0 outside ``mask``
    (eq. DelTA-weighted-objective). One process, so ``delta_scope`` has no effect; ``generator`` feeds the
    random-λ control.

    Args:
        hidden, logprobs, advantages, mask, config, generator: as above.

    Returns:
        λ̄ (B, T).
    """
    return _lambda_and_bar(hidden, logprobs, advantages, mask, config, False, None, generator)[1]


def normalisation_domain(loss_type: str) -> str:
    """Where λ̄ must average 1 so that the loss's own normaliser is kept (DelTA's λ̄ = λ N / Z,
    docs/source/concepts/delta.md step 6).

    ``grpo`` divides each sequence by its length: per sequence. ``bnpo`` divides the micro-batch by its
    (local) token count: per micro-batch, done at loss time. ``dapo`` divides by the token count of the whole
    generation batch over all processes, ``dr_grpo`` by a constant: over the global rollout batch (the
    ``delta_domain`` column of :data:`dfpo_trl.config.options.LOSS_TYPES`).

    Args:
        loss_type: TRL's ``loss_type``.

    Returns:
        ``DOMAIN_SEQUENCE``, ``DOMAIN_MICRO_BATCH`` or ``DOMAIN_ROLLOUT`` of :mod:`dfpo_trl.config.options`.
    """
    entry = LOSS_TYPES.get(loss_type)
    if entry is None or entry.delta_domain is None:
        raise ValueError(
            f"token_weighting='delta' has no normalisation domain for loss_type={loss_type!r}; use one of "
            f"{quoted(DELTA_LOSS_TYPES, ', ')}."
        )
    return entry.delta_domain


def sum_over_processes(t: Tensor) -> Tensor:
    """The ``all_reduce`` hook of ``dfpo_trl.delta``: element-wise sum over every process (in place)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def weight_reducer(args: DeltaFields, num_processes: int) -> Reducer | None:
    """The ``all_reduce`` of the weights' statistics: over every process for ``delta_scope="global"``, none (each
    process's shard alone, the released code's scope) for ``"process"`` or a single process.

    Args:
        args: the ``DFPOConfig`` (its ``delta_scope``).
        num_processes: the run's process count.

    Returns:
        :func:`sum_over_processes`, or None.
    """
    if num_processes > 1 and args.delta_scope == "global":
        return sum_over_processes
    return None


def _rollout_weights(
    hidden: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    args: DeltaFields,
    *,
    all_reduce: Reducer | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """λ (B, T) of one rollout batch and λ̄, λ self-normalised over the rollout-time domain of ``args.loss_type``:
    the trainer's weights (:mod:`dfpo_trl.delta.weighting`), through the computation of :func:`delta_token_weights`.

    Per sequence for ``grpo``; over the whole rollout batch (all processes through ``all_reduce``) for
    ``dapo``, ``dr_grpo`` and ``bnpo`` (whose micro-batch normalisation is redone at loss time, by
    :func:`~dfpo_trl.objectives.rewrite.token_weighted_advantages`). ``args`` is the ``DFPOConfig`` whose
    ``delta_*`` fields choose the rules.

    Args:
        hidden: (B, T, d) LM-head inputs h.
        logprobs: (B, T) the sampled tokens' log-probabilities at the sampling temperature.
        advantages: (B,) Â.
        mask: (B, T), nonzero on response tokens.
        args: the ``DFPOConfig`` (its ``delta_*`` fields and ``loss_type``).
        all_reduce: element-wise sum over processes (None: this process alone).
        generator: the random-λ control's generator.

    Returns:
        (λ, λ̄), each (B, T); λ̄ is 0 outside ``mask``.
    """
    per_sequence = normalisation_domain(args.loss_type) == DOMAIN_SEQUENCE
    return _lambda_and_bar(hidden, logprobs, advantages, mask, args, per_sequence, all_reduce, generator)


def side_means(values: Tensor, advantages: Tensor, mask: Tensor, all_reduce: Reducer | None = None) -> Tensor:
    """Means of ``values`` ((B, T), or (k, B, T) for k quantities at once) over the loss tokens of the Â > 0
    and the Â < 0 rows, global through ``all_reduce`` (one collective): shape (2,) or (k, 2), [pos, neg],
    NaN for an empty side.

    Args:
        values: (B, T) or (k, B, T).
        advantages: (B,) Â.
        mask: (B, T), nonzero on loss tokens.
        all_reduce: element-wise sum over processes (None: this process alone).

    Returns:
        (2,) or (k, 2) float64 means, [Â > 0, Â < 0].
    """
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
    The paper's Figure 4 reports reasoning tokens ("prime", "=y", "forward") high and entity names low.

    Args:
        weights: (B, T) λ.
        completion_ids: (B, T) token ids.
        advantages: (B,) Â.
        mask: (B, T), nonzero on loss tokens.
        decode: token id to text.
        k: rows per end of the ranking.

    Returns:
        Up to 2k rows, the highest first, then the lowest.
    """
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
    """:func:`token_table`'s rows as the text DelTA logs."""
    lines = [f"{'rank':<5} {'mean λ':>7} {'count':>6}  token"]
    lines += [f"{r['rank']:<5} {r['mean_lambda']:7.4f} {r['count']:6d}  {r['token']!r}" for r in rows]
    return "\n".join(lines)
