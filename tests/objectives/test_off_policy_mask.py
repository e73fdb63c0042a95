"""TRL's off-policy sequence mask (``off_policy_mask_threshold``) with DFPO (docs/source/concepts/cancellation.md,
"TRL's off-policy mask"): folded into the survivors U under ``cancellation_target="gradient"``, in every layout that
computes the row weights; refused with a balancing transform under ``"weights"``; DFPO off is still TRL's loss."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import (
    base_args,
    capturing,
    end_rank,
    free_port,
    loss_and_grads,
    make_trainer,
    record_pre_passes,
    record_row_weights,
    shared_prefix_residual,
    spawn_ranks,
    with_old_logps,
)
from tolerance import assert_close_to_rounding
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.groups.ids import WHOLE_GROUPS_KEY, consecutive_group_ids
from dfpo_trl.objectives.cancellation import aggregation_factor, gradient_coefficients
from dfpo_trl.objectives.weights import loss_mask
from dfpo_trl.transforms import GROUP_TRANSFORMS, TRANSFORMS

# the built-in transforms whose balance condition cancellation_target="gradient" can retarget
BALANCING_TRANSFORMS = tuple(name for name in GROUP_TRANSFORMS if TRANSFORMS[name].retargetable)

pytestmark = pytest.mark.usefixtures("one_thread")

GSPO = dict(importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.28, steps_per_generation=2,
            loss_type="grpo")
THRESHOLD = 0.1
ADVANTAGES = [1.0, 0.8, -0.3, -1.5]
# Every member inside the clip [0.8, 1.28]. TRL's mask reads the mean KL old − current = −log s: member 3
# (Â < 0, KL 0.16 > 0.1) is masked; member 4 (Â < 0, KL 0.05) is kept; Â ≥ 0 is always kept.
RATIOS = [1.05, 1.2, 0.85, 0.95]
LENGTHS = [3, 5, 4, 5]
MASKED = 2


def masked_group(trainer: Any, ratios: list[float] = RATIOS, advantages: list[float] = ADVANTAGES,
                 **extra: Any) -> dict[str, Any]:
    """G = 4 sharing a 2-token prefix, unequal lengths, sequence ratios exactly ``ratios``."""
    ids = torch.tensor([[16, 17, 5, 6, 7], [16, 17, 8, 9, 10], [16, 17, 4, 4, 11], [16, 17, 12, 3, 3]])
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in LENGTHS])
    log_ratio = torch.log(torch.tensor(ratios)).unsqueeze(1).expand(4, 5).clone()
    return with_old_logps(trainer, ids, mask, torch.tensor(advantages), log_ratio, **extra)


def residual(coefficients: torch.Tensor, batch: dict[str, Any]) -> float:
    """|Σ_i c_{i,t}| / Σ_i |c_{i,t}| on the shared prefix: the trained gradient's in-group balance."""
    value, count = shared_prefix_residual(coefficients.unsqueeze(0), batch["completion_ids"].unsqueeze(0),
                                          batch["completion_mask"].unsqueeze(0))
    assert int(count) == 2
    return float(value)


def trl_trainer(**overrides: Any) -> Any:
    return make_trainer(capturing(GRPOTrainer), GRPOConfig, **{**GSPO, **overrides})


def balance_terms(weights: Any, batch: dict[str, Any], loss_type: str = "grpo") -> torch.Tensor:
    """a_i s̃_i with a_i = Â_i c_i 1[i ∈ U] (eq. C1), the surviving rows' terms of the balance."""
    factor = aggregation_factor(loss_mask(batch), loss_type, micro_batch_tokens=loss_mask(batch).sum().expand(4))
    return gradient_coefficients(batch["advantages"], factor, weights.survives) * weights.s_tilde.double()


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("transform", BALANCING_TRANSFORMS)
def test_weights_target_with_a_balancing_transform_refuses_the_mask(transform):
    with pytest.raises(ValueError, match="off_policy_mask_threshold") as info:
        DFPOConfig(**base_args(**GSPO, group_transform=transform, off_policy_mask_threshold=THRESHOLD))
    message = str(info.value)
    assert "cancellation_target='weights'" in message and f"group_transform={transform!r}" in message
    assert "Set cancellation_target='gradient'" in message and "off_policy_mask_threshold=None" in message


