"""FSDP2 on two GPUs against one process: coefficients, gradients (the LM head's included) and one optimizer step.

Three phases (the commands in benchmarks/README.md, section FSDP2 parity):

* ``--phase reference`` (one process, one GPU, no sharding): one optimizer step of plain SGD on the fixed generation
  batch of ``dfpo_bench.launch.zero3`` (``lib/exactness.py``: 12 rows, groups of 4, old log-probs shifted from
  the model's by known amounts),
  with the per-device batch doubled so that each micro-step holds the rows both FSDP2 processes hold together;
  records s̄ and s̃ of every row (the pure functions on the whole batch), the loss of each micro-step, the summed
  gradient of every parameter before the step and the parameters after it.
* ``--phase fsdp2`` (``accelerate launch --config_file recipes/accelerate/fsdp2_2gpu.yaml --mixed_precision no``):
  the same batch, sliced per process as TRL slices a rollout, the same step through ``trainer.train()``: TRL's
  fused LM head (its Triton kernel on CUDA, the head gathered from its DTensor shards), DFPO's pre-pass layout
  (groups cut across processes and micro-steps), FSDP2's reduce-scatter; every process records the s̄ and s̃
  its loss used, and rank 0 the full gradients and parameters.
* ``--phase compare``: ``fsdp2_parity.json``: the largest differences, each relative to the largest value it is
  compared with, against ``--tolerance``.

Float32 throughout (TF32 off), so that the two sides differ only by the order of float32 sums. Plain SGD, so that
the update is −lr·g and compares the gradient itself (Adam's first step is lr·sign(g), blind to its size).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[3]
from dfpo_trl import DFPOConfig  # noqa: E402
from dfpo_trl.cli import get_task  # noqa: E402

from dfpo_bench.lib.exactness import (  # noqa: E402
    EPS_HIGH,
    EPS_LOW,
    SIZES,
    TRANSFORM,
    Recorder,
    fixed_batch,
    model_logps,
    reference_weights,
    serve_fixed_rows,
)

LEARNING_RATE = 1.0  # SGD, one step: the update −lr·g well above float32's rounding of the parameters it moves


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor shard gathered whole (a plain tensor as it is), on the CPU in float32."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().cpu()


class GradientsBeforeStep(TrainerCallback):
    """The gradient of every parameter just before the optimizer's step (after accumulation and FSDP2's
    reduce-scatter), gathered whole; rank 0 keeps them."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        for name, param in model.named_parameters():
            if param.grad is not None:
                self.grads[name] = full(param.grad)


def config(args: argparse.Namespace, per_device: int) -> DFPOConfig:
    return DFPOConfig(
        output_dir=str(args.out_dir / "trainer"), importance_sampling_level="sequence", loss_type="grpo",
        epsilon=EPS_LOW, epsilon_high=EPS_HIGH, group_transform=TRANSFORM, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, max_completion_length=32, disable_tqdm=True, seed=0,
        use_cpu=not torch.cuda.is_available(), learning_rate=LEARNING_RATE, optim="sgd", max_grad_norm=0.0,
        lr_scheduler_type="constant", max_steps=1, num_generations=SIZES["num_generations"],
        per_device_train_batch_size=per_device, steps_per_generation=SIZES["steps_per_generation"],
        gradient_accumulation_steps=SIZES["gradient_accumulation_steps"],
    )


