"""Gradient energy on frequent tokens (arXiv 2604.13088 eq. 24, docs/source/concepts/metrics.md): the pure functions in
``dfpo_trl.metrics.energy``, the LM-head helpers in ``dfpo_trl.trl_hooks.lm_head``, ``log_energy_buckets`` in the
config and the trainer (loss and gradients unchanged; logged shares equal a per-token autograd computation)."""

from __future__ import annotations

import enum
import sys
import types
from collections import Counter

import pytest
import torch
from tiny import (
    WORDS,
    base_args,
    capturing,
    fused_completion_logps,
    loss_and_grads,
    make_trainer,
    random_batch,
    tiny_model,
    with_old_logps,
)
from tolerance import assert_close_to_rounding
from trl.trainer.utils import add_fused_lm_head

import dfpo_trl.metrics.hooks as hooks_module
from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.metrics.energy import energy_sums_by_bucket, frequency_buckets, lm_head_grad_scale
from dfpo_trl.trl_hooks.lm_head import HiddenCapture, fused_lm_head, gathered_for_reading, lm_head_input_module

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ LM-head scale
def fused_forward(model, temperature: float, prompt_len: int = 3, rows: int = 2, length: int = 6, seed: int = 0):
    """TRL's fused head on a tiny model: per-token log-probs of the completion (with graph) and the captured h."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(WORDS), (rows, prompt_len + length), generator=g)
    attention = torch.ones_like(ids)
    attention[1, -2:] = 0  # right padding in the second completion
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :-length] = -100
    capture = HiddenCapture("test")
    out = capture.run(
        lm_head_input_module(model),
        length,
        lambda: model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True),
    )
    return out.log_probs[:, -length:], capture.hidden, ids[:, -length:], attention[:, -length:]


def per_token_weight_grad_norms(logps: torch.Tensor, coefficients: torch.Tensor, weight: torch.Tensor, mask):
    """‖∂(c_t log p_t)/∂W‖ token by token, by autograd through the model's own forward."""
    norms = torch.zeros_like(coefficients)
    for b, t in mask.nonzero().tolist():
        (grad,) = torch.autograd.grad(coefficients[b, t] * logps[b, t], weight, retain_graph=True)
        norms[b, t] = grad.norm()
    return norms


@pytest.mark.parametrize(
    ("config_extra", "chunks"),
    [
        ({}, dict(chunk_size=5, vocab_chunk_size=7)),  # 12 tokens, 20 ids: neither chunk divides
        ({"final_logit_softcapping": 3.0, "logit_scale": 0.6}, dict(chunk_size=1, vocab_chunk_size=3)),
        ({}, dict(chunk_size=1000, vocab_chunk_size=1000)),
    ],
)
def test_scale_times_coefficient_is_the_autograd_lm_head_gradient_norm(config_extra, chunks):
    model = tiny_model(seed=2)
    for key, value in config_extra.items():  # read by TRL's add_fused_lm_head from the config, as for Gemma 2
        setattr(model.config, key, value)
    temperature = 0.7
    add_fused_lm_head(model, temperature=temperature)
    logps, hidden, completion_ids, mask = fused_forward(model, temperature)
    coefficients = torch.randn(logps.shape, generator=torch.Generator().manual_seed(4))
    expected = per_token_weight_grad_norms(logps, coefficients, model.lm_head.weight, mask)
    head = fused_lm_head(model)
    assert head.logit_scale == config_extra.get("logit_scale", 1.0)
    assert head.final_logit_softcapping == config_extra.get("final_logit_softcapping")
    scale = lm_head_grad_scale(
        hidden,
        head.weight,
        completion_ids,
        temperature,
        bias=head.bias,
        logit_scale=head.logit_scale,
        final_logit_softcapping=head.final_logit_softcapping,
        **chunks,
    )
    assert scale.shape == completion_ids.shape and scale.dtype == torch.float32 and not scale.requires_grad
    got = coefficients.abs() * scale
    valid = mask.bool()
    assert expected[valid].min() > 1e-3
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-7)