def test_mask_is_accepted_where_nothing_balances_or_the_balance_includes_it():
    for options in (dict(), dict(group_transform="scale"), dict(log_mechanism_metrics=True),
                    dict(group_transform="min_replace", cancellation_target="gradient"),
                    dict(group_transform="positive_orth_proj", cancellation_target="gradient")):
        DFPOConfig(**base_args(**GSPO, **options, off_policy_mask_threshold=THRESHOLD))
    with pytest.raises(ValueError, match="rewritten old log-probabilities"):  # the flipped rows' score form
        DFPOConfig(**base_args(**GSPO, group_transform="orth_proj", cancellation_target="gradient",
                               off_policy_mask_threshold=THRESHOLD))


# ------------------------------------------------------------------------------- through the real compute_loss
def test_dfpo_off_with_the_mask_is_trls_loss():
    """Every DFPO option off: the same loss and gradients as GRPOTrainer with the mask, bit for bit."""
    theirs = trl_trainer(off_policy_mask_threshold=THRESHOLD)
    ours = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, off_policy_mask_threshold=THRESHOLD)
    batch = masked_group(theirs)
    loss_theirs, grads_theirs = loss_and_grads(theirs, batch)
    loss_ours, grads_ours = loss_and_grads(ours, batch)
    assert torch.equal(loss_ours, loss_theirs)
    assert grads_ours.keys() == grads_theirs.keys()
    for name, grad in grads_theirs.items():
        assert torch.equal(grads_ours[name], grad), name
    assert theirs.captured.grad[MASKED].abs().max() == 0  # the mask did mask a member
    unmasked = trl_trainer()
    loss_and_grads(unmasked, batch)
    assert unmasked.captured.grad[MASKED].abs().max() > 0


@pytest.mark.parametrize("transform", [t for t in BALANCING_TRANSFORMS if t != "orth_proj"])  # refused: see above
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gradient_target_balances_over_the_rows_that_survive_clip_and_mask(transform, loss_type):
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **{**GSPO, "loss_type": loss_type},
                           group_transform=transform, cancellation_target="gradient",
                           off_policy_mask_threshold=THRESHOLD)
    batch = masked_group(trainer)
    used = record_row_weights(trainer)
    loss, _ = loss_and_grads(trainer, batch)
    weights = used[-1]
    assert weights.survives.tolist() == [True, True, False, True]  # U: the clip's survivors that TRL keeps
    coefficients = trainer.captured.grad
    assert coefficients[MASKED].abs().max() == 0  # TRL masked it: zero weight in the trained gradient
    assert coefficients[[0, 1, 3], 2:].abs().max() > 1e-6
    # the balance over the surviving rows, from the weights and from the trained gradient itself
    terms = balance_terms(weights, batch, loss_type)
    assert_close_to_rounding(terms.sum(), 0.0, scale=terms.abs().sum(), dtype=torch.float32)
    assert_close_to_rounding(residual(coefficients, batch), 0.0, scale=1.0, dtype=torch.float32)
    # and the loss is still TRL's own, mask included, on the advantages Â φ
    theirs = trl_trainer(loss_type=loss_type, off_policy_mask_threshold=THRESHOLD)
    phi = weights.s_tilde / weights.s_bar
    reference, _ = loss_and_grads(theirs, {**batch, "advantages": batch["advantages"] * phi})
    assert_close_to_rounding(loss, reference, scale=(batch["advantages"] * phi).abs().mean())
    assert_close_to_rounding(coefficients, theirs.captured.grad)


def test_without_the_fold_the_mask_breaks_the_balance():
    """What the fold fixes: the weights balanced without the mask, then masked by TRL, leave a residual."""
    unaware = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, group_transform="min_replace",
                           cancellation_target="gradient")
    batch = masked_group(unaware)
    used = record_row_weights(unaware)
    loss_and_grads(unaware, batch)
    phi = used[-1].s_tilde / used[-1].s_bar
    masked_by_trl = trl_trainer(off_policy_mask_threshold=THRESHOLD)
    loss_and_grads(masked_by_trl, {**batch, "advantages": batch["advantages"] * phi})
    assert residual(masked_by_trl.captured.grad, batch) > 1e-2


