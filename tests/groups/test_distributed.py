"""Groups spread over processes and micro-steps: two CPU processes (gloo) against the single-process reference.

Each process gets its slice of one hand-built generation batch, exactly as TRL slices a rollout, and runs the
micro-steps of one optimizer step (no parameter update in between, so every micro-step sees the same θ). The
per-sequence s̄ and s̃ each process used, and each micro-batch's loss, must equal a single-process computation
on the whole generation batch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import (
    WORDS,
    base_args,
    end_rank,
    free_port,
    hand_batch,
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
from dfpo_trl.objectives.cancellation import aggregation_factor, balance_group_weights, gradient_coefficients
from dfpo_trl.objectives.weights import clip_survivors, sequence_log_ratio, sign_aware_post_clip
from dfpo_trl.transforms import get_transform

pytestmark = pytest.mark.distributed
WORLD = 2
TRANSFORM = "positive_orth_proj"
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28)


def global_batch(rows: int, group_size: int, seed: int = 3) -> dict[str, Any]:
    """One generation batch for all processes, with old log-probs off the current policy by known amounts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(WORDS), (rows, 5), generator=g)
    mask = torch.ones(rows, 5, dtype=torch.long)
    mask[1, 3:] = 0
    rewards = torch.randn(rows, generator=g).view(-1, group_size)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)).view(-1)
    batch = hand_batch(ids, mask, adv, None)
    model = tiny_model()
    with torch.no_grad():
        out = model(
            input_ids=torch.cat([batch["prompt_ids"], ids], 1),
            attention_mask=torch.cat([batch["prompt_mask"], mask], 1),
        )
    logps = torch.log_softmax(out.logits[:, -ids.size(1) - 1 : -1].float(), -1).gather(-1, ids[..., None])[..., 0]
    shift = 0.15 * torch.randn(rows, 1, generator=g) + 0.05 * torch.randn(rows, 5, generator=g)
    batch["old_per_token_logps"] = logps - shift
    batch["reference_logps"] = logps
    return batch


