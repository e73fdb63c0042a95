"""The ``redistributed`` layout on four CPU processes (gloo) against the single-process reference.

Each process gets its slice of one hand-built generation batch exactly as TRL slices a rollout (trimmed to its own
widest row, so the processes' widths differ and the exchange must pad), then runs the micro-steps of one
optimizer step. Required (docs/source/concepts/layouts.md): every micro-step holds whole groups across the processes,
every row is trained exactly once, the s̄ and s̃ each process used equal a single-process computation on the whole
generation batch, and each micro-step's loss and parameter gradients equal TRL's own loss (``GRPOTrainer``) on the same
rows with the reference coefficients.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed import GSPO, TRANSFORM, global_batch, reference_weights
from tiny import (
    addition_dataset,
    base_args,
    end_rank,
    free_port,
    last_digit_reward,
    record_row_weights,
    spawn_ranks,
    tiny_model,
    tiny_tokenizer,
)
from tolerance import assert_close_to_rounding
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.groups.ids import consecutive_group_ids
from dfpo_trl.groups.redistribute import exchange_plan, pad_to_widths, per_row_keys, redistribution_plan, trim_padding

WORLD = 4


def ragged_batch(rows: int, group_size: int, seed: int) -> dict[str, Any]:
    """``global_batch`` with left-padded prompts and completions of different lengths, so that each process's
    slice, trimmed to its own widest row, has its own widths."""
    batch = global_batch(rows, group_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompt_pad = torch.randint(0, 3, (rows,), generator=g)  # 0..2 leading padding positions of 3
    batch["prompt_mask"] = (torch.arange(3).unsqueeze(0) >= prompt_pad.unsqueeze(1)).long()
    lengths = torch.randint(1, 6, (rows,), generator=g)
    batch["completion_mask"] = (torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)).long()
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    shift = batch["reference_logps"] - batch["old_per_token_logps"]
    with torch.no_grad():  # the current log-probs under the new prompt padding (same model as global_batch's)
        logits = tiny_model()(
            input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
        ).logits
    ids = batch["completion_ids"]
    logps = torch.log_softmax(logits[:, -ids.size(1) - 1 : -1].float(), -1).gather(-1, ids[..., None])[..., 0]
    batch["reference_logps"], batch["old_per_token_logps"] = logps, logps - shift
    return batch


def local_slice(batch: dict[str, Any], rank: int, local: int, group_size: int) -> dict[str, Any]:
    """Process ``rank``'s rollout as TRL returns it: its rows, padded only to its own widest row."""
    rows = slice(rank * local, (rank + 1) * local)
    out = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()
           if k != "reference_logps"}
    out["group_ids"] = consecutive_group_ids(local, group_size, offset=rank * local)
    out["row_ids"] = torch.arange(rank * local, (rank + 1) * local)
    return trim_padding(out, per_row_keys(out, local))


