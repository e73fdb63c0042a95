"""No host syncs on DFPO's loss path, and no silent sanitising.

A host read of a device tensor (``.item()``, ``.tolist()``, ``float(t)``, ``int(t)``, ``bool(t)``), and a tensor
made from host data on the device (``torch.tensor(x, device=...)``: a blocking copy), makes the host wait for the
device; per micro-step it stalls the pipeline, inside a backward hook it stalls DDP's overlapped
backward. DFPO keeps its metrics as device tensors until a logging step. Checked here by recording every such
read whose caller is DFPO code during the loss and backward of buffered training micro-batches.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import addition_dataset, base_args, last_digit_reward, random_batch, tiny_model, tiny_tokenizer

import dfpo_trl
from dfpo_trl import DFPOConfig, DFPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
PACKAGE = str(Path(dfpo_trl.__file__).parent)
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
HOST_COPIES = ("tensor", "as_tensor")


@contextmanager
def host_reads_from_dfpo() -> Iterator[list[str]]:
    """Record `file:line method` of every host read of a tensor made directly by dfpo_trl code, and of every tensor
    made from host data on a named device (`torch.tensor(x, device=...)`): on CUDA that copy waits for the device
    too, though on the CPU it reads nothing."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    factories = {name: getattr(torch, name) for name in HOST_COPIES}

    def copying(name: str):
        original = factories[name]

        def make(data: Any, *args: Any, **kwargs: Any):
            caller = sys._getframe(1)
            if (kwargs.get("device") is not None and not isinstance(data, torch.Tensor)
                    and caller.f_code.co_filename.startswith(PACKAGE)):
                seen.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {name}")
            return original(data, *args, **kwargs)

        return make

    def recording(name: str):
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                seen.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {name}")
            return original(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, recording(name))
    for name in HOST_COPIES:
        setattr(torch, name, copying(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in factories.items():
            setattr(torch, name, original)


def rollout(trainer: DFPOTrainer, rows: int) -> dict[str, Any]:
    """A generation batch as DFPO's rollout returns it, off-policy, with shared prefixes in every group."""
    ids, mask, adv, log_ratio = random_batch(rows=rows, group_size=trainer.num_generations)
    ids[:, :2] = torch.tensor([16, 17])
    with torch.no_grad():
        prompt = torch.full((rows, 3), 13)
        current, _, _ = trainer._get_per_token_logps_and_entropies(
            model=trainer.model, input_ids=torch.cat([prompt, ids], 1),
            attention_mask=torch.cat([torch.ones_like(prompt), mask], 1), logits_to_keep=ids.size(1),
        )
    return dict(
        prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=ids, completion_mask=mask,
        advantages=adv, old_per_token_logps=current - log_ratio, num_items_in_batch=mask.sum(),
        group_ids=torch.arange(rows) // trainer.num_generations, row_ids=torch.arange(rows),
    )


SEQUENCE = dict(importance_sampling_level="sequence", loss_type="grpo", steps_per_generation=2)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(**SEQUENCE, group_transform="min_replace"), id="min_replace"),
        pytest.param(dict(**SEQUENCE, group_transform="orth_proj", cancellation_target="gradient"), id="gradient"),
        pytest.param(dict(**SEQUENCE, group_transform="min_replace", transform_gradient="score"), id="score"),
        pytest.param(dict(**SEQUENCE, group_granular_batches=True), id="gspo_metrics"),
        pytest.param(dict(**SEQUENCE), id="dfpo_off"),
        pytest.param(dict(importance_sampling_level="token", loss_type="dapo", steps_per_generation=2,
                          symmetric_clip=True), id="grpo_fix"),
    ],
)
def test_loss_and_backward_read_nothing_on_the_host(settings):
    args = DFPOConfig(**base_args(per_device_train_batch_size=4, num_generations=2, **settings))
    trainer = DFPOTrainer(model=tiny_model(0), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    batch = rollout(trainer, 8)
    trainer._generate_and_score_completions = lambda _inputs: batch
    trainer.current_gradient_accumulation_steps = 1
    micro = trainer._prepare_inputs(None)  # the once-per-rollout work (shuffle, whole-group check) happens here
    with host_reads_from_dfpo() as reads:
        trainer.compute_loss(trainer.model, micro).backward()
    assert reads == []
    trainer.flush_dfpo_metrics("train")  # ... and the metrics are still there, read once at the logging step
    if settings.get("symmetric_clip"):
        assert "grpo_fix/negative_capped_fraction" in trainer._metrics["train"]
    elif trainer.group_layout == "group_granular":
        assert "asym/before" in trainer._metrics["train"]


def test_sanitised_weights_are_counted():
    """A NaN sequence weight (here from a NaN old log-prob) is replaced inside the transform; the replacement is
    counted in `transform/sanitised_weights`, not silent."""
    args = DFPOConfig(**base_args(per_device_train_batch_size=8, num_generations=4, group_transform="min_replace",
                                  **SEQUENCE))
    trainer = DFPOTrainer(model=tiny_model(0), reward_funcs=last_digit_reward, args=args,
                          train_dataset=addition_dataset(), processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = rollout(trainer, 8)
    batch["old_per_token_logps"][2, 1] = float("nan")
    with torch.no_grad():
        trainer.compute_loss(trainer.model, batch)
    trainer.flush_dfpo_metrics("train")
    assert trainer._metrics["train"]["transform/sanitised_weights"] == [1.0]
    clean = rollout(trainer, 8)
    with torch.no_grad():
        trainer.compute_loss(trainer.model, clean)
    trainer.flush_dfpo_metrics("train")
    assert trainer._metrics["train"]["transform/sanitised_weights"][-1] == 0.0