def test_scale_is_the_design_formula_with_bias_and_temperature():
    """‖h‖ · ‖e_y − p‖ / τ with ‖e_y − p‖² = 1 − 2 p_y + Σ_k p_k² (docs/source/concepts/metrics.md), full softmax in
    float64."""
    g = torch.Generator().manual_seed(0)
    hidden = 3 * torch.randn(4, 3, 8, generator=g)
    weight, bias = torch.randn(23, 8, generator=g), torch.randn(23, generator=g)
    ids = torch.randint(0, 23, (4, 3), generator=g)
    p = torch.softmax((hidden.double() @ weight.double().T + bias.double()) / 1.7, -1)
    p_y = p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    expected = hidden.double().norm(dim=-1) * (1 - 2 * p_y + (p * p).sum(-1)).sqrt() / 1.7
    got = lm_head_grad_scale(hidden, weight, ids, 1.7, chunk_size=5, bias=bias, vocab_chunk_size=4)
    assert_close_to_rounding(got, expected)  # float32 by design (docs/source/concepts/decisions.md), against float64
    assert lm_head_grad_scale(hidden[:0], weight, ids[:0]).shape == (0, 3)
    with pytest.raises(ValueError, match="vocabulary"):
        lm_head_grad_scale(hidden, weight, ids + 23)


def test_fused_head_of_a_peft_model_is_the_base_models():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    weight = model.lm_head.weight
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    head = fused_lm_head(lora)
    assert head.weight is weight and head.bias is None and head.logit_scale == 1.0
    assert lm_head_input_module(lora) is model.model


def test_zero3_lm_head_is_gathered_read_only(monkeypatch):
    calls = []

    class Status(enum.Enum):
        AVAILABLE = 1
        NOT_AVAILABLE = 2

    class Gathered:
        def __init__(self, params, modifier_rank="not given"):
            calls.append((params, modifier_rank))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    deepspeed = types.ModuleType("deepspeed")
    deepspeed.zero = types.SimpleNamespace(GatheredParameters=Gathered)
    partition = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    partition.ZeroParamStatus = Status
    monkeypatch.setitem(sys.modules, "deepspeed", deepspeed)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime", types.ModuleType("deepspeed.runtime"))
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero", types.ModuleType("deepspeed.runtime.zero"))
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.partition_parameters", partition)

    plain = torch.nn.Parameter(torch.zeros(2))
    with gathered_for_reading(plain, None):
        pass
    assert calls == []
    sharded = torch.nn.Parameter(torch.zeros(0))
    sharded.ds_id, sharded.ds_status = 7, Status.NOT_AVAILABLE
    with gathered_for_reading(sharded, plain, None):
        pass
    assert len(calls) == 1 and calls[0][0] == [sharded] and calls[0][1] is None  # modifier_rank=None: read-only
    sharded.ds_status = Status.AVAILABLE
    with gathered_for_reading(sharded):
        pass
    assert len(calls) == 1


# ------------------------------------------------------------------------------------------------ buckets
def test_frequency_buckets_hand_built():
    ids = torch.tensor([[5, 5, 5, 7, 3, 9, 8], [5, 5, 5, 7, 7, 3, 8], [3, 9, 4, 1, 1, 1, 8]])
    mask = torch.ones_like(ids)
    mask[:, 6] = 0  # id 8 only at masked positions: not counted anywhere
    mask[2, 3:] = 0
    # counts over the 15 unmasked tokens: 5 ×6, 3 ×3, 7 ×3, 9 ×2, 4 ×1; the 3/7 tie goes to the smaller id.
    # mass before each id: 0, 6, 9, 12, 14 -> bucket ⌊before · 3 / 15⌋ = 0, 1, 1, 2, 2
    expected_of_id = {5: 0, 3: 1, 7: 1, 9: 2, 4: 2}
    expected = torch.tensor([[expected_of_id.get(i, -1) for i in row] for row in ids.tolist()])
    expected[mask == 0] = -1
    got = frequency_buckets(ids, mask, 3)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    # positions do not matter, only counts: a permutation of the tokens permutes the buckets
    perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))
    permuted = frequency_buckets(ids.flatten()[perm], mask.flatten()[perm], 3)
    assert torch.equal(permuted, expected.flatten()[perm])