def test_the_mask_reads_the_sampler_log_probs_when_the_rollout_has_them():
    """With the sampler's log-probs (vLLM), TRL's mask compares them, not the old ones, with the current ones:
    here member 4 is masked (KL 0.3) and member 3 kept (KL 0.05), whatever the old log-probs say."""
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO, group_transform="min_replace",
                           cancellation_target="gradient", off_policy_mask_threshold=THRESHOLD)
    batch = masked_group(trainer)
    current = batch["old_per_token_logps"] + torch.log(torch.tensor(RATIOS)).unsqueeze(1)
    batch["sampling_per_token_logps"] = current + torch.tensor([[0.5], [0.5], [0.05], [0.3]])
    used = record_row_weights(trainer)
    loss_and_grads(trainer, batch)
    assert used[-1].survives.tolist() == [True, True, True, False]
    assert trainer.captured.grad[3].abs().max() == 0 and trainer.captured.grad[MASKED].abs().max() > 0
    assert_close_to_rounding(residual(trainer.captured.grad, batch), 0.0, scale=1.0, dtype=torch.float32)


def test_gathered_row_weights_fold_the_mask_before_the_gather():
    """The cross_process and redistributed layouts transform groups gathered over processes (U travels in the
    gather): each process folds TRL's mask into its own rows' U first. Forced here on one process by marking a
    micro-batch of whole groups as not whole; the weights are those of the whole-group path."""
    results = []
    for whole in (True, False):
        trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, group_transform="min_replace",
                               cancellation_target="gradient", off_policy_mask_threshold=THRESHOLD)
        batch = masked_group(trainer)
        batch[WHOLE_GROUPS_KEY] = whole
        used = record_row_weights(trainer)
        loss_and_grads(trainer, batch)
        results.append(used[-1])
    assert results[1].survives.tolist() == [True, True, False, True]
    for grouped, gathered in zip(results[0], results[1], strict=True):
        assert torch.equal(grouped, gathered)


# ------------------------------------------------------------------------------------------- the pre-pass
PRE_PASS = dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=4,
                gradient_accumulation_steps=2)


def two_groups(trainer: Any, ratios: list[float], **extra: Any) -> dict[str, Any]:
    """Two copies of the masked group (8 rows), with explicit group and row ids."""
    one = masked_group(trainer, ratios, **extra)
    batch = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in one.items()}
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    batch["group_ids"], batch["row_ids"] = consecutive_group_ids(8, 4), torch.arange(8)
    return batch


def pre_pass_step(
    batch: dict[str, Any], force_forward: bool
) -> tuple[Any, torch.Tensor, Any, list[dict[str, Any]]]:
    """One optimizer step (two micro-steps of two rows) in the pre-pass layout on ``batch`` as the rollout. Returns
    the trainer, the row ids of every member of the step's groups and the pre-pass's weights of them (sorted by row
    id) and, per micro-step, its row ids, the weights its loss used and its trained per-token coefficients."""
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO | PRE_PASS, group_transform="min_replace",
                           cancellation_target="gradient", off_policy_mask_threshold=THRESHOLD)
    assert trainer.group_layout == "pre_pass"
    trainer.current_gradient_accumulation_steps = 2
    trainer._generate_and_score_completions = lambda _inputs: dict(batch)
    trainer.pre_pass.skip_forward_at_old_policy = not force_forward  # θ ≠ θ_old in this batch: it must forward
    pre_passes = record_pre_passes(trainer)
    used = record_row_weights(trainer)
    steps = []
    for _ in range(2):
        inputs = trainer._prepare_inputs(None)
        loss_and_grads(trainer, inputs)
        steps.append(dict(row_ids=inputs["row_ids"], weights=used[-1], coefficients=trainer.captured.grad.clone()))
        trainer._step += 1
    pre_pass, = pre_passes  # one pre-pass per optimizer step
    row_ids, weights = pre_pass.objective.row_ids, pre_pass.objective.grouped.rows
    order = torch.argsort(row_ids)
    return trainer, row_ids[order], type(weights)(*(w[order] for w in weights)), steps


