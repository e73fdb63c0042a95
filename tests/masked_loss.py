"""What each token's log-prob receives from a real training step under a loss mask, against DFPO's math.

Shared by the tests whose completions hold tokens that are not the policy's (TRL's ``tool_mask``: tool results in
``test_tools.py``, a ``rollout_func``'s ``env_mask`` in ``test_rollout_func.py``) and by those that check the rows
TRL cannot score (``objectives/test_unscorable.py``): a trainer that records every micro-step (the micro-batch
TRL's loss read, the policy forward's per-token log-probs with their gradient, the weights DFPO used, the loss),
and the exact per-token gradient of TRL's sequence-level "grpo" loss with DFPO's advantages.
"""

from __future__ import annotations

from typing import Any

import torch
from tiny import capturing, observe_micro_steps, record_row_weights

from dfpo_trl import DFPOTrainer
from dfpo_trl.metrics.step_reward import ROW_REWARD_KEY
from dfpo_trl.objectives.step import StepObjective


class RecordingTrainer(capturing(DFPOTrainer)):  # type: ignore[misc]
    """Keeps, for every micro-step, the micro-batch TRL's loss read, the per-token log-probs of its policy forward
    with their gradient, the s̄ / s̃ DFPO used and the loss (call :func:`start_recording` once built)."""

    records: list[dict[str, Any]]
    used_weights: list[Any]

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        self._micro = dict(inputs)  # DFPO rewrites a copy: these are TRL's inputs as the layout delivered them
        return super()._compute_loss(model, inputs)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.records.append({
            "inputs": self._micro, "logps": self.captured.detach().clone(), "grad": self.captured.grad.clone(),
            "weights": {k: v.detach().clone() for k, v in self.used_weights[-1]._asdict().items()},
            "loss": loss.detach().clone(),
        })
        return loss


def start_recording(trainer: RecordingTrainer) -> RecordingTrainer:
    """Empty records, and the weights each loss uses (what the group layout's row_weights returns) kept."""
    trainer.records = []
    trainer.used_weights = record_row_weights(trainer)
    return trainer


class GroupRecorder:
    """Every transformed set of whole groups (an observer of the trainer's objective) in a layout whose
    micro-batches hold whole groups, with the advantages and row rewards of the micro-batch it came from arranged as
    (num_groups, G)."""

    def __init__(self, trainer: RecordingTrainer) -> None:
        self.trainer, self.seen = trainer, []
        observe_micro_steps(trainer, self)

    def __call__(self, step: StepObjective) -> None:
        if step.values.grouped is not None:
            inputs = self.trainer._micro
            index = self.trainer.layout.group_index(inputs, "train")
            self.seen.append((step.values.grouped, inputs["advantages"][index], inputs[ROW_REWARD_KEY][index]))


def post_clip(s: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """s̄ (eq. 46–47): min(s, clip(s)) for Â ≥ 0, max(s, clip(s)) for Â < 0."""
    clipped = s.clamp(1 - eps_low, 1 + eps_high)
    return torch.where(advantages >= 0, torch.minimum(s, clipped), torch.maximum(s, clipped))


def sequence_weights(record: dict[str, Any], mask: torch.Tensor, eps_low: float, eps_high: float):
    """s = exp(ρ) with ρ_i the mean log-ratio over ``mask`` (eq. 44) and s̄ (eq. 46–47), from the micro-step's own
    log-probs, in float64."""
    inputs = record["inputs"]
    log_ratio = record["logps"].double() - inputs["old_per_token_logps"].double()
    mask = mask.double()
    s = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    return s, post_clip(s, inputs["advantages"].double(), eps_low, eps_high)


def expected_token_gradient(
    record: dict[str, Any], loss_mask: torch.Tensor, eps_low: float, eps_high: float, accumulation: int
) -> torch.Tensor:
    """∂loss/∂ℓ_{i,t} of TRL's sequence-level "grpo" loss with DFPO's advantages Â_i s̃_i / s̄_i: the policy term of
    row i is -Â_i (s̃_i/s̄_i) s̄_i(θ) averaged over the B rows and the accumulation steps, and ∂s̄_i/∂ℓ_{i,t} =
    s_i m_{i,t}/L_i where the clip lets the gradient through (s̄_i = s_i), 0 elsewhere. So every counted token of a
    row gets -Â_i s̃_i / (B · accumulation · L_i), with m = ``loss_mask`` and L_i = Σ_t m_{i,t}."""
    s, s_bar = sequence_weights(record, loss_mask, eps_low, eps_high)
    rows = loss_mask.size(0)
    length = loss_mask.sum(-1).double().clamp(min=1)
    survives = (s_bar == s).double()
    coefficient = -record["inputs"]["advantages"].double() * record["weights"]["s_tilde"].double() * survives
    return (coefficient / (rows * accumulation * length)).unsqueeze(1) * loss_mask.double()


def check_token_gradient(record: dict[str, Any], loss_mask: torch.Tensor, eps_low: float, eps_high: float,
                         accumulation: int) -> None:
    """Exactly no gradient where ``loss_mask`` is 0 (tokens that are not the policy's, padding), and DFPO's exact
    gradient -Â_i s̃_i / (B · accumulation · L_i) on the others, with L_i counting only them."""
    grad = record["grad"]
    assert grad.shape == loss_mask.shape
    assert bool((grad[loss_mask == 0] == 0).all()), grad[loss_mask == 0]
    expected = expected_token_gradient(record, loss_mask, eps_low, eps_high, accumulation)
    scale = float(expected.abs().max().clamp(min=1e-30))
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-6 * scale)
