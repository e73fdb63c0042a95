"""DFPO under FSDP2 (torch's ``fully_shard``, applied by accelerate) on two CPU processes (gloo), against the
single-process reference of ``tests/groups/test_distributed.py``.

accelerate 1.15 never enters FSDP mode on CPU processes: ``AcceleratorState.__init__`` sets
``distributed_type = FSDP`` and keeps the FSDP plugin only inside ``if self.distributed_type in [MULTI_GPU, MULTI_MLU,
..., MULTI_NEURON]``, and gloo CPU processes are ``MULTI_CPU``. A ``TrainingArguments(fsdp=True, fsdp_config={"version":
2})`` run on CPU therefore trains under DDP without a word (the plugin is dropped, ``trainer.is_fsdp_enabled`` is
False, the model is wrapped in ``DistributedDataParallel``). ``fully_shard`` itself runs on CPU with gloo, so each
worker here makes the assignments of that GPU branch (:func:`fsdp2_on_cpu`); everything after it is accelerate's,
TRL's and torch's own FSDP2 path: ``fsdp2_prepare_model``, DTensor parameters, parameter all-gathers in every
forward (the pre-pass's too), gradient reduce-scatter in backward. Each test asserts that its model is an
``FSDPModule`` with DTensor parameters, so a silent fall-back to DDP fails it (docs/source/concepts/layouts.md, FSDP2).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed import GSPO, TRANSFORM, global_batch, reference_weights
from test_dropin import COMPARED, train_side_by_side
from test_redistributed import local_slice, reference_loss_and_grads
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
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer

pytestmark = pytest.mark.distributed
WORLD = 2
# What accelerate's recipes/accelerate/fsdp2_2gpu.yaml gives TrainingArguments, in float32 (no bf16 on this CPU).
FSDP2 = dict(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True,
                                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


def fsdp2_on_cpu() -> None:
    """Let accelerate shard with FSDP on gloo CPU processes: when it is handed an FSDP plugin and the processes are
    ``MULTI_CPU``, do what its GPU branch does (``distributed_type = FSDP``, the plugin's mixed precision, keep the
    plugin) and mirror the type into ``PartialState`` as ``AcceleratorState.__init__`` does at its end. Only in a
    spawned rank."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: AcceleratorState, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


def start_rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    fsdp2_on_cpu()


