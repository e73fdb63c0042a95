"""The kept mass K_t of vLLM's truncated support (trl_hooks/sampling_support.py) against vLLM's rule written out
element by element, on hand numbers, random logits, ties and each truncation alone; the same from the LM head's
input as TRL's fused head projects it, in the dtype TRL's kernel multiplies in (checked against that kernel, with and
without autocast); the support decided on vLLM's 16-bit logits where the trainer's are wider; the options that refuse
the truncated support."""

from __future__ import annotations

import math

import pytest
import torch
from test_vllm_colocate import vllm_support
from tiny import base_args

from dfpo_trl import DFPOConfig
from dfpo_trl.trl_hooks.lm_head import FusedHead, head_logits, trl_head_dtype
from dfpo_trl.trl_hooks.sampling_support import (
    SamplingSupport,
    engine_logits,
    full_ratio,
    hidden_log_mass,
    kept_log_mass,
    sampling_support,
)


def brute_force(logits: torch.Tensor, support: SamplingSupport) -> torch.Tensor:
    """log Σ_{v∈S} p(v), S from the element-by-element rule the stand-in engine samples with."""
    out = []
    for row in logits.double():
        probs = torch.softmax(row, -1).tolist()
        kept = vllm_support(probs, support.top_k, support.top_p, support.min_p)
        out.append(math.log(sum(probs[i] for i in kept)))
    return torch.tensor(out, dtype=torch.float64)


def test_hand_numbers():
    """p = (0.5, 0.3, 0.15, 0.05): top-p 0.75 drops 0.05 and 0.15 (running 0.05, 0.2 ≤ 0.25), K = 0.8; top-k 3 then
    top-p 0.9 keeps all three (0.15 / 0.95 > 0.1), K = 0.95; min-p 0.4 keeps p ≥ 0.2, K = 0.8; untruncated 0."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert math.isclose(float(kept_log_mass(logits, SamplingSupport(1.0, 0, 0.75, 0.0)).exp()), 0.8, rel_tol=1e-6)
    assert math.isclose(float(kept_log_mass(logits, SamplingSupport(1.0, 3, 0.9, 0.0)).exp()), 0.95, rel_tol=1e-6)
    assert math.isclose(float(kept_log_mass(logits, SamplingSupport(1.0, 0, 1.0, 0.4)).exp()), 0.8, rel_tol=1e-6)
    assert float(kept_log_mass(logits, SamplingSupport(1.0, 0, 1.0, 0.0))) == 0.0


@pytest.mark.parametrize("support", [
    SamplingSupport(0.7, 20, 0.8, 0.0),   # recipes/qwen3_8b_lora.yaml, qwen3_next_80b_a3b.yaml
    SamplingSupport(0.6, 20, 0.95, 0.0),  # recipes/qwen3_32b.yaml
    SamplingSupport(1.0, 0, 0.5, 0.0),    # top-p alone: the whole vocabulary sorted
    SamplingSupport(1.0, 5, 1.0, 0.0),    # top-k alone
    SamplingSupport(1.0, 0, 1.0, 0.05),   # min-p alone
    SamplingSupport(0.9, 8, 0.9, 0.1),    # all three, min-p first
])
def test_kept_mass_is_vllms_rule(support: SamplingSupport):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3 / support.temperature
    torch.testing.assert_close(kept_log_mass(logits, support).double(), brute_force(logits, support),
                               rtol=0, atol=2e-6)


def test_the_support_is_decided_on_the_engines_logits_and_weighed_with_the_trainers():
    """8.01 and 8.02 both round to 8.0 in bfloat16 (spacing 1/16 there): vLLM's bf16 head ties them at the 3rd, so
    its top-3 keeps four tokens where the float32 logits keep three. The mass is the float32 p of the four."""
    raw = torch.tensor([[10.0, 9.0, 8.01, 8.02, 5.0, 4.0]])
    support = SamplingSupport(0.7, 3, 1.0, 0.0)
    rounded = engine_logits(raw, 0.7, torch.bfloat16)
    assert rounded is not None and engine_logits(raw, 0.7, torch.float32) is None
    p = torch.softmax(raw.double() / 0.7, -1)[0]
    # (float32 logits: log K near 0 holds to a few 1e-7 absolute)
    assert math.isclose(float(kept_log_mass(raw / 0.7, support)), math.log(float(p[[0, 1, 3]].sum())), abs_tol=1e-6)
    assert math.isclose(float(kept_log_mass(raw / 0.7, support, rounded)), math.log(float(p[:4].sum())),
                        abs_tol=1e-6)
    # top-p too runs on the engine's logits: the 16-bit running mass decides, the float32 mass is kept (rows whose
    # rounded logits tie are left out: which of two equal logits top-p drops first is the sort's choice)
    support = SamplingSupport(0.7, 0, 0.9, 0.0)
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(512, 40, generator=g, dtype=torch.float64) * 8
    rounded = engine_logits(raw, 0.7, torch.bfloat16)
    rows = [i for i in range(raw.size(0)) if rounded[i].unique().numel() == raw.size(1)]
    expected = []
    for i in rows:
        kept = vllm_support(torch.softmax(rounded[i], -1).tolist(), 0, 0.9, 0.0)
        expected.append(math.log(float(torch.softmax(raw[i] / 0.7, -1)[kept].sum())))
    got = kept_log_mass(raw / 0.7, support, rounded)[rows]
    assert len(rows) > 50
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    moved = (got - kept_log_mass(raw / 0.7, support)[rows]).abs() > 1e-9
    assert moved.any(), "no row where the rounding moves the support: nothing is tested"


def test_ties_at_the_kth_logit_are_kept_and_top_p_runs_over_them():
    """Top-k 2 of (2, 1, 1, 0): both 1s are kept (vLLM masks logits below the k-th only), so top-p runs over three
    tokens; a candidate list cut at k would miss one."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    probs = torch.softmax(logits, -1)[0]
    assert math.isclose(float(kept_log_mass(logits, SamplingSupport(1.0, 2, 1.0, 0.0)).exp()),
                        float(probs[:3].sum()), rel_tol=1e-6)
    support = SamplingSupport(1.0, 2, 0.99, 0.0)
    torch.testing.assert_close(kept_log_mass(logits, support).double(), brute_force(logits, support), atol=1e-6,
                               rtol=0)


