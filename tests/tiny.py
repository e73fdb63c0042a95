"""The tests' own helpers on top of :mod:`dfpo_trl.testing` (the tiny model, tokenizer, data, reward and trainer,
the tiny CLI recipe and the observers, which this module re-exports for the tests and benchmarks that import them from
here): hand-made batches, gradients of the real loss, gloo ranks."""

from __future__ import annotations

from typing import Any

import torch

from dfpo_trl.testing import (
    WORDS,
    addition_dataset,
    hand_batch,
    last_digit_reward,
    observe_micro_steps,
    random_batch,
    record_pre_passes,
    record_row_weights,
    save_tiny_chat_model,
    tiny_model,
    tiny_tokenizer,
    with_old_logps,
    write_tiny_recipe,
)
from dfpo_trl.testing import tiny_config_kwargs as base_args
from dfpo_trl.testing import tiny_trainer as make_trainer

__all__ = [  # what the tests import from here, dfpo_trl.testing's names among them
    "WORDS", "addition_dataset", "base_args", "capturing", "end_rank", "free_port",
    "fused_completion_logps", "hand_batch", "last_digit_reward", "loss_and_grads", "make_trainer",
    "observe_micro_steps", "random_batch", "record_pre_passes", "record_row_weights", "save_tiny_chat_model",
    "shared_prefix_residual", "spawn_ranks", "tiny_model", "tiny_tokenizer", "with_old_logps", "write_tiny_recipe",
]  # fmt: skip




def capturing(trainer_cls: type) -> type:
    """A subclass that keeps the policy forward's per-token log-probs with their gradient (c_{i,t} after
    backward): the exact scalar each token's ∇ℓ_{i,t} receives from the real `compute_loss`."""

    class Capturing(trainer_cls):  # type: ignore[misc, valid-type]
        captured: torch.Tensor | None = None

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if out[0].requires_grad:
                out[0].retain_grad()
                self.captured = out[0]
            return out

    return Capturing


def loss_and_grads(trainer: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of the real `compute_loss` and the gradient of every parameter. DFPO's metrics, kept on the device
    until a logging step, are then flushed into `trainer._metrics` as `log` would."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    if hasattr(trainer, "flush_dfpo_metrics"):
        trainer.flush_dfpo_metrics("train")
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads






def free_port() -> int:
    """A TCP port on localhost that was free a moment ago, for a gloo rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(fn: Any, args: tuple, nprocs: int = 2, timeout_s: float = 300.0) -> None:
    """`torch.multiprocessing.spawn` with a deadline: a rank that hangs fails the test instead of stalling CI."""
    import time

    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() >= deadline:
            alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"ranks {alive} still running after {timeout_s:.0f} s (a hang, not a slow test)")


def end_rank(trainers: list[Any]) -> None:
    """End a spawned gloo rank as `dfpo-train` does (dfpo_trl.cli.main.run), given the rank's only reference to its
    trainer in ``trainers`` (emptied here). Left to interpreter exit, a rank can abort ("terminate called without an
    active exception", seen once in CI): the group's Python handle must outlive the trainer so that torch joins
    gloo's threads with the GIL released."""
    import gc

    import torch.distributed as dist

    from dfpo_trl.cli.main import default_process_group

    group_handle = default_process_group()
    trainers[0].accelerator.wait_for_everyone()
    dist.destroy_process_group()
    trainers.clear()
    gc.collect()
    del group_handle


def fused_completion_logps(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The completion tokens' log-probabilities through TRL's fused LM head (``fused_lm_head=True``), with their
    autograd graph: the forward the trainer's loss takes, for tests that differentiate it themselves."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    length = batch["completion_ids"].size(1)
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :-length] = -100
    return model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs[:, -length:]


def shared_prefix_residual(
    token_coefficients: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared-prefix residual (docs/source/concepts/metrics.md) of one set of whole groups, (value, count), as the
    trainer's backward hook computes it (metrics/hooks.py): the mean over shared positions with Σ_i |c_{i,t}| > 0 of
    |Σ_i c_{i,t}| / Σ_i |c_{i,t}| (0 when no position is used) and that count. Inputs are (num_groups, G, T)."""
    from dfpo_trl.metrics.mechanism import shared_prefix_mask, shared_prefix_residual_sums

    (total, count), = shared_prefix_residual_sums(token_coefficients, shared_prefix_mask(completion_ids,
                                                                                          completion_mask))
    return total / count.clamp(min=1).to(total.dtype), count