def assert_pre_pass_is_exact(batch: dict[str, Any], row_ids: torch.Tensor, weights: Any,
                             steps: list[dict[str, Any]], masked: list[int]) -> None:
    """U excludes exactly the masked rows; every group balances over its surviving rows; each micro-step's loss
    used the pre-pass's weights, and its masked rows carry no gradient."""
    assert torch.equal(~weights.survives, torch.isin(row_ids, torch.tensor(masked)))
    factor = aggregation_factor(loss_mask(batch)[row_ids], "grpo")
    terms = (gradient_coefficients(batch["advantages"][row_ids], factor, weights.survives)
             * weights.s_tilde.double()).view(-1, 4)  # whole groups, sorted by row id
    assert_close_to_rounding(terms.sum(-1), torch.zeros(terms.size(0)), scale=terms.abs().sum(-1),
                             dtype=torch.float32)
    for step in steps:
        position = torch.searchsorted(row_ids, step["row_ids"])
        assert torch.equal(step["weights"].survives, weights.survives[position])
        assert torch.equal(step["weights"].s_tilde, weights.s_tilde[position])
        dropped = torch.isin(step["row_ids"], torch.tensor(masked))
        assert step["coefficients"][dropped].abs().sum() == 0


def test_pre_pass_folds_the_mask_computed_from_its_own_forward():
    """θ ≠ θ_old: the pre-pass forwards, and folds TRL's mask computed from that forward and the old log-probs
    TRL's loss will read: the same U and s̃ as the loss-time path on whole groups."""
    reference_trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, per_device_train_batch_size=8,
                                     num_generations=4, group_transform="min_replace", cancellation_target="gradient",
                                     off_policy_mask_threshold=THRESHOLD)
    batch = two_groups(reference_trainer, RATIOS)
    used_reference = record_row_weights(reference_trainer)
    loss_and_grads(reference_trainer, batch)
    reference = used_reference[-1]
    trainer, row_ids, weights, steps = pre_pass_step(batch, force_forward=True)
    assert torch.equal(weights.survives, reference.survives[row_ids])
    assert_close_to_rounding(weights.s_tilde, reference.s_tilde[row_ids])  # forwards of other batch shapes
    assert_pre_pass_is_exact(batch, row_ids, weights, steps, masked=[MASKED, 4 + MASKED])
    trainer.flush_dfpo_metrics("train")
    assert trainer._metrics["train"]["prepass/forward_skipped"][-1] == 0.0


@pytest.mark.parametrize("with_old", [True, False])
def test_pre_pass_at_the_old_policy_reads_the_mask_without_a_forward(with_old):
    """The first optimizer step after a rollout (θ = θ_old): every s is 1, and TRL's mask compares the sampler's
    log-probs with the old ones, which are the current ones, so the forward is skipped (member 4 of each group
    masked, member 3 kept). Without old log-probs (vLLM without its importance-sampling correction) the current
    log-probs are needed: the pre-pass forwards."""
    probe = make_trainer(DFPOTrainer, DFPOConfig, **GSPO)
    batch = two_groups(probe, [1.0] * 4)  # old log-probs = the current ones
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + torch.tensor([0.5, 0.5, 0.05, 0.3] * 2)[:, None]
    if not with_old:
        del batch["old_per_token_logps"]
    trainer, row_ids, weights, steps = pre_pass_step(batch, force_forward=False)
    assert_pre_pass_is_exact(batch, row_ids, weights, steps, masked=[3, 7])
    trainer.flush_dfpo_metrics("train")
    assert trainer._metrics["train"]["prepass/forward_skipped"][-1] == float(with_old)


# -------------------------------------------------------------------- redistributed, on two processes (gloo)
REDISTRIBUTED = dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=2,
                     gradient_accumulation_steps=2)
WORLD = 2