def test_from_the_lm_head_input_as_trls_fused_head_scores_it():
    """h Wᵀ + b, logit scale, softcapping, temperature; the passes over positions change nothing."""
    g = torch.Generator().manual_seed(1)
    hidden, weight, bias = torch.randn(3, 7, 16, generator=g), torch.randn(40, 16, generator=g), torch.randn(40)
    head = FusedHead(weight, bias, 0.5, 10.0)
    support = SamplingSupport(0.7, 6, 0.8, 0.0)
    z = 10.0 * torch.tanh(0.5 * (hidden @ weight.T + bias) / 10.0) / 0.7
    torch.testing.assert_close(head_logits(hidden, head, 0.7), z)
    want = kept_log_mass(z.reshape(-1, 40), support).reshape(3, 7)
    torch.testing.assert_close(hidden_log_mass(hidden, head, support), want)
    import dfpo_trl.trl_hooks.sampling_support as module

    small = module.POSITIONS_PER_PASS
    try:
        module.POSITIONS_PER_PASS = 40 * 4  # four positions a pass
        torch.testing.assert_close(hidden_log_mass(hidden, head, support), want)
    finally:
        module.POSITIONS_PER_PASS = small
    # a bf16 engine: the support from the logits rounded to bf16 before the temperature, as vLLM's sampler reads them
    raw = (10.0 * torch.tanh(0.5 * (hidden @ weight.T + bias) / 10.0)).reshape(-1, 40)
    rounded = kept_log_mass(raw / 0.7, support, raw.to(torch.bfloat16).float() / 0.7).reshape(3, 7)
    torch.testing.assert_close(hidden_log_mass(hidden, head, support, torch.bfloat16), rounded)


def trl_kernel_log_probs(hidden: torch.Tensor, head: FusedHead, targets: torch.Tensor, temperature: float):
    """ℓ as TRL 1.16's fused head computes it (trl.kernels.ChunkedLogProbFunction, the kernel behind ℓ^old)."""
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(hidden, head.weight, head.bias, targets, temperature, 64,
                                        head.final_logit_softcapping, head.logit_scale, ("log_probs",))[0]


