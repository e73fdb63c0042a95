"""The pre-pass forwards only the groups an optimizer step trains (docs/source/concepts/layouts.md, "The pre-pass and
its cost").

The pre-pass layout lays each process's groups in consecutive rows (groups in a seeded random order), so an
optimizer step of R = A·b rows touches G·⌈R/G⌉ rows' worth of groups, not every local group as after TRL's
per-sample shuffle. Counted independently of the pre-pass's code: a forward pre-hook on the model counts the rows of
every forward run without gradient, in the optimizer steps that do not generate (where GRPOTrainer runs none).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import (
    addition_dataset,
    base_args,
    end_rank,
    free_port,
    last_digit_reward,
    spawn_ranks,
    tiny_model,
    tiny_tokenizer,
)
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.groups.choice import describe_layout, pre_pass_rows
from dfpo_trl.groups.ids import consecutive_group_ids

pytestmark = pytest.mark.usefixtures("one_thread")
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28)


class NoGradRows(TrainerCallback):
    """Rows of every no-grad forward of the policy, per optimizer step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.per_step: list[int] = []
        self._rows = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._rows += 0 if ids is None else ids.size(0)

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self._rows = 0

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.per_step.append(self._rows)


def no_grad_rows(trainer_cls: type, config_cls: type, sizes: dict[str, int], steps: int, **extra: Any) -> list[int]:
    model = tiny_model()
    counter = NoGradRows(model)
    args = config_cls(**base_args(**GSPO, **sizes, **extra, max_steps=steps, max_completion_length=4))
    trainer = trainer_cls(model=model, reward_funcs=last_digit_reward, args=args, train_dataset=addition_dataset(64),
                          processing_class=tiny_tokenizer(), callbacks=[counter])
    trainer.train()
    return counter.per_step


CASES = [  # b < G; b < G with R < G; G not a multiple of b; R = b·A not a multiple of b's G; b ≥ G
    dict(per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=8),
    dict(per_device_train_batch_size=1, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=8),
    dict(per_device_train_batch_size=3, num_generations=4, gradient_accumulation_steps=4, steps_per_generation=8),
    dict(per_device_train_batch_size=2, num_generations=3, gradient_accumulation_steps=3, steps_per_generation=6),
    dict(per_device_train_batch_size=6, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4),
    dict(per_device_train_batch_size=3, num_generations=4, gradient_accumulation_steps=1, steps_per_generation=4),
]


@pytest.mark.parametrize("sizes", CASES, ids=lambda s: "b{per_device_train_batch_size}-G{num_generations}-A"
                         "{gradient_accumulation_steps}-S{steps_per_generation}".format(**s))