def test_frequency_buckets_never_split_an_id_and_allow_empty_buckets():
    ids = torch.tensor([[1] * 6 + [2, 2, 3, 4]])  # id 1 holds 60% of the mass
    got = frequency_buckets(ids, torch.ones_like(ids), 3)
    # before: 0, 6, 8, 9 -> ⌊· 3 / 10⌋ = 0, 1, 2, 2: bucket 0 is id 1 alone, all of it
    assert got.tolist() == [[0] * 6 + [1, 1, 2, 2]]
    got = frequency_buckets(ids, torch.ones_like(ids), 5)  # before · 5 / 10 = 0, 3, 4, 4: buckets 1, 2 empty
    assert got.tolist() == [[0] * 6 + [3, 3, 4, 4]]
    empty = frequency_buckets(ids, torch.zeros_like(ids), 3)
    assert (empty == -1).all()
    with pytest.raises(ValueError, match="num_buckets"):
        frequency_buckets(ids, torch.ones_like(ids), 0)


def test_energy_shares_hand_values_as_the_trainer_computes_them():
    """eq. 24 on the trainer's path: energy_sums_by_bucket's numerators, each divided by the counted total in the
    metric store (the division the backward hook leaves to it), shares that sum to 1; a bucket of −1 counts
    nowhere, and with no counted energy no share is logged (a share of nothing is not 0)."""
    from dfpo_trl.metrics.store import MetricStore

    energy = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 100.0]])
    bucket = torch.tensor([[0, 0, 1, 2], [2, 1, 0, -1]])
    sums = energy_sums_by_bucket(energy, bucket, 3)
    torch.testing.assert_close(sums, torch.tensor([1.0 + 2 + 7, 3 + 6, 4 + 5]))  # the −1 token is not counted
    assert energy_sums_by_bucket(energy.double(), bucket, 4).dtype == torch.float64

    def shares(sums: torch.Tensor) -> dict[str, float | list[float]]:
        store = MetricStore()
        for b in range(sums.numel()):
            store.add_mean("train", f"energy/freq_bucket_{b}", sums[b], sums.sum())
        return store.flush("train", "cpu")

    total = 1 + 2 + 3 + 4 + 5 + 6 + 7
    logged = shares(sums)
    assert [logged[f"energy/freq_bucket_{b}"] for b in range(3)] == pytest.approx([10 / total, 9 / total, 9 / total])
    assert sum(logged.values()) == pytest.approx(1.0)
    assert shares(energy_sums_by_bucket(torch.zeros(2, 4), bucket, 3)) == {}
    assert shares(energy_sums_by_bucket(energy, torch.full_like(bucket, -1), 3)) == {}


# ------------------------------------------------------------------------------------------------- config
def test_energy_is_off_by_default_and_accepts_bucket_counts():
    assert DFPOConfig(**base_args()).log_energy_buckets == 0
    assert DFPOConfig(**base_args(log_energy_buckets=3)).log_energy_buckets == 3


@pytest.mark.parametrize("value", [-1, 1, True, 2.5])
def test_bad_bucket_count_is_refused_with_the_field_and_the_fix(value):
    with pytest.raises(ValueError, match=r"log_energy_buckets=.* use 0 .* k >= 2"):
        DFPOConfig(**base_args(log_energy_buckets=value))


# ------------------------------------------------------------------------------------------------ trainer
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28)
TOKEN = dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.2, epsilon_high=0.28)