@pytest.mark.parametrize("autocast", [False, True])
def test_logits_are_the_ones_trls_kernel_scores_old_log_probs_with(autocast):
    """K_t must weigh the p that ℓ^old comes from. TRL's kernel multiplies h Wᵀ in autocast's dtype under mixed
    precision and in h's dtype otherwise, so a bf16 policy's ℓ^old comes from bf16 products either way: ours, in
    :func:`trl_head_dtype`, give TRL's ℓ to float32 rounding, where products in float32 miss it by bf16's rounding."""
    g = torch.Generator().manual_seed(3)
    dtype = torch.float32 if autocast else torch.bfloat16  # under autocast TRL's hidden states stay float32
    hidden = (4 * torch.randn(48, 32, generator=g)).to(dtype)
    head = FusedHead((torch.randn(200, 32, generator=g) / 2).to(dtype), torch.randn(200, generator=g).to(dtype),
                     0.5, 30.0)
    targets = torch.randint(0, 200, (48,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        trl = trl_kernel_log_probs(hidden, head, targets, 0.7)
        compute = trl_head_dtype(hidden)
        ours = head_logits(hidden, head, 0.7, compute).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        wide = head_logits(hidden, head, 0.7).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    assert compute == torch.bfloat16
    assert ours.dtype == torch.float32 and trl.dtype == torch.float32
    scale = float(trl.abs().max())
    torch.testing.assert_close(ours, trl, atol=1e-5 * scale, rtol=0)
    assert float((wide - trl).abs().max()) > 1e-3 * scale  # float32 products are not what TRL scored
    assert trl_head_dtype(hidden, cast_lm_head_to_fp32=True) == torch.float32


def test_logits_in_the_engines_dtype_are_not_rounded_again(monkeypatch):
    """bf16 products are the engine's logits already: no rounded copy is made (engine_logits gets no dtype), and the
    support and the mass come from them unchanged; float32 products beside a bf16 head are rounded."""
    import dfpo_trl.trl_hooks.sampling_support as module

    asked: list[torch.dtype | None] = []
    rounding = module.engine_logits
    monkeypatch.setattr(module, "engine_logits", lambda z, t, d: asked.append(d) or rounding(z, t, d))
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    head = FusedHead(torch.randn(60, 16, generator=g).to(torch.bfloat16), None, 1.0, None)
    support = SamplingSupport(0.6, 8, 0.9, 0.0)
    want = kept_log_mass(head_logits(hidden, head, 1.0, torch.bfloat16) / 0.6, support)
    torch.testing.assert_close(hidden_log_mass(hidden, head, support, torch.bfloat16, torch.bfloat16), want,
                               atol=0, rtol=0)
    hidden_log_mass(hidden, head, support, torch.bfloat16, torch.float32)
    assert asked == [None, torch.bfloat16]


def test_generation_kwargs_win_as_trl_passes_them_to_vllm():
    assert sampling_support(0.7, 20, 0.8, None) == SamplingSupport(0.7, 20, 0.8, 0.0)
    assert sampling_support(0.7, 20, 0.8, 0.0, {"top_k": 5, "min_p": 0.1}) == SamplingSupport(0.7, 5, 0.8, 0.1)
    assert sampling_support(1.0, -1, None, None) == SamplingSupport(1.0, 0, 1.0, 0.0)  # vLLM's -1: no top-k
    assert not sampling_support(1.0, 0, 1.0, 0.0).truncates


def test_full_ratio_is_trls_untruncated_ratio():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    sampling = torch.tensor([[-0.5, float("nan"), -2.0], [-1.5, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(full_ratio(old, sampling, mask, True), torch.tensor([[math.exp(-1.5)], [math.exp(0.5)]]))
    torch.testing.assert_close(full_ratio(old, sampling, mask, False)[0], torch.tensor([math.exp(-0.5), 1.0,
                                                                                        math.exp(-1.0)]))


@pytest.mark.parametrize("fields, names", [
    ({"use_vllm": True, "vllm_importance_sampling_correction": False}, "vllm_importance_sampling_correction=False"),
    ({"use_vllm": True, "repetition_penalty": 1.1}, "repetition_penalty changes"),
    ({"use_vllm": True, "generation_kwargs": {"presence_penalty": 0.5, "logit_bias": {1: 2.0}}},
     "presence_penalty, logit_bias changes"),
])
def test_the_truncated_support_is_refused_where_it_cannot_hold(fields: dict, names: str):
    with pytest.raises(ValueError, match="vllm_importance_sampling_support='truncated'") as raised:
        DFPOConfig(**base_args(vllm_importance_sampling_support="truncated", **fields))
    assert names in str(raised.value)
    assert "vllm_importance_sampling_support='full'" in str(raised.value)


def test_without_vllm_the_truncated_support_waits_for_it():
    """A recipe that generates with transformers by default and with vLLM on a flag keeps the field (the 8B one)."""
    config = DFPOConfig(**base_args(vllm_importance_sampling_support="truncated", use_vllm=False,
                                    repetition_penalty=1.1))
    assert config.vllm_importance_sampling_support == "truncated"
