"""vLLM server mode on CPU, without vLLM: the configuration parses, the loss path with TRL's importance-sampling
(IS) correction composes with every DFPO option, and the trainer refuses to start with TRL's own message.

TRL multiplies the per-token loss by ``inputs["importance_sampling_ratio"]`` after the clipped surrogate, so the
exact scalar on each ∇ℓ_{i,t} is the uncorrected one times ρ_IS: elementwise at token level and for the (B, 1)
ratios of TRL's default ``sequence_*`` IS modes; for the (B, T) ratios of the ``token_*`` modes at sequence level
(every token's gradient goes through the sequence weight) it is times the masked row mean of ρ_IS.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny import (
    base_args,
    capturing,
    hand_batch,
    loss_and_grads,
    make_trainer,
    random_batch,
    record_row_weights,
    with_old_logps,
)
from tolerance import assert_close_to_rounding

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.transforms import GROUP_TRANSFORMS
from dfpo_trl.trl_hooks.compat import trl_runs_old_logps_forward

SEQ = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28)
TOKEN_FIX = dict(importance_sampling_level="token", loss_type="dapo", epsilon_high=0.28, symmetric_clip=True)
VLLM_SERVER = dict(use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=True)

# Every DFPO objective that can run under vLLM: each transform (ratio form), the score form, GRPO-fix.
OBJECTIVES = [pytest.param(dict(**SEQ, group_transform=t), id=t) for t in GROUP_TRANSFORMS]
OBJECTIVES += [
    pytest.param(dict(**SEQ, transform_gradient="score"), id="score"),
    pytest.param(dict(**SEQ, group_transform="min_replace", transform_gradient="score"), id="score-min_replace"),
    pytest.param(TOKEN_FIX, id="symmetric_clip"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_vllm_config_parses_for_every_objective(objective, mode):
    """DFPOConfig with use_vllm=True and the IS correction accepts every transform, the score form and
    GRPO-fix, and keeps both TRL's vLLM fields and the DFPO ones."""
    cfg = DFPOConfig(**base_args(**{**VLLM_SERVER, "vllm_mode": mode}, **objective))
    assert cfg.use_vllm and cfg.vllm_mode == mode and cfg.vllm_importance_sampling_correction
    for key, value in objective.items():
        assert getattr(cfg, key) == value, key


def with_vllm(trainer, on: bool = True):
    """What TRL sets from a vLLM config (its __init__ cannot run without vLLM)."""
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = on
    return trainer


def coefficients(trainer, batch) -> torch.Tensor:
    loss_and_grads(trainer, batch)
    return trainer.captured.grad.detach().clone()


def is_ratios(shape: tuple[int, int], seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "sequence_modes": 0.5 + torch.rand(shape[0], 1, generator=g),  # TRL's default sequence_mask: (B, 1)
        "token_modes": 0.5 + torch.rand(shape, generator=g),  # token_mask / token_truncate: (B, T)
    }


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_is_correction_scales_token_coefficients_by_the_ratio(objective):
    """With vLLM's IS ratio in the batch, every token's gradient coefficient is the uncorrected one times ρ_IS
    (elementwise at token level and for (B, 1) ratios; times the row's masked mean of a (B, T) ratio at
    sequence level), for every transform, the score form and GRPO-fix."""
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, steps_per_generation=2, **objective)
    batch = with_old_logps(trainer, *random_batch())
    mask = batch["completion_mask"].float()
    plain = coefficients(with_vllm(trainer, False), batch)
    assert plain.abs().max() > 1e-4
    for kind, ratio in is_ratios(tuple(mask.shape)).items():
        corrected = coefficients(with_vllm(trainer), {**batch, "importance_sampling_ratio": ratio})
        if kind == "token_modes" and trainer.importance_sampling_level == "sequence":
            factor = ((ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)).expand_as(mask)
        else:
            factor = ratio.expand_as(mask)
        assert_close_to_rounding(corrected, plain * factor, msg=kind)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_constant_is_ratio_of_two_doubles_loss_and_gradient(objective):
    """β = 0, no entropy bonus: a constant ρ_IS = 2 doubles the loss and every parameter's gradient."""
    trainer = make_trainer(DFPOTrainer, DFPOConfig, steps_per_generation=2, **objective)
    batch = with_old_logps(trainer, *random_batch())
    loss, grads = loss_and_grads(with_vllm(trainer, False), batch)
    ratio = torch.full(batch["completion_ids"].shape, 2.0)
    loss_is, grads_is = loss_and_grads(with_vllm(trainer), {**batch, "importance_sampling_ratio": ratio})
    # ×2 commutes with rounding in binary floating point, and the backward pass is linear in the loss's gradient:
    # the corrected run is the plain one doubled bit for bit
    assert torch.equal(loss_is, 2 * loss)
    assert max(g.abs().max() for g in grads.values()) > 1e-4
    for name, grad in grads.items():
        assert torch.equal(grads_is[name], 2 * grad), name