def sharded(trainer: Any) -> bool:
    """The trainer's model is an FSDP2 module whose parameters are DTensor shards (not DDP, not replicated)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return (trainer.is_fsdp_enabled and isinstance(trainer.model, FSDPModule)
            and all(isinstance(p, DTensor) for p in trainer.model.parameters()))


# ------------------------------------------------------------------------- DFPO's coefficients, loss, gradients


def worker(rank: int, port: int, sizes: dict[str, Any], batch_path: str, out_dir: str) -> None:
    start_rank(rank, port)
    batch = torch.load(batch_path)
    args = DFPOConfig(**base_args(**GSPO, **sizes, **FSDP2, group_transform=TRANSFORM))
    trainer = DFPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    # what Trainer.train does first under FSDP2: the optimizer on the full parameters, then one accelerate prepare
    trainer.create_optimizer()
    trainer.model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.model_wrapped = trainer.model
    assert sharded(trainer), "accelerate did not shard the model with FSDP2"
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    local = args.per_device_train_batch_size * args.steps_per_generation
    local_batch = local_slice(batch, rank, local, args.num_generations)
    trainer._generate_and_score_completions = lambda _inputs: dict(local_batch)
    if trainer.pre_pass is not None:
        trainer.pre_pass.skip_forward_at_old_policy = False  # θ ≠ θ_old here: force the pre-pass forward
    used = record_row_weights(trainer)
    no_grad_forwards = [0]  # forwards of the sharded root module outside autograd: the pre-pass's, here

    def count(_module: torch.nn.Module, _args: Any) -> None:
        no_grad_forwards[0] += not torch.is_grad_enabled()

    trainer.model.register_forward_pre_hook(count)
    records = []
    for _ in range(args.steps_per_generation):  # every micro-step of the rollout, no update in between: one θ
        before = no_grad_forwards[0]
        inputs = trainer._prepare_inputs(None)
        # Through the optimizer, which holds the shards: after the pre-pass's no-grad forward FSDP2's root unit is
        # still gathered, and model.zero_grad() would clear the gathered tensors' gradients, not the shards' (Trainer
        # zeroes after backward, when every unit is sharded again).
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()  # FSDP2 reduce-scatters: each shard holds the mean of the processes' gradients
        weights = used[-1]
        grads = torch.cat([p.grad.full_tensor().flatten() for p in trainer.model.parameters()])
        micro = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        records.append(dict(layout=trainer.group_layout, loss=loss.detach(), row_ids=inputs["row_ids"].clone(),
                            s_bar=weights.s_bar.detach().clone(), s_tilde=weights.s_tilde.detach().clone(),
                            inputs=micro, grads=grads, prepass_forwards=no_grad_forwards[0] - before))
        trainer._step += 1
    torch.save(records, Path(out_dir) / f"rank{rank}.pt")
    trainers = [trainer]
    del trainer
    end_rank(trainers)


def expected_prepass_chunks(records: list[list[dict[str, Any]]], sizes: dict[str, Any], step: int) -> list[int]:
    """Forward chunks each process needs at the optimizer step starting at micro-step ``step``: its local rows of
    every group that has a row in the step on any process (docs/source/concepts/layouts.md, pre-pass), in chunks of
    ``prepass_batch_size``."""
    group_size, local = sizes["num_generations"], sizes["per_device_train_batch_size"] * sizes["steps_per_generation"]
    window = range(step, step + sizes["gradient_accumulation_steps"])
    active = torch.cat([records[r][k]["row_ids"] for r in range(WORLD) for k in window]) // group_size
    chunks = []
    for rank in range(WORLD):
        local_groups = torch.arange(rank * local, (rank + 1) * local) // group_size
        chunks.append(math.ceil(int(torch.isin(local_groups, active.unique()).sum()) / sizes["prepass_batch_size"]))
    return chunks


@pytest.mark.parametrize(
    "sizes",
    [
        # The paper's per-device batch 1, scaled down: 12 rows, 3 groups of 4, 6 rows per process, so group 1
        # straddles the processes and every group the micro-steps. One optimizer step per micro-step: a process
        # forwards its members of the (at most two) groups of the step's rows, 2 to 6 rows (one chunk each).
        dict(per_device_train_batch_size=1, num_generations=4, steps_per_generation=6, gradient_accumulation_steps=1,
             prepass_batch_size=1),
    ],
)
def test_fsdp2_coefficients_loss_and_gradients_match_single_process(tmp_path, sizes):
    """Under FSDP2 the pre-pass layout gives every row the s̄ and s̃ of the single-process computation on the
    whole generation batch; each micro-step's loss is TRL's own loss with Â φ (φ = s̃ / s̄ from that reference);
    the reduce-scattered gradient is the processes' mean of TRL's gradients; and every process runs as many
    pre-pass forwards (each one collective: FSDP2 all-gathers the shards) as the process with the most rows."""
    rows = WORLD * sizes["per_device_train_batch_size"] * sizes["steps_per_generation"]
    group_size = sizes["num_generations"]
    batch = global_batch(rows, group_size)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(worker, (free_port(), sizes, str(tmp_path / "batch.pt"), str(tmp_path)), nprocs=WORLD)
    s_bar_ref, s_tilde_ref, _ = reference_weights(batch, group_size)
    assert (s_tilde_ref != s_bar_ref).any()  # the transform acted, so the comparison has teeth
    records = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    uneven = apart = False
    for step in range(sizes["steps_per_generation"]):
        grads_ref = []
        for rank in range(WORLD):
            record = records[rank][step]
            assert record["layout"] == "pre_pass"
            ids = record["row_ids"]
            assert torch.allclose(record["s_bar"], s_bar_ref[ids], atol=1e-5)
            assert torch.allclose(record["s_tilde"], s_tilde_ref[ids], atol=1e-5)
            local_ids = record["inputs"]["row_ids"]
            phi = s_tilde_ref[local_ids] / s_bar_ref[local_ids]
            loss, grads = reference_loss_and_grads(record["inputs"], phi, sizes)
            assert torch.allclose(record["loss"], loss, atol=1e-6)
            grads_ref.append(grads)
        mean_grads = torch.stack(grads_ref).mean(0)
        apart |= not torch.allclose(grads_ref[0], grads_ref[1], atol=1e-3 * mean_grads.abs().max().item())
        for rank in range(WORLD):
            # the gradient is a sum over tokens of float32 products: hold it to float32's rounding of its size
            assert (records[rank][step]["grads"] - mean_grads).abs().max() <= 1e-5 * mean_grads.abs().max()
        if step % sizes["gradient_accumulation_steps"] == 0:
            chunks = expected_prepass_chunks(records, sizes, step)
            assert [records[rank][step]["prepass_forwards"] for rank in range(WORLD)] == [max(chunks)] * WORLD
            uneven |= len(set(chunks)) > 1
    assert uneven  # some process had fewer rows to forward and still ran the others' collective forwards
    assert apart  # the processes' own gradients differ: the reduce-scatter's mean is what made theirs equal


# ------------------------------------------------------------------------------- DFPO off = TRL's GRPOTrainer


DROPIN = dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=2)  # groups straddle processes


def dropin_worker(rank: int, port: int, out_dir: str) -> None:
    start_rank(rank, port)
    logged, shards = [], []
    trainers = []
    for trainer_cls, config_cls in ((DFPOTrainer, DFPOConfig), (GRPOTrainer, GRPOConfig)):
        trainer = train_side_by_side(trainer_cls, config_cls, **DROPIN, **FSDP2)
        assert sharded(trainer), "accelerate did not shard the model with FSDP2"
        assert trainer.state.global_step == 4
        logged.append([{k: h[k] for k in COMPARED if k in h} for h in trainer.state.log_history if "loss" in h])
        shards.append({n: p.detach().to_local().clone() for n, p in trainer.model.named_parameters()})
        trainers.append(trainer)
    torch.save(dict(logged=logged, shards=shards), Path(out_dir) / f"dropin{rank}.pt")
    del trainer
    end_rank(trainers)


def test_fsdp2_dfpo_off_is_the_same_run_as_grpo_trainer(tmp_path):
    """Same seed, no DFPO option, FSDP2 on two processes whose groups straddle them: 4 optimizer steps of
    generation and training give the same logged losses and rewards and the same parameter shards, bit for bit."""
    spawn_ranks(dropin_worker, (free_port(), str(tmp_path)), nprocs=WORLD)
    initial = {n: p.detach() for n, p in tiny_model(0).named_parameters()}
    for rank in range(WORLD):
        out = torch.load(tmp_path / f"dropin{rank}.pt")
        ours, theirs = out["logged"]
        assert len(ours) == 4 and any("reward" in h for h in ours)
        assert ours == theirs
        mine, reference = out["shards"]
        assert mine.keys() == reference.keys() == initial.keys()
        assert all(torch.equal(mine[n], reference[n]) for n in mine)
        # each process holds its own half of every 2-D weight, and training moved it
        weight = "model.layers.0.mlp.up_proj.weight"
        half = initial[weight].size(0) // WORLD
        assert mine[weight].size(0) == half
        assert not torch.equal(mine[weight], initial[weight][rank * half : (rank + 1) * half])


# ------------------------------------------------------------------ held-out evaluation before training (FSDP2)


def evaluate_then_train_worker(rank: int, port: int, out_dir: str) -> None:
    """The CLI's order under FSDP2: the held-out greedy evaluation (HeldoutAccuracyCallback, at train begin) runs
    ``generate`` on the sharded model, then training forwards and backwards the same FSDP units."""
    from dfpo_trl.cli.evaluation import HeldoutAccuracyCallback

    start_rank(rank, port)
    heldout = HeldoutAccuracyCallback(last_digit_reward, addition_dataset(4, seed=1), max_new_tokens=3)
    args = DFPOConfig(**base_args(**FSDP2, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                                  steps_per_generation=2, group_transform="min_replace", **GSPO))
    trainer = DFPOTrainer(model=tiny_model(), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer(), callbacks=[heldout])
    trainer.train()
    from torch.distributed.fsdp import FSDPModule

    for unit in trainer.model.modules():  # the final evaluation's generate leaves units without a reshard gathered
        if isinstance(unit, FSDPModule):
            unit.reshard()
    assert sharded(trainer), "accelerate did not shard the model with FSDP2"
    torch.save(dict(steps=trainer.state.global_step, heldout=heldout.results,
                    losses=[h["loss"] for h in trainer.state.log_history if "loss" in h]),
               Path(out_dir) / f"evaluate{rank}.pt")
    trainers = [trainer]
    del trainer
    end_rank(trainers)


def test_fsdp2_trains_after_the_heldout_evaluation(tmp_path):
    """Regression: the held-out evaluation once generated under ``torch.inference_mode()``, which left FSDP2's
    gathered (unsharded) parameters as inference tensors, and the first training forward then failed with
    "Inference tensors cannot be saved for backward". Evaluation then two optimizer steps must train."""
    spawn_ranks(evaluate_then_train_worker, (free_port(), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        out = torch.load(tmp_path / f"evaluate{rank}.pt")
        assert out["steps"] == 2
        assert out["heldout"]["before"] is not None and out["heldout"]["after"] is not None
        assert len(out["losses"]) == 2 and all(math.isfinite(v) for v in out["losses"])
