"""Aggregate gradient energy (eq. 24 per token type, dfpo_trl.metrics.energy_aggregate,
docs/source/concepts/metrics.md): exact cancellation on a shared token gives 0 where the per-position form stays
positive; the row norms equal an autograd computation on the LM-head weight; ``energy_form`` in the config and the
trainer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_energy import GSPO, TOKEN
from tiny import (
    base_args,
    capturing,
    fused_completion_logps,
    loss_and_grads,
    make_trainer,
    random_batch,
    with_old_logps,
)
from tolerance import assert_close_to_rounding

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.metrics.energy import energy_sums_by_bucket, frequency_buckets, lm_head_grad_scale
from dfpo_trl.metrics.energy_aggregate import row_factors, row_norms, type_buckets

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, WIDTH = 11, 5


def head(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, WIDTH, generator=g), torch.randn(VOCAB, generator=g)


def test_a_shared_token_whose_pushes_cancel_has_zero_aggregate_energy_but_positive_per_position_energy():
    """A group of two: both complete with token a, then one with b, the other with c. Same prompt, same prefix,
    so h at both positions is the same in both rows; advantages ±1 with equal weights give c = +1 and −1. Every
    contribution to W_a's row (at a's own position and, through −p_a, at the next) cancels: ‖G_a‖ = 0. The
    per-position form adds |c_t| ‖∂ log p_t/∂W‖ > 0 for a's two occurrences."""
    weight, bias = head()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, 2, WIDTH, generator=g).expand(2, 2, WIDTH).clone()
    a, b, c = 3, 5, 8
    ids = torch.tensor([[a, b], [a, c]])
    mask = torch.ones_like(ids)
    coefficients = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    factors = row_factors(h, weight, ids, mask, 0.7, bias=bias)
    norms = dict(zip(factors.type_ids.tolist(), row_norms(coefficients, factors).tolist(), strict=True))
    scale = lm_head_grad_scale(h, weight, ids, 0.7, bias=bias)
    per_position_a = float((coefficients.abs() * scale)[:, 0].sum())
    assert per_position_a > 0.1
    assert norms[a] <= 64 * torch.finfo(torch.float32).eps * per_position_a  # zero up to rounding of its terms
    assert norms[b] > 0.1 and norms[c] > 0.1  # the forms that differ keep their push
    # the same group through the bucket sums: a is the most frequent type (bucket 0)
    bucket = type_buckets(frequency_buckets(ids, mask, 2), factors)
    assert bucket.tolist() == [0, 1, 1]
    sums = energy_sums_by_bucket(row_norms(coefficients, factors), bucket, 2)
    assert float(sums[0]) <= 64 * torch.finfo(torch.float32).eps * per_position_a and float(sums[1]) > 0.2
    per_position = energy_sums_by_bucket(coefficients.abs() * scale, frequency_buckets(ids, mask, 2), 2)
    assert float(per_position[0]) == pytest.approx(per_position_a, rel=1e-6)


def autograd_rows(h, weight, bias, ids, mask, coefficients, temperature, logit_scale=1.0, softcap=None):
    """‖∂/∂W_v Σ_t c_t log p_t‖ for every present type v, by autograd through the logits written out."""
    w = weight.clone().requires_grad_(True)
    z = (h @ w.T + bias) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (grad,) = torch.autograd.grad((coefficients * logp * mask).sum(), w)
    present = torch.unique(ids[mask.bool()])
    return present, grad[present].norm(dim=1)


@pytest.mark.parametrize(("dtype", "extra"), [
    (torch.float32, {}),
    (torch.float64, {"logit_scale": 0.6, "softcap": 2.0}),
    (torch.float32, {"logit_scale": -1.3, "softcap": 4.0}),
])
def test_row_norms_are_the_autograd_lm_head_gradient_rows(dtype, extra):
    weight, bias = (t.to(dtype) for t in head(2))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(3, 4, WIDTH, generator=g).to(dtype)
    ids = torch.randint(0, VOCAB, (3, 4), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 2:] = 0
    coefficients = torch.randn(3, 4, generator=g).to(dtype)
    present, want = autograd_rows(h, weight, bias, ids, mask, coefficients, 0.8, **extra)
    factors = row_factors(h, weight, ids, mask, 0.8, bias=bias, logit_scale=extra.get("logit_scale", 1.0),
                          final_logit_softcapping=extra.get("softcap"), chunk_size=5, vocab_chunk_size=4)
    assert torch.equal(factors.type_ids, present)
    got = row_norms(coefficients, factors)
    assert got.dtype == dtype
    assert_close_to_rounding(got, want, scale=want.abs().max())


def test_energy_form_is_aggregate_by_default_and_checked():
    assert DFPOConfig(**base_args()).energy_form == "aggregate"
    assert DFPOConfig(**base_args(energy_form="per_position")).energy_form == "per_position"
    with pytest.raises(ValueError, match=r"energy_form.*'aggregate' or 'per_position'"):
        DFPOConfig(**base_args(energy_form="sum"))


def reference_aggregate_shares(trainer, batch, coefficients: torch.Tensor, num_buckets: int) -> list[float]:
    """The aggregate eq. 24 computed independently: autograd of Σ c_t log p_t on the LM-head weight through the
    model's fused forward, each present type's row norm, bucketed with a plain Counter."""
    model = trainer.model
    logps = fused_completion_logps(model, batch)
    mask = batch["completion_mask"]
    (grad,) = torch.autograd.grad((coefficients * logps * mask).sum(), model.lm_head.weight)
    tokens = [int(batch["completion_ids"][b, t]) for b, t in mask.nonzero().tolist()]
    counts = Counter(tokens)
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    sums, before = [0.0] * num_buckets, 0
    for token in ranked:
        sums[before * num_buckets // len(tokens)] += float(grad[token].norm())
        before += counts[token]
    return [s / sum(sums) for s in sums]


@pytest.mark.parametrize("setting", [GSPO, TOKEN], ids=["gspo", "token_dapo"])
def test_trainer_logs_the_aggregate_shares_of_an_autograd_computation(setting):
    common = dict(**setting, steps_per_generation=2, temperature=0.7)
    on = make_trainer(capturing(DFPOTrainer), DFPOConfig, **common, log_energy_buckets=3)
    off = make_trainer(capturing(DFPOTrainer), DFPOConfig, **common)
    ids, mask, adv, log_ratio = random_batch(spread=0.1)
    batch = with_old_logps(off, ids, mask, adv, log_ratio)
    on._metrics["train"].clear()
    loss_on, grads_on = loss_and_grads(on, batch)
    loss_off, grads_off = loss_and_grads(off, batch)
    assert torch.equal(loss_on, loss_off)
    for name in grads_on:
        assert torch.equal(grads_on[name], grads_off[name]), name
    expected = reference_aggregate_shares(off, batch, off.captured.grad.detach(), 3)
    logged = [on._metrics["train"][f"energy/freq_bucket_{b}"][0] for b in range(3)]
    assert logged == pytest.approx(expected, abs=1e-5)


def test_row_factors_refuse_bad_shapes_and_settings():
    weight, _ = head()
    h, ids = torch.zeros(2, 3, WIDTH), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden \(B, T, d\) and token_ids, mask \(B, T\)"):
        row_factors(h, weight, ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match="temperature=0"):
        row_factors(h, weight, ids, torch.ones(2, 3), 0.0)