def shared_prefix_batch(trainer):
    """Two groups of G = 2 whose members share their first two tokens, with off-policy ratios."""
    ids = torch.tensor([[16, 17, 5], [16, 17, 6], [18, 17, 7], [18, 17, 8]])
    mask = torch.ones(4, 3, dtype=torch.long)
    batch = hand_batch(ids, mask, torch.tensor([-1.0, 1.0, 0.5, -0.5]), None)
    with torch.no_grad():
        cur, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], ids], 1), torch.cat([batch["prompt_mask"], mask], 1), 3
        )
    log_ratio = torch.log(torch.tensor([[1.01, 0.99, 1.05], [1.01, 0.99, 0.97], [1.02, 1.0, 0.95],
                                        [1.02, 1.0, 1.04]]))
    batch["old_per_token_logps"] = cur - log_ratio
    return batch


def test_is_correction_reweights_members_after_the_transform():
    """Current composition (TRL's): the IS ratio multiplies each member's loss *after* DFPO's transform. A ratio
    constant within each group keeps min_replace's exact shared-prefix cancellation; a ratio that differs
    between members of a group re-weights them and the shared-prefix coefficients no longer cancel."""
    trainer = with_vllm(make_trainer(capturing(DFPOTrainer), DFPOConfig, **SEQ, steps_per_generation=2,
                                     num_generations=2, group_transform="min_replace"))
    batch = shared_prefix_batch(trainer)
    per_group = torch.tensor([[1.3], [1.3], [0.6], [0.6]])
    per_member = torch.tensor([[1.3], [0.8], [0.6], [1.1]])
    c_group = coefficients(trainer, {**batch, "importance_sampling_ratio": per_group})
    c_member = coefficients(trainer, {**batch, "importance_sampling_ratio": per_member})
    shared_group = c_group[:, :2].view(2, 2, 2).sum(1)  # (group, shared position): Σ over members
    shared_member = c_member[:, :2].view(2, 2, 2).sum(1)
    assert c_group[:, :2].abs().max() > 1e-4
    assert_close_to_rounding(shared_group, torch.zeros(2, 2), scale=c_group[:, :2].abs().view(2, 2, 2).sum(1))
    assert shared_member.abs().max() > 1e-4


# One ratio per member (TRL's sequence modes) for the shared-prefix batch's 4 rows: TRL's under truncated sampling is
# the product of each member's kept masses, exp(Σ_t log K_t), and differs between members by an order of magnitude;
# the ratio against the truncated support keeps only the engines' mismatch, here ±1e-3 per member.
KEPT_LOG_MASS = torch.tensor([[-0.1], [-1.5], [-0.4], [-2.0]])
MISMATCH = torch.tensor([[1e-3], [-1e-3], [5e-4], [-5e-4]])
RATIOS = {"trl_full_support": (KEPT_LOG_MASS + MISMATCH).exp(), "truncated_support": MISMATCH.exp()}