def redistributed_worker(rank: int, port: int, batch_path: str, out_dir: str) -> None:
    """Process ``rank`` of the redistributed layout: its half of the rollout (one group), moved so that each
    micro-step holds one group across both processes; the weights, inputs and trained coefficients of each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    batch = torch.load(batch_path)
    trainer = make_trainer(capturing(DFPOTrainer), DFPOConfig, **GSPO | REDISTRIBUTED, group_transform="min_replace",
                           cancellation_target="gradient", off_policy_mask_threshold=THRESHOLD)
    trainer.current_gradient_accumulation_steps = REDISTRIBUTED["gradient_accumulation_steps"]
    rows = slice(4 * rank, 4 * rank + 4)
    local = {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
    trainer._generate_and_score_completions = lambda _inputs: dict(local)
    used = record_row_weights(trainer)
    records = []
    for _ in range(REDISTRIBUTED["steps_per_generation"]):  # no update in between: one θ
        inputs = trainer._prepare_inputs(None)
        loss, _ = loss_and_grads(trainer, inputs)
        records.append(dict(layout=trainer.group_layout, loss=loss, weights=[w.clone() for w in used[-1]],
                            coefficients=trainer.captured.grad.clone(),
                            inputs={k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}))
        trainer._step += 1
    torch.save(records, Path(out_dir) / f"rank{rank}.pt")
    trainers = [trainer]
    del trainer
    end_rank(trainers)


def widened(t: torch.Tensor, width: int = 5) -> torch.Tensor:
    """A per-token tensor right-padded with zeros to ``width`` (each process trims its own padding)."""
    return torch.cat([t, t.new_zeros(t.size(0), width - t.size(1))], dim=1)


@pytest.mark.distributed
def test_redistributed_layout_folds_the_mask_on_the_process_that_holds_the_row(tmp_path):
    """Rows move between processes with their old and sampler log-probs; each process folds TRL's mask into its
    rows' U at loss time, and U travels in the all-gather: every process's weights equal the single-process ones,
    each loss is TRL's own (mask included) with Â φ, and each group's trained coefficients, summed over both
    processes, cancel on the shared prefix."""
    reference_trainer = make_trainer(DFPOTrainer, DFPOConfig, **GSPO, per_device_train_batch_size=8,
                                     num_generations=4, group_transform="min_replace", cancellation_target="gradient",
                                     off_policy_mask_threshold=THRESHOLD)
    batch = two_groups(reference_trainer, RATIOS)
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + 0.01  # the vLLM path: TRL reads these
    used_reference = record_row_weights(reference_trainer)
    loss_and_grads(reference_trainer, batch)
    reference = used_reference[-1]
    assert reference.survives.tolist() == [True, True, False, True] * 2
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(redistributed_worker, (free_port(), str(tmp_path / "batch.pt"), str(tmp_path)), nprocs=WORLD)
    records = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    theirs = trl_trainer(**REDISTRIBUTED, off_policy_mask_threshold=THRESHOLD)
    theirs.current_gradient_accumulation_steps = REDISTRIBUTED["gradient_accumulation_steps"]
    for step in range(REDISTRIBUTED["steps_per_generation"]):
        coefficients, ids, masks, row_ids = [], [], [], []
        for rank in range(WORLD):
            record = records[rank][step]
            assert record["layout"] == "redistributed"
            inputs, (s_bar, s_tilde, survives, _) = record["inputs"], record["weights"]
            rows = inputs["row_ids"]
            assert torch.equal(survives, reference.survives[rows])
            assert_close_to_rounding(s_tilde, reference.s_tilde[rows])
            phi = s_tilde / s_bar
            trl_inputs = {k: v for k, v in inputs.items() if not k.startswith("dfpo_")}
            loss, _ = loss_and_grads(theirs, {**trl_inputs, "advantages": inputs["advantages"] * phi})
            assert_close_to_rounding(record["loss"], loss, scale=(inputs["advantages"] * phi).abs().mean())
            assert_close_to_rounding(record["coefficients"], theirs.captured.grad)
            coefficients.append(widened(record["coefficients"]))
            ids.append(widened(inputs["completion_ids"]))
            masks.append(widened(inputs["completion_mask"]))
            row_ids.append(rows)
        row_ids = torch.cat(row_ids)
        assert torch.equal(torch.sort(row_ids // 4).values, torch.full((4,), int(row_ids[0]) // 4))  # one group
        group = {"completion_ids": torch.cat(ids), "completion_mask": torch.cat(masks)}
        assert_close_to_rounding(residual(torch.cat(coefficients), group), 0.0, scale=1.0, dtype=torch.float32)
