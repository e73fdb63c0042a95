"""The loss-input rewrite as pure functions of tensors (dfpo_trl.objectives.weights, dfpo_trl.objectives.rewrite),
tested without a trainer."""

from __future__ import annotations

import pytest
import torch

from dfpo_trl.objectives.rewrite import grpo_fix_old_logps, sequence_level_inputs
from dfpo_trl.objectives.weights import bounded_old_logps, loss_mask, post_clip_weights


def test_loss_mask_multiplies_the_tool_mask_when_present():
    completion = torch.tensor([[1, 1, 0]])
    assert torch.equal(loss_mask({"completion_mask": completion}), completion)
    tool = torch.tensor([[1, 0, 1]])
    assert torch.equal(loss_mask({"completion_mask": completion, "tool_mask": tool}), torch.tensor([[1, 0, 0]]))


def test_bounded_old_logps_is_the_identity_inside_the_bound_and_bounds_rho_outside():
    logps = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    old = torch.tensor([[-1.5, -2.5], [-60.0, -62.0]])  # ρ = 0.5 (inside), ρ = 59.5 (outside)
    mask = torch.ones(2, 2)
    out = bounded_old_logps(logps, old, mask, sequence_level=True)
    assert torch.equal(out[0], old[0])
    rho = ((logps - out) * mask).sum(-1) / 2
    assert rho[1].item() == 20.0
    token = bounded_old_logps(logps, old, mask, sequence_level=False)
    assert torch.equal(token[0], old[0]) and torch.allclose(logps[1] - token[1], torch.full((2,), 20.0))


def test_grpo_fix_caps_negative_advantage_tokens_above_the_ratio_cap():
    logps = torch.zeros(2, 2, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.5, 1 / 1.1], [1 / 1.5, 1 / 1.1]]))  # r = 1.5, 1.1
    new_old, capped = grpo_fix_old_logps(logps, old, torch.tensor([1.0, -1.0]), eps_high=0.28)
    assert capped.tolist() == [[False, False], [True, False]]
    ratio = torch.exp(logps - new_old)
    assert ratio[1, 0].item() == pytest.approx(1.28) and ratio[1, 1].item() == pytest.approx(1.1)
    ratio[1, 0].backward()
    assert logps.grad.abs().sum() == 0  # the capped ratio is a constant


def test_post_clip_weights_are_sign_aware_and_count_sanitised_rows():
    logps = torch.zeros(3, 2)
    old = torch.log(torch.tensor([[1 / 1.5] * 2, [1 / 0.5] * 2, [1.0, 1.0]]))  # s = 1.5, 0.5, 1
    old[2, 0] = float("nan")
    adv = torch.tensor([1.0, 1.0, -1.0])
    out = post_clip_weights(logps, old, torch.ones(3, 2), adv, eps_low=0.2, eps_high=0.28)
    assert torch.allclose(out.s_bar[:2], torch.tensor([1.28, 0.5]))  # Â ≥ 0: min(s, clip(s))
    assert out.survives.tolist() == [False, True, True]
    assert out.sanitised.tolist() == [False, False, True]
    score = post_clip_weights(logps, old, torch.ones(3, 2), adv, 0.2, 0.28, score_form=True)
    assert score.survives.all()


def inputs_for(score_form=False, differentiate=False, transform_active=True, flip_to_score=False):
    logps = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-1.5, -1.5]], requires_grad=True)
    old = logps.detach() - 0.1
    adv = torch.tensor([1.0, -0.5, -0.5])
    s_bar = torch.tensor([1.1, 1.1, 1.1])
    s_tilde = torch.tensor([0.5, -0.4, 1.1])
    survives = torch.tensor([True, True, True])
    two_sided = torch.tensor([True, True, True])
    out = sequence_level_inputs(logps, old, adv, s_bar, s_tilde, survives, two_sided, score_form=score_form,
                                differentiate=differentiate, transform_active=transform_active,
                                flip_to_score=flip_to_score)
    return out, logps, old, adv, s_bar, s_tilde


def test_gspo_keeps_trls_inputs():
    out, _, _, adv, _, _ = inputs_for(transform_active=False)
    assert out.advantages is adv and out.old_per_token_logps is None


def test_ratio_form_scales_advantages_by_phi():
    out, _, _, adv, s_bar, s_tilde = inputs_for()
    assert torch.equal(out.advantages, adv * (s_tilde / s_bar)) and out.old_per_token_logps is None


def test_score_form_sets_old_to_the_detached_current_logps():
    out, logps, _, adv, _, s_tilde = inputs_for(score_form=True)
    assert torch.equal(out.advantages, adv * s_tilde)
    assert torch.equal(out.old_per_token_logps, logps.detach()) and not out.old_per_token_logps.requires_grad


def test_flipped_rows_take_the_score_representation_only_where_phi_is_negative():
    out, logps, old, adv, s_bar, s_tilde = inputs_for(flip_to_score=True)
    phi = s_tilde / s_bar
    assert torch.equal(out.advantages, torch.tensor([adv[0] * phi[0], adv[1] * s_tilde[1], adv[2] * phi[2]]))
    assert torch.equal(out.old_per_token_logps[1], logps.detach()[1])  # ratio 1 in value: never clipped
    assert torch.equal(out.old_per_token_logps[[0, 2]], old[[0, 2]])


def test_differentiated_form_keeps_the_graph_of_the_weights():
    s_bar = torch.tensor([1.1, 0.9], requires_grad=True)
    out = sequence_level_inputs(torch.zeros(2, 1), None, torch.tensor([1.0, -1.0]), s_bar, s_bar.detach() * 0.5,
                                torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool), score_form=False,
                                differentiate=True, transform_active=True, flip_to_score=False)
    assert out.advantages.requires_grad