@pytest.mark.parametrize("target", ["weights", "gradient"])
def test_what_the_is_correction_does_to_the_group_balance(target):
    """Min-Replace with TRL's correction on, per member ratios w_i (RATIOS). The loss's gradient on a token all
    members of a group share is Σ_i Â_i s̃_i c_i w_i (docs/source/concepts/cancellation.md, C1–C3).

    ``"weights"`` keeps Σ_i Â_i s̃_i = 0 whatever w, so the shared tokens' residual |Σ_i c| / Σ_i |c| is the spread
    of w in the group, |w_1 − w_2| / (w_1 + w_2) = tanh(|Δ log w| / 2) for two members with Â = ±a, equal lengths and
    equal s̃: 0.66 with TRL's ratio under truncation, 0.001 against the truncated support. ``"gradient"`` folds w
    into a_i and cancels the shared tokens exactly with either ratio, at the price of Σ_i Â_i s̃_i ≠ 0 where w differs
    (the weights absorb it)."""
    trainer = with_vllm(make_trainer(capturing(DFPOTrainer), DFPOConfig, **SEQ, steps_per_generation=2,
                                     num_generations=2, group_transform="min_replace", cancellation_target=target))
    used = record_row_weights(trainer)
    batch = shared_prefix_batch(trainer)
    advantages = batch["advantages"].double().view(2, 2)
    residual, balance = {}, {}
    for name, ratio in RATIOS.items():
        c = coefficients(trainer, {**batch, "importance_sampling_ratio": ratio}).double()
        shared = c[:, :2].view(2, 2, 2)  # (group, member, shared position)
        assert shared.abs().max() > 1e-4
        residual[name] = float((shared.sum(1).abs() / shared.abs().sum(1)).max())
        balance[name] = (advantages * used[-1].s_tilde.double().view(2, 2)).sum(-1).abs().max()
    if target == "weights":
        for name in RATIOS:
            assert_close_to_rounding(balance[name], torch.zeros((), dtype=torch.float64), scale=advantages.abs().sum())
        for name, ratio in RATIOS.items():
            spread = float(torch.tanh(ratio.log().view(2, 2).diff(dim=1).abs() / 2).max())
            assert residual[name] == pytest.approx(spread, rel=1e-3), name
        assert residual["trl_full_support"] > 0.6 and residual["truncated_support"] < 2e-3
    else:
        assert max(residual.values()) < 1e-5  # float32 gradients: the rounding of the sum
        assert balance["trl_full_support"] > 0.1


@pytest.mark.parametrize(("spg", "accumulation"), [(1, 1), (2, 2), (4, 4)])
def test_vllm_is_correction_makes_every_step_off_policy(spg, accumulation):
    """TRL computes old log-probs whenever the vLLM IS correction is on, so DFPO's transforms act even with
    steps_per_generation == gradient_accumulation_steps; without vLLM that setting is on-policy."""
    trainer = make_trainer(DFPOTrainer, DFPOConfig, **SEQ, group_transform="min_replace", steps_per_generation=spg,
                           gradient_accumulation_steps=accumulation)
    assert not trl_runs_old_logps_forward(trainer)
    with_vllm(trainer)
    assert trl_runs_old_logps_forward(trainer)
    trainer.vllm_importance_sampling_correction = False  # vLLM without the correction: on-policy again
    assert not trl_runs_old_logps_forward(trainer)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("objective", [OBJECTIVES[1], OBJECTIVES[-1]])
def test_trainer_with_use_vllm_fails_with_trls_vllm_message(objective):
    """Without vLLM installed, DFPOTrainer(use_vllm=True) stops at start-up with TRL's ImportError that names
    vLLM, not with a DFPO error or later during training."""
    with pytest.raises(ImportError, match=r"(?i)vllm.*not available|not available.*vllm"):
        make_trainer(DFPOTrainer, DFPOConfig, steps_per_generation=2, **VLLM_SERVER, **objective)