def test_pre_pass_forwards_the_step_groups_only(sizes):
    b, G = sizes["per_device_train_batch_size"], sizes["num_generations"]
    A, S = sizes["gradient_accumulation_steps"], sizes["steps_per_generation"]
    per_rollout = S // A
    counted = no_grad_rows(DFPOTrainer, DFPOConfig, sizes, 2 * per_rollout, group_transform="min_replace")
    expected = pre_pass_rows(b, A, S, G)
    off_policy = [counted[k] for k in range(2 * per_rollout) if k % per_rollout]
    assert off_policy == [r for _ in range(2) for r in expected[1:]]
    R = A * b
    if R % G == 0 or G % R == 0:  # the target: G·⌈R/G⌉ per off-policy step
        assert set(off_policy) == {G * -(-R // G)}
    else:
        assert all(r <= G * (-(-R // G) + 1) for r in off_policy)


def test_trl_runs_no_forward_in_the_steps_that_do_not_generate():
    """The baseline of the count: GRPOTrainer's no-grad forwards are all in the generating steps."""
    sizes = CASES[0]
    per_rollout = sizes["steps_per_generation"] // sizes["gradient_accumulation_steps"]
    counted = no_grad_rows(GRPOTrainer, GRPOConfig, sizes, 2 * per_rollout)
    assert [counted[k] for k in range(2 * per_rollout) if k % per_rollout] == [0] * (2 * (per_rollout - 1))
    assert all(counted[k] > 0 for k in range(0, 2 * per_rollout, per_rollout))


def test_the_layout_line_states_the_counted_rows():
    args = DFPOConfig(**base_args(**GSPO, **CASES[0], group_transform="min_replace"))
    line = describe_layout("pre_pass", args, 1)
    assert "3 of every 4 optimizer steps add a no-grad forward over 4 rows per process (4 trained)" in line, line


def test_pre_pass_rows_counts_windows_over_consecutive_groups():
    # R = 3, G = 4: the windows [3, 6), [6, 9), [9, 12) touch groups {0, 1}, {1, 2}, {2}
    assert pre_pass_rows(3, 1, 4, 4) == [0, 8, 8, 4]
    # the 32B recipe's one-node launch (b 1, A 32, S 128, G 32): F = R = 32, not 4R
    assert pre_pass_rows(1, 32, 128, 32) == [0, 32, 32, 32]
    # a second pass over the buffer (num_iterations 2) starts from its first rows, at a θ that moved
    assert pre_pass_rows(2, 2, 4, 4, iterations=2) == [0, 4, 4, 4]


def _rank(rank: int, port: int, sizes: dict[str, int], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    # b × processes = 4 is a multiple of G: "auto" would redistribute; the pre-pass is what is counted here
    args = DFPOConfig(**base_args(**GSPO, **sizes, group_transform="min_replace", group_layout="pre_pass"))
    trainer = DFPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    local = args.per_device_train_batch_size * args.steps_per_generation
    g = torch.Generator().manual_seed(5)
    rows = 2 * local
    ids = torch.randint(3, 10, (rows, 4), generator=g)
    rewards = torch.randn(rows, generator=g)
    advantages = rewards - rewards.view(-1, args.num_generations).mean(1).repeat_interleave(args.num_generations)
    part = slice(rank * local, (rank + 1) * local)
    batch = {
        "prompt_ids": torch.full((local, 2), 3), "prompt_mask": torch.ones(local, 2, dtype=torch.long),
        "completion_ids": ids[part], "completion_mask": torch.ones(local, 4, dtype=torch.long),
        "advantages": advantages[part], "old_per_token_logps": -2.0 - 0.1 * torch.rand(local, 4, generator=g),
        "num_items_in_batch": torch.tensor(rows * 4),
        "group_ids": consecutive_group_ids(local, args.num_generations, offset=rank * local),
        "row_ids": torch.arange(rank * local, (rank + 1) * local),
    }
    trainer._generate_and_score_completions = lambda _inputs: dict(batch)
    forwarded: list[int] = []
    assert trainer.pre_pass is not None
    forward = trainer.pre_pass.forward

    def counting(ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        forwarded[-1] += ids.size(0)
        return forward(ids, *rest)

    trainer.pre_pass.forward = counting
    for micro_step in range(args.steps_per_generation):
        if micro_step % args.gradient_accumulation_steps == 0:
            forwarded.append(0)
        inputs = trainer._prepare_inputs(None)
        trainer.compute_loss(trainer.model, inputs)
        trainer._step += 1
        if (micro_step + 1) % args.gradient_accumulation_steps == 0:
            trainer.state.global_step += 1
    torch.save(forwarded, Path(out_dir) / f"rank{rank}.pt")
    trainers = [trainer]
    del trainer
    end_rank(trainers)


@pytest.mark.distributed
def test_two_processes_forward_their_step_groups_only(tmp_path):
    sizes = dict(per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=2,
                 steps_per_generation=8)
    spawn_ranks(_rank, (free_port(), sizes, str(tmp_path)))
    expected = pre_pass_rows(2, 2, 8, 4)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == expected
