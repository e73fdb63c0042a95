"""What the exactness checks share (zero3.py, fsdp2_parity.py; layouts' check computes its reference the same way):
the fixed batch (12 rows in groups of 4 cut across processes and micro-steps, old log-probs shifted from the model's
by known amounts), the single-process reference s̄ and s̃, the rollout that serves each process its rows of the batch,
and a trainer that records every micro-step's s̄, s̃ and loss.
"""

from __future__ import annotations

from typing import Any

import torch
from dfpo_trl import DFPOTrainer, get_transform
from dfpo_trl.testing import record_row_weights
from dfpo_trl.testing.measures import consecutive_group_ids, sequence_log_ratio, sign_aware_post_clip
from transformers import AutoTokenizer

TRANSFORM = "min_replace"


EPS_LOW, EPS_HIGH = 0.2, 0.28


# 2 processes x 3 rows x 2 micro-steps = 12 rows, groups of 4: group 1 straddles the processes, every group
# straddles micro-steps, and no process holds a whole group in a micro-batch.
SIZES = dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=2, gradient_accumulation_steps=2)


def fixed_batch(model_path: str, world: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A generation batch of random completions with old log-probs shifted from the model's by known amounts."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = world * SIZES["per_device_train_batch_size"] * SIZES["steps_per_generation"]
    g = torch.Generator().manual_seed(seed)
    prompt = tokenizer("Compute 3 + 4. Give the final answer as: Answer: <number>", return_tensors="pt").input_ids
    completion_ids = torch.randint(100, tokenizer.vocab_size - 100, (rows, 12), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 8:] = 0
    rewards = torch.randint(0, 2, (rows,), generator=g).float().view(-1, SIZES["num_generations"])
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0  # every group has signal
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    return {
        "prompt_ids": prompt.repeat(rows, 1),
        "prompt_mask": torch.ones(rows, prompt.size(1), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": adv,
        "log_ratio_shift": 0.15 * torch.randn(rows, 1, generator=g) + 0.03 * torch.randn(rows, 12, generator=g),
    }


@torch.no_grad()
def model_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1).to(model.device)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).to(model.device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -batch["completion_ids"].size(1) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].to(model.device)[..., None])[..., 0].cpu()


class Recorder(DFPOTrainer):
    """Keeps the s̄, s̃ and loss of every micro-step: the sequence weights each micro-step's objective returns
    (tests/tiny.py's ``record_row_weights``)."""

    records: list[dict[str, Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.used: list[Any] = record_row_weights(self)  # every micro-step's RowWeights, in order (tests/tiny.py)

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        loss = super()._compute_loss(model, inputs)
        w = self.used[-1]
        self.records.append(
            {"row_ids": inputs["row_ids"].cpu(), "s_bar": w.s_bar.detach().float().cpu(),
             "s_tilde": w.s_tilde.detach().float().cpu(), "loss": float(loss.detach()), "layout": self.group_layout}
        )
        return loss


def reference_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, completion_mask: torch.Tensor, advantages: torch.Tensor,
    group_size: int, epsilon: tuple[float, float], transform: str = TRANSFORM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s̄ (the sequence ratio clipped on the advantage's side, eq. 47) and s̃ (``transform`` per group of
    ``group_size`` consecutive rows) of every row, in one process: what a sharded run's weights must equal."""
    rho = sequence_log_ratio(logps, old_logps, completion_mask)
    s_bar = sign_aware_post_clip(rho.exp(), advantages, *epsilon)
    groups = (-1, group_size)
    s_tilde = get_transform(transform).apply(s_bar.view(groups), advantages.view(groups), 0.5, 1e-6).reshape(-1)
    return s_bar, s_tilde


def serve_fixed_rows(trainer: Any, batch: dict[str, torch.Tensor], rank: int, local: int, group_size: int) -> None:
    """Make every rollout of ``trainer`` return process ``rank``'s ``local`` rows of ``batch`` with their global
    group and row ids, and keep the batch's old log-probs (they are not θ's, so the pre-pass must not skip them)."""
    device = trainer.accelerator.device
    rows = slice(rank * local, (rank + 1) * local)
    local_batch = {k: v[rows].to(device) for k, v in batch.items()}
    local_batch["num_items_in_batch"] = batch["completion_mask"].sum().to(device)
    local_batch["group_ids"] = consecutive_group_ids(local, group_size, offset=rank * local, device=device)
    local_batch["row_ids"] = torch.arange(rank * local, (rank + 1) * local, device=device)
    trainer._generate_and_score_completions = lambda _inputs: dict(local_batch)
    if trainer.pre_pass is not None:
        trainer.pre_pass.skip_forward_at_old_policy = False