def one_step(args: argparse.Namespace, batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """One optimizer step of DFPO on this process's slice of ``batch``; what the comparison needs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    task = get_task("arithmetic")
    gradients = GradientsBeforeStep()
    per_device = SIZES["per_device_train_batch_size"] * (args.world if world == 1 else 1)
    trainer = Recorder(model=args.model, reward_funcs=task.reward_funcs, args=config(args, per_device),
                       train_dataset=task.build_dataset("train", 64, 0), callbacks=[gradients])
    trainer.records = []
    local = per_device * SIZES["steps_per_generation"]
    serve_fixed_rows(trainer, batch, rank, local, SIZES["num_generations"])
    trainer.train()
    params = {name: full(p) for name, p in trainer.model.named_parameters()}
    return {"records": trainer.records, "grads": gradients.grads, "params": params,
            "fsdp": bool(trainer.is_fsdp_enabled), "processes": trainer.accelerator.num_processes,
            "model_class": type(trainer.model).__name__, "layout": trainer.group_layout,
            "learning_rate": trainer.args.learning_rate}


def phase_reference(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    batch = fixed_batch(args.model, args.world)
    logps = model_logps(model, batch)
    initial = {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
    del model
    batch["old_per_token_logps"] = logps - batch.pop("log_ratio_shift")
    s_bar, s_tilde = reference_weights(logps, batch["old_per_token_logps"], batch["completion_mask"],
                                       batch["advantages"], SIZES["num_generations"], (EPS_LOW, EPS_HIGH))
    single = one_step(args, batch, rank=0, world=1)
    torch.save({"batch": batch, "s_bar": s_bar, "s_tilde": s_tilde, "initial": initial, **single},
               args.out_dir / "fsdp2_reference.pt")
    print(f"reference: {s_bar.numel()} rows, the transform changed {(s_tilde != s_bar).sum().item()} weights")


def phase_fsdp2(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    reference = torch.load(args.out_dir / "fsdp2_reference.pt")
    rank = int(__import__("os").environ.get("RANK", "0"))
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    out = one_step(args, reference["batch"], rank=rank, world=world)
    if rank != 0:
        out.pop("grads"), out.pop("params")
    torch.save(out, args.out_dir / f"fsdp2_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|: a difference on the scale of the values compared."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def update_gap(update: torch.Tensor, expected: torch.Tensor, initial: torch.Tensor, tolerance: float) -> float:
    """max |update − expected| over what float32 can promise for it: the rounding of θ + Δ (a few ulps of max |θ|)
    plus ``tolerance`` of max |expected|. At most 1 when the two agree."""
    bound = 4 * torch.finfo(torch.float32).eps * initial.abs().max() + tolerance * expected.abs().max()
    return float((update - expected).abs().max() / bound.clamp(min=1e-30))


def phase_compare(args: argparse.Namespace) -> None:
    reference = torch.load(args.out_dir / "fsdp2_reference.pt")
    ranks = [torch.load(p) for p in sorted(args.out_dir.glob("fsdp2_rank*.pt"))]
    sharded = ranks[0]
    coefficient_diffs = []
    for record in (r for out in ranks for r in out["records"]):
        ids = record["row_ids"]
        coefficient_diffs.append(relative(record["s_bar"], reference["s_bar"][ids]))
        coefficient_diffs.append(relative(record["s_tilde"], reference["s_tilde"][ids]))
    ref_grads, grads = reference["grads"], sharded["grads"]
    head = next(n for n in ref_grads if n.startswith("lm_head")) if any(
        n.startswith("lm_head") for n in ref_grads) else "model.embed_tokens.weight"
    grad_diff = {n: relative(grads[n], ref_grads[n]) for n in ref_grads}
    update_ref = {n: reference["params"][n] - reference["initial"][n] for n in ref_grads}
    update = {n: sharded["params"][n] - reference["initial"][n] for n in ref_grads}
    update_diff = {n: relative(update[n], update_ref[n]) for n in ref_grads}
    update_bound = {n: update_gap(update[n], update_ref[n], reference["initial"][n], args.tolerance) for n in ref_grads}
    lr = reference["learning_rate"]
    expected_update = max(update_gap(update_ref[n], -lr * ref_grads[n], reference["initial"][n],
                                     args.tolerance) for n in ref_grads)
    worst_grad = max(grad_diff, key=grad_diff.get)
    result = {
        "card": args.device_name, "processes": sharded["processes"], "fsdp": sharded["fsdp"],
        "model_class": sharded["model_class"], "model": args.model, "dtype": "float32, TF32 off",
        "layout": sorted({r["layout"] for out in ranks for r in out["records"]}),
        "transform": TRANSFORM, "rows": int(reference["s_bar"].numel()),
        "weights_changed_by_transform": int((reference["s_tilde"] != reference["s_bar"]).sum()),
        "max_rel_diff_coefficients": max(coefficient_diffs),
        "max_rel_diff_grad": grad_diff[worst_grad], "worst_grad_parameter": worst_grad,
        "lm_head_parameter": head, "tied_embeddings": head == "model.embed_tokens.weight" or (
            "model.embed_tokens.weight" not in ref_grads),
        "max_rel_diff_lm_head_grad": grad_diff[head],
        "lm_head_grad_norm_ratio": float(grads[head].norm() / ref_grads[head].norm()),
        "max_rel_diff_update": max(update_diff.values()),
        "update_diff_over_rounding_bound": max(update_bound.values()),
        "reference_update_over_rounding_bound_vs_minus_lr_grad": expected_update,
        "learning_rate": lr, "optimizer": "sgd (one step)",
        "parameters_compared": len(ref_grads),
        "losses_reference": [r["loss"] for r in reference["records"]],
        "losses_fsdp2_rank0": [r["loss"] for r in sharded["records"]],
        "tolerance": args.tolerance,
        "commands": [
            "python -m dfpo_bench.launch.fsdp2_parity --phase reference --out-dir OUT",
            "accelerate launch --config_file recipes/accelerate/fsdp2_2gpu.yaml --mixed_precision no "
            "benchmarks/dfpo_bench/launch/fsdp2_parity.py --phase fsdp2 --out-dir OUT",
            "python -m dfpo_bench.launch.fsdp2_parity --phase compare --out-dir OUT",
        ],
    }
    result["parity"] = bool(
        result["fsdp"] and result["processes"] == 2
        and max(result["max_rel_diff_coefficients"], result["max_rel_diff_grad"]) <= args.tolerance
        and max(result["update_diff_over_rounding_bound"], expected_update) <= 1.0)
    (args.out_dir / "fsdp2_parity.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["reference", "fsdp2", "compare"], required=True)
    parser.add_argument("--model", default="/root/models/smollm2-135m-instruct")
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/fsdp2_parity"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest difference allowed, relative to the largest value compared (float32 sums)")
    parser.add_argument("--device-name", default=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    {"reference": phase_reference, "fsdp2": phase_fsdp2, "compare": phase_compare}[args.phase](args)


if __name__ == "__main__":
    main()