def reference_shares(trainer, batch, coefficients: torch.Tensor, num_buckets: int) -> list[float]:
    """Eq. 24 computed independently: per-token autograd of the LM-head weight gradient through the model's fused
    forward, times |c_t|, bucketed with a plain Counter."""
    model = trainer.model
    logps = fused_completion_logps(model, batch)
    mask = batch["completion_mask"]
    norms = per_token_weight_grad_norms(logps, coefficients, model.lm_head.weight, mask)
    tokens = [(int(batch["completion_ids"][b, t]), float(norms[b, t])) for b, t in mask.nonzero().tolist()]
    counts = Counter(token for token, _ in tokens)
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    bucket_of, before = {}, 0
    for token in ranked:
        bucket_of[token] = before * num_buckets // len(tokens)
        before += counts[token]
    sums = [0.0] * num_buckets
    for token, norm in tokens:
        sums[bucket_of[token]] += norm
    return [s / sum(sums) for s in sums]


@pytest.mark.parametrize("setting", [GSPO, TOKEN], ids=["gspo", "token_dapo"])
def test_energy_metric_keeps_loss_and_gradients_and_matches_autograd(setting):
    common = dict(**setting, steps_per_generation=2, temperature=0.7)
    on = make_trainer(capturing(DFPOTrainer), DFPOConfig, **common, log_energy_buckets=3, energy_form="per_position")
    off = make_trainer(capturing(DFPOTrainer), DFPOConfig, **common)
    ids, mask, adv, log_ratio = random_batch(spread=0.1)
    batch = with_old_logps(off, ids, mask, adv, log_ratio)
    on._metrics["train"].clear()
    loss_on, grads_on = loss_and_grads(on, batch)
    loss_off, grads_off = loss_and_grads(off, batch)
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_on:
        assert torch.equal(grads_on[name], grads_off[name]), name
    assert not any(key.startswith("energy/") for key in off._metrics["train"])
    coefficients = off.captured.grad.detach()
    assert torch.equal(coefficients, on.captured.grad)
    expected = reference_shares(off, batch, coefficients, 3)
    logged = [on._metrics["train"][f"energy/freq_bucket_{b}"] for b in range(3)]
    assert all(len(values) == 1 for values in logged)
    assert [values[0] for values in logged] == pytest.approx(expected, abs=1e-5)
    assert sum(values[0] for values in logged) == pytest.approx(1.0, abs=1e-6)


def test_energy_off_or_without_grad_runs_no_capture(monkeypatch):
    class Refuse(HiddenCapture):
        def run(self, *args, **kwargs):
            raise AssertionError("the hidden-state capture ran")

    monkeypatch.setattr(hooks_module, "HiddenCapture", Refuse)
    ids, mask, adv, log_ratio = random_batch()
    off = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, steps_per_generation=2)
    loss_and_grads(off, with_old_logps(off, ids, mask, adv, log_ratio))
    on = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, steps_per_generation=2, log_energy_buckets=3)
    with torch.no_grad():  # an evaluation-style loss: nothing is differentiated, nothing is measured
        on.compute_loss(on.model, with_old_logps(on, ids, mask, adv, log_ratio))
    on.flush_dfpo_metrics("train")
    assert not any(key.startswith("energy/") for key in on._metrics["train"])


def test_energy_is_logged_over_the_logging_interval_in_training():
    trainer = make_trainer(
        DFPOTrainer, DFPOConfig, **GSPO, steps_per_generation=2, log_energy_buckets=3, max_steps=2, logging_steps=2
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "energy/freq_bucket_0" in h]
    assert len(logs) == 1
    shares = [logs[0][f"energy/freq_bucket_{b}"] for b in range(3)]
    assert all(0.0 <= share <= 1.0 for share in shares)
    assert sum(shares) == pytest.approx(1.0, abs=1e-6)