def worker(rank: int, port: int, sizes: dict[str, Any], batch_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    batch = torch.load(batch_path)
    args = DFPOConfig(**base_args(**{**GSPO, **sizes}, group_transform=TRANSFORM))
    trainer = DFPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    local = args.per_device_train_batch_size * args.steps_per_generation
    local_batch = local_slice(batch, rank, local, args.num_generations)
    trainer._generate_and_score_completions = lambda _inputs: dict(local_batch)
    used = record_row_weights(trainer)
    records = []
    for _ in range(args.steps_per_generation):  # every micro-step of the rollout, no update in between: one θ
        inputs = trainer._prepare_inputs(None)
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        weights = used[-1]
        micro = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        records.append(dict(layout=trainer.group_layout, loss=loss.detach(), row_ids=inputs["row_ids"].clone(),
                            s_bar=weights.s_bar.detach().clone(), s_tilde=weights.s_tilde.detach().clone(),
                            inputs=micro, grads=grads))
        trainer._step += 1
    torch.save(records, Path(out_dir) / f"rank{rank}.pt")
    trainers = [trainer]
    del trainer
    end_rank(trainers)


def reference_loss_and_grads(
    inputs: dict[str, Any], phi: torch.Tensor, sizes: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's own loss on the micro-batch with Â φ (eq. 59–62), and its parameter gradients."""
    config = {**GSPO, **{k: v for k, v in sizes.items() if k in ("loss_type",)}}
    trainer = GRPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward,
                          args=GRPOConfig(**base_args(**config, steps_per_generation=sizes["steps_per_generation"],
                                                      gradient_accumulation_steps=sizes["gradient_accumulation_steps"])),
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = sizes["gradient_accumulation_steps"]
    batch = {k: v for k, v in inputs.items() if not k.startswith("dfpo_")}
    batch["advantages"] = batch["advantages"] * phi
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grads


@pytest.mark.distributed
@pytest.mark.parametrize(
    "sizes",
    [
        # The paper's shape scaled down: per-device batch 1, G = processes = 4; micro-step k on process p holds
        # member p of group k.
        dict(per_device_train_batch_size=1, num_generations=4, steps_per_generation=4, gradient_accumulation_steps=2),
        # Two groups per micro-step, and DAPO's normaliser (num_items_in_batch, the rollout's global token count).
        dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=2, gradient_accumulation_steps=2,
             loss_type="dapo"),
        # Groups of 4 over per-device batches of 3: a group's members sit on two or three processes.
        dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=2, gradient_accumulation_steps=1),
    ],
)
def test_redistributed_matches_single_process(tmp_path, sizes):
    rows = WORLD * sizes["per_device_train_batch_size"] * sizes["steps_per_generation"]
    group_size = sizes["num_generations"]
    batch = ragged_batch(rows, group_size, seed=11)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(worker, (free_port(), sizes, str(tmp_path / "batch.pt"), str(tmp_path)), nprocs=WORLD)
    s_bar_ref, s_tilde_ref, _ = reference_weights(batch, group_size)
    assert (s_tilde_ref != s_bar_ref).any()  # the transform acted, so the comparison has teeth
    records = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    seen = []
    for step in range(sizes["steps_per_generation"]):
        step_ids = torch.cat([records[rank][step]["row_ids"] for rank in range(WORLD)])
        # whole groups across the processes in every micro-step, none inside one process's micro-batch
        counts = torch.bincount(step_ids // group_size)
        assert set(counts[counts > 0].tolist()) == {group_size}
        seen.append(step_ids)
        for rank in range(WORLD):
            record = records[rank][step]
            assert record["layout"] == "redistributed"
            ids = record["row_ids"]
            assert torch.equal(record["inputs"]["group_ids"], ids // group_size)
            assert torch.equal(record["inputs"]["num_items_in_batch"], batch["num_items_in_batch"])
            assert torch.allclose(record["s_bar"], s_bar_ref[ids], atol=1e-5)
            assert torch.allclose(record["s_tilde"], s_tilde_ref[ids], atol=1e-5)
            # the rows arrived intact: ids, masks, advantages and old log-probs of the generation batch
            mask = record["inputs"]["completion_mask"]
            width = mask.size(1)
            assert torch.equal(record["inputs"]["advantages"], batch["advantages"][ids])
            assert torch.equal(mask, batch["completion_mask"][ids][:, :width])
            assert batch["completion_mask"][ids][:, width:].sum() == 0
            completion_ids = batch["completion_ids"][ids][:, :width]
            assert torch.equal(record["inputs"]["completion_ids"] * mask, completion_ids * mask)
            old = batch["old_per_token_logps"][ids][:, :width]
            assert torch.equal(record["inputs"]["old_per_token_logps"] * mask, old * mask)
            prompt_mask = record["inputs"]["prompt_mask"]
            assert torch.equal(prompt_mask, batch["prompt_mask"][ids][:, 3 - prompt_mask.size(1):])
            assert batch["prompt_mask"][ids][:, : 3 - prompt_mask.size(1)].sum() == 0
            loss, grads = reference_loss_and_grads(record["inputs"], s_tilde_ref[ids] / s_bar_ref[ids], sizes)
            if sizes.get("loss_type") == "dapo":  # TRL's normaliser is num_items_in_batch / num_processes
                loss, grads = loss * WORLD, grads * WORLD
            terms = (record["inputs"]["advantages"] * s_tilde_ref[ids] / s_bar_ref[ids]).abs().mean()
            assert_close_to_rounding(record["loss"], loss, scale=terms)  # a mean of terms of either sign
            assert_close_to_rounding(record["grads"], grads)
    everything = torch.cat(seen)
    assert torch.equal(torch.sort(everything).values, torch.arange(rows))  # every row trained exactly once
    # the processes' rollouts had different widths, so the exchange had to pad (and trim again)
    local = rows // WORLD
    assert len({tuple(local_slice(batch, r, local, group_size)["completion_ids"].shape) for r in range(WORLD)}) > 1


def test_plan_puts_member_p_of_group_k_on_process_p_at_step_k() -> None:
    """The paper's shape: per-device batch 1, G = P; each group fills one micro-step, member p on process p."""
    rows, group_size = 16, 4
    row_ids = torch.randperm(rows, generator=torch.Generator().manual_seed(0))  # any order in, ids decide
    destination, index = redistribution_plan(row_ids, row_ids // group_size, group_size, 1, 4,
                                             torch.Generator().manual_seed(1))
    for group in range(4):
        members = (row_ids // group_size) == group
        assert torch.equal(destination[members][torch.argsort(row_ids[members])], torch.arange(4))
        assert index[members].unique().numel() == 1  # one micro-step per group
    assert torch.equal(torch.sort(index[destination == 0]).values, torch.arange(4))


def test_plan_refuses_what_cannot_be_whole() -> None:
    rows = torch.arange(12)
    with pytest.raises(ValueError, match="per_device_train_batch_size × num_processes = 3 × 2 = 6 to be a multiple"):
        redistribution_plan(rows, rows // 4, 4, 3, 2)
    with pytest.raises(ValueError, match=r"group sizes \[3, 5\] occur"):
        redistribution_plan(rows, torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]), 4, 2, 2)


def test_exchange_plan_is_a_permutation_of_rows() -> None:
    """Simulated all-to-all: what every process receives, placed by the plan, is exactly its planned rows."""
    world, per_device, group_size, steps = 4, 3, 4, 2
    rows = world * per_device * steps
    local = rows // world
    row_ids = torch.arange(rows)
    destination, index = redistribution_plan(row_ids, row_ids // group_size, group_size, per_device, world,
                                             torch.Generator().manual_seed(2))
    plans = [exchange_plan(destination, index, p, world) for p in range(world)]
    sent = [row_ids[p * local:(p + 1) * local][plans[p].send_order] for p in range(world)]
    chunks = [list(s.split(plans[p].send_counts)) for p, s in enumerate(sent)]
    for p in range(world):
        received = torch.cat([chunks[source][p] for source in range(world)])
        assert [len(chunks[source][p]) for source in range(world)] == plans[p].receive_counts
        placed = torch.empty_like(received)
        placed[plans[p].receive_order] = received
        expected = torch.full((local,), -1)
        expected[index[destination == p]] = row_ids[destination == p]
        assert torch.equal(placed, expected)


def test_padding_and_trimming_round_trip() -> None:
    batch = {
        "prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[1, 2], [3, 0]]), "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]), "advantages": torch.tensor([1.0, -1.0]),
        "num_items_in_batch": torch.tensor(3),
    }
    keys = per_row_keys(batch, 2)
    assert "num_items_in_batch" not in keys
    padded = pad_to_widths(batch, keys, 5, 4)
    assert padded["prompt_ids"].tolist() == [[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]]
    assert padded["completion_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert padded["old_per_token_logps"].shape == (2, 4)
    trimmed = trim_padding(padded, keys)
    for key in keys:
        assert torch.equal(trimmed[key], batch[key]), key
    with pytest.raises(ValueError, match="'pixel_values'.*cannot move"):
        per_row_keys({**batch, "pixel_values": torch.zeros(7, 3)}, 2)
