"""Backward hooks that read the token coefficients c_{i,t} = ∂loss/∂ℓ_{i,t} TRL's backward already computes.

Two metrics need the exact scalar each token's gradient ∇ℓ_{i,t} receives from the real loss: the shared-prefix
cancellation residual (docs/source/concepts/metrics.md, docs/source/concepts/cancellation.md eq. C8) and the gradient
energy on frequent tokens (eq. 24). Both register a hook on the loss's per-token log-probs, so nothing in the loss or
its gradients changes, and add device tensors to the metric store (no host read inside the backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..objectives.weights import loss_mask
from ..profiling import profiled
from ..trl_hooks.lm_head import HiddenCapture, fused_lm_head, gathered_for_reading
from .energy import energy_sums_by_bucket, frequency_buckets, lm_head_grad_scale
from .energy_aggregate import row_factors, row_norms, type_buckets
from .mechanism import shared_prefix_mask, shared_prefix_residual_sums
from .store import MetricStore

__all__ = ["energy_capture", "watch_backward", "watch_gradient_energy", "watch_token_coefficients"]


def watch_token_coefficients(
    store: MetricStore, mode: str, per_token_logps: Tensor, completion_ids: Tensor, mask: Tensor, index: Tensor,
    two_sided: Tensor | None,
) -> None:
    """Measure shared-prefix cancellation from the exact scalar on ∇ℓ_{i,t}: the gradient of the loss w.r.t. the
    per-token log-probs, read in the backward pass TRL already runs (docs/source/concepts/metrics.md); also over the
    two-sided groups alone (docs/source/concepts/cancellation.md, eq. C8), where the gradient target cancels exactly."""
    shared = shared_prefix_mask(completion_ids[index], mask[index])
    # One-sided groups' positions leave the two-sided residual (a mask, not boolean indexing: no host sync).
    subsets = () if two_sided is None else (two_sided[index[:, 0]].bool(),)

    def on_grad(grad: Tensor) -> None:
        with profiled("dfpo/watch_token_coefficients.backward_hook"):
            sums = shared_prefix_residual_sums(grad.detach()[index], shared, *subsets)
            store.add_mean(mode, "cancellation/shared_prefix_residual", *sums[0])
            if subsets:
                store.add_mean(mode, "cancellation/shared_prefix_residual_two_sided", *sums[1])

    per_token_logps.register_hook(on_grad)


def energy_capture(buckets: int, training: bool) -> HiddenCapture | None:
    """The hidden-state capture of a loss forward when the energy metric is on (``log_energy_buckets`` > 0), the
    model is training and the forward will be differentiated; else None (the metric then costs nothing)."""
    if buckets > 0 and training and torch.is_grad_enabled():
        return HiddenCapture("log_energy_buckets")
    return None


def watch_gradient_energy(
    store: MetricStore, model: torch.nn.Module, per_token_logps: Tensor, inputs: dict[str, Any],
    capture: HiddenCapture, temperature: float, num_buckets: int, form: str = "aggregate",
) -> None:
    """Energy on frequent tokens (eq. 24, docs/source/concepts/metrics.md), logged as each frequency bucket's share,
    with c_t = ∂loss/∂log p_t read in the backward pass TRL already runs and the LM head read (no grad, gathered
    read-only under ZeRO-3; ``model`` unwrapped) at this forward.

    ``form="aggregate"``: per token type v of the micro-batch, ‖Σ_t c_t ∂ log p_t/∂W_v‖, the norm of the LM-head
    gradient row (metrics/energy_aggregate.py, eq. E1), so opposite pushes on one type cancel.
    ``form="per_position"``: Σ_t ‖∇_W ℓ_t‖ = Σ_t |c_t| · ‖∂ log p_t/∂W‖ over the bucket's positions."""
    hidden, capture.hidden = capture.hidden, None
    if hidden is None or not per_token_logps.requires_grad:
        return
    completion_ids = inputs["completion_ids"]
    mask = loss_mask(inputs)
    head = fused_lm_head(model)
    read = dict(bias=head.bias, logit_scale=head.logit_scale, final_logit_softcapping=head.final_logit_softcapping)
    with gathered_for_reading(head.weight, head.bias):
        if form == "aggregate":
            factors = row_factors(hidden, head.weight, completion_ids, mask, temperature, **read)
        else:
            scale = lm_head_grad_scale(hidden, head.weight, completion_ids, temperature, **read)
    del hidden
    bucket = frequency_buckets(completion_ids, mask, num_buckets)
    if form == "aggregate":
        bucket = type_buckets(bucket, factors)

    def on_grad(grad: Tensor) -> None:
        with profiled("dfpo/watch_gradient_energy.backward_hook"):
            if form == "aggregate":
                energy = row_norms(grad, factors)
            else:
                energy = grad.detach().float().abs() * scale.to(grad.device)
            sums = energy_sums_by_bucket(energy, bucket.to(energy.device), num_buckets)
            total = sums.sum()  # each bucket's share of the energy pooled over micro-steps and processes
            for b in range(num_buckets):
                store.add_mean("train", f"energy/freq_bucket_{b}", sums[b], total)

    per_token_logps.register_hook(on_grad)


def watch_backward(
    store: MetricStore, mode: str, plan: Any, model: torch.nn.Module, per_token_logps: Tensor, inputs: dict[str, Any],
    mask: Tensor, index: Tensor | None, weights: Any, capture: HiddenCapture | None, temperature: float,
) -> None:
    """The backward hooks of one loss micro-step's metrics, as its plan (``ObjectivePlan``) asks: the token
    coefficients' residual when the group metrics are on and the groups are known, the gradient energy when
    :func:`energy_capture` captured h; ``weights``: the micro-step's ``RowWeights`` (None when it computed none)."""
    if plan.group_metrics and index is not None and per_token_logps.requires_grad:
        with profiled("dfpo/watch_token_coefficients"):
            watch_token_coefficients(store, mode, per_token_logps, inputs["completion_ids"], mask, index,
                                     None if weights is None else weights.two_sided)
    if capture is not None:
        with profiled("dfpo/watch_gradient_energy"):
            watch_gradient_energy(store, model, per_token_logps, inputs, capture, temperature, plan.energy_buckets,
                                  plan.energy_form)