def reference_weights(
    batch: dict[str, Any], group_size: int, target: str = "weights"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-process s̄, s̃ and a (eq. C1) for every row of the generation batch (docs/source/concepts/layouts.md's
    reference)."""
    rho = sequence_log_ratio(batch["reference_logps"], batch["old_per_token_logps"], batch["completion_mask"])
    adv = batch["advantages"]
    s_bar = sign_aware_post_clip(rho.exp(), adv, 0.2, 0.28)
    survives = clip_survivors(rho.exp(), adv, 0.2, 0.28)
    a = gradient_coefficients(adv, aggregation_factor(batch["completion_mask"], GSPO["loss_type"]), survives)
    grouped = (s_bar.view(-1, group_size), adv.view(-1, group_size))
    if target == "gradient":
        s_tilde, _ = balance_group_weights(TRANSFORM, *grouped, a.view(-1, group_size), survives.view(-1, group_size))
    else:
        s_tilde = get_transform(TRANSFORM).apply(*grouped, 0.5, 1e-6)
    return s_bar, s_tilde.reshape(-1), a


def worker(rank: int, port: int, sizes: dict[str, Any], batch_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    batch = torch.load(batch_path)
    args = DFPOConfig(**base_args(**GSPO, **sizes, group_transform=TRANSFORM))
    trainer = DFPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward, args=args,
                          train_dataset=__import__("tiny").addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    local = args.per_device_train_batch_size * args.steps_per_generation
    rows = slice(rank * local, (rank + 1) * local)
    local_batch = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()
                   if k != "reference_logps"}
    local_batch["group_ids"] = consecutive_group_ids(local, args.num_generations, offset=rank * local)
    local_batch["row_ids"] = torch.arange(rank * local, (rank + 1) * local)
    trainer._generate_and_score_completions = lambda _inputs: dict(local_batch)
    if trainer.pre_pass is not None:
        trainer.pre_pass.skip_forward_at_old_policy = False  # θ ≠ θ_old here: force the pre-pass forward
    used = record_row_weights(trainer)
    records = []
    for _ in range(args.gradient_accumulation_steps):  # the micro-steps of one optimizer step
        inputs = trainer._prepare_inputs(None)
        loss = trainer.compute_loss(trainer.model, inputs)
        weights = used[-1]
        micro = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        records.append(dict(layout=trainer.group_layout, loss=loss.detach(), row_ids=inputs["row_ids"].clone(),
                            s_bar=weights.s_bar.detach().clone(), s_tilde=weights.s_tilde.detach().clone(),
                            inputs=micro))
        trainer._step += 1
    torch.save(records, Path(out_dir) / f"rank{rank}.pt")
    trainers = [trainer]
    del trainer
    end_rank(trainers)


def reference_loss(inputs: dict[str, Any], phi: torch.Tensor, sizes: dict[str, int]) -> torch.Tensor:
    """TRL's own GSPO loss on the micro-batch with Â φ: what each process's loss must be (eq. 59–62)."""
    trainer = GRPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward,
                          args=GRPOConfig(**base_args(**GSPO)),  # its batch sizes do not enter the loss
                          train_dataset=__import__("tiny").addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = sizes["gradient_accumulation_steps"]
    batch = {k: v for k, v in inputs.items() if not k.startswith("dfpo_")}
    batch["advantages"] = batch["advantages"] * phi
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch)


@pytest.mark.parametrize(
    ("sizes", "layout"),
    [
        # 12 rows, 3 groups of 4; 6 per process: group 1 straddles the processes, groups straddle micro-steps.
        (dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=2,
              gradient_accumulation_steps=2), "pre_pass"),
        # One optimizer step per micro-step: the pre-pass also forwards the group members of the other one.
        (dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=2,
              gradient_accumulation_steps=1), "pre_pass"),
        # 4 rows, one group split over the two processes in the same micro-step: all-gather only.
        (dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=1,
              gradient_accumulation_steps=1, num_iterations=2), "cross_process"),
        # The gradient target (docs/source/concepts/cancellation.md) in both layouts that gather: U and c travel with s̄
        # and Â.
        (dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=2,
              gradient_accumulation_steps=2, cancellation_target="gradient"), "pre_pass"),
        (dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=1,
              gradient_accumulation_steps=1, num_iterations=2, cancellation_target="gradient"), "cross_process"),
    ],
)
def test_coefficients_and_loss_match_single_process(tmp_path, sizes, layout):
    rows = WORLD * sizes["per_device_train_batch_size"] * sizes["steps_per_generation"]
    batch = global_batch(rows, sizes["num_generations"])
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(worker, (free_port(), sizes, str(tmp_path / "batch.pt"), str(tmp_path)), nprocs=WORLD)
    target = sizes.get("cancellation_target", "weights")
    s_bar_ref, s_tilde_ref, a_ref = reference_weights(batch, sizes["num_generations"], target)
    if target == "gradient":  # the reference itself balances the surviving gradient coefficients (eq. C1)
        terms = (a_ref * s_tilde_ref).view(-1, sizes["num_generations"])
        assert_close_to_rounding(terms.sum(-1), 0.0, scale=terms.abs().sum(-1), dtype=s_tilde_ref.dtype)
        assert (a_ref != 0).any()
    seen = []
    for rank in range(WORLD):
        for record in torch.load(tmp_path / f"rank{rank}.pt"):
            assert record["layout"] == layout
            ids = record["row_ids"]
            seen.append(ids)
            assert torch.allclose(record["s_bar"], s_bar_ref[ids], atol=1e-5)
            assert torch.allclose(record["s_tilde"], s_tilde_ref[ids], atol=1e-5)
            phi = s_tilde_ref[ids] / s_bar_ref[ids]
            # the loss averages terms Â_i φ_i s_i of either sign: its rounding is relative to their size
            terms = (record["inputs"]["advantages"] * phi).abs().mean()
            assert_close_to_rounding(record["loss"], reference_loss(record["inputs"], phi, sizes), scale=terms)
    covered = torch.cat(seen).unique()
    assert covered.numel() == rows // (sizes["steps_per_generation"] // sizes["gradient_accumulation_steps"])
    assert (s_tilde_ref != s_bar_ref).any()  # the transform acted, so the comparison has teeth


GROUP_METRICS = (
    "asym/before", "asym/after", "transform/orth_residual", "transform/phi_min", "transform/phi_mean",
    "transform/sanitised_weights", "cancellation/one_sided_groups", "cancellation/shared_prefix_residual",
    "cancellation/shared_prefix_residual_two_sided",
)
METRIC_SIZES = dict(per_device_train_batch_size=4, num_generations=2, steps_per_generation=2,
                    gradient_accumulation_steps=2, cancellation_target="gradient")


def metrics_batch(rows: int) -> dict[str, Any]:
    """The generation batch of the metric test: every group shares its first two completion tokens."""
    batch = global_batch(rows, METRIC_SIZES["num_generations"], seed=5)
    batch["completion_ids"][:, :2] = torch.tensor([16, 17])
    return batch


def logged_group_metrics(trainer: DFPOTrainer, micro_batches: list[dict[str, Any]]) -> dict[str, float]:
    """Loss and backward of each micro-batch (whole groups, consecutive rows), then TRL's `log`."""
    trainer.current_gradient_accumulation_steps = len(micro_batches)
    for micro in micro_batches:
        trainer.compute_loss(trainer.model, dict(micro)).backward()
    trainer.log({})
    return {k: v for k, v in trainer.state.log_history[-1].items() if k in GROUP_METRICS}


def metric_trainer() -> DFPOTrainer:
    args = DFPOConfig(**base_args(**GSPO, **METRIC_SIZES, group_transform=TRANSFORM))
    trainer = DFPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward, args=args,
                          train_dataset=__import__("tiny").addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    assert trainer.group_layout == "group_granular"
    return trainer


def split_rows(batch: dict[str, Any], start: int, stop: int, size: int) -> list[dict[str, Any]]:
    out = []
    for lo in range(start, stop, size):
        micro = {k: (v[lo:lo + size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()
                 if k != "reference_logps"}
        micro["group_ids"] = consecutive_group_ids(size, METRIC_SIZES["num_generations"], offset=lo)
        out.append(micro)
    return out


def metric_worker(rank: int, port: int, batch_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    batch = torch.load(batch_path)
    trainer = metric_trainer()
    local = METRIC_SIZES["per_device_train_batch_size"] * METRIC_SIZES["steps_per_generation"]
    size = METRIC_SIZES["per_device_train_batch_size"]
    logged = logged_group_metrics(trainer, split_rows(batch, rank * local, (rank + 1) * local, size))
    torch.save(logged, Path(out_dir) / f"metrics{rank}.pt")
    trainers = [trainer]
    del trainer
    end_rank(trainers)


def test_group_metrics_mean_the_same_at_one_and_two_processes(tmp_path):
    """Group-granular layout: each process transforms its own groups, so its metrics cover only those. Logged,
    they must be the metrics of all groups of every process, i.e. what one process logs for the whole batch."""
    local = METRIC_SIZES["per_device_train_batch_size"] * METRIC_SIZES["steps_per_generation"]
    batch = metrics_batch(WORLD * local)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(metric_worker, (free_port(), str(tmp_path / "batch.pt"), str(tmp_path)), nprocs=WORLD)
    single = logged_group_metrics(metric_trainer(), split_rows(batch, 0, WORLD * local,
                                                                METRIC_SIZES["per_device_train_batch_size"]))
    assert set(single) == set(GROUP_METRICS)
    per_rank = [torch.load(tmp_path / f"metrics{rank}.pt") for rank in range(WORLD)]
    for logged in per_rank:
        assert logged.keys() == single.keys()
        for name, value in single.items():
            assert logged[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    # the processes did see different groups: their own means differ, so the gather is what makes them equal
    halves = [logged_group_metrics(metric_trainer(), split_rows(batch, r * local, (r + 1) * local, 4))
              for r in range(WORLD)]
    assert halves[0]["asym/before"] != pytest.approx(halves[1]["asym/before"], rel=1e-3)
