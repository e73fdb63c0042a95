"""ZeRO-3 on several GPUs: exact in-group coefficients when groups span processes and micro-steps.

Phases (commands: benchmarks/README.md): ``reference``, one process, s̄ and s̃ of every row of one fixed generation
batch; ``zero3``, under accelerate, the same batch sliced as TRL slices a rollout, one optimizer step of the
``pre_pass`` layout recording what every process used, then the pre-pass against whole groups per micro-batch for the
step time; ``compare``, writes ``zero3.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch
from dfpo_trl import DFPOConfig, DFPOTrainer, get_transform
from dfpo_trl.cli import get_task
from dfpo_trl.testing import record_row_weights
from dfpo_trl.testing.measures import consecutive_group_ids, sequence_log_ratio, sign_aware_post_clip
from transformers import AutoModelForCausalLM, AutoTokenizer

from dfpo_bench.lib.timing import StepClock

TRANSFORM, (EPS_LOW, EPS_HIGH) = "min_replace", (0.2, 0.28)
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
    return {"prompt_ids": prompt.repeat(rows, 1), "prompt_mask": torch.ones(rows, prompt.size(1), dtype=torch.long),
            "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": adv,
            "log_ratio_shift": 0.15 * torch.randn(rows, 1, generator=g) + 0.03 * torch.randn(rows, 12, generator=g)}


@torch.no_grad()
def model_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1).to(model.device)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).to(model.device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -batch["completion_ids"].size(1) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].to(model.device)[..., None])[..., 0].cpu()


class Recorder(DFPOTrainer):
    """Keeps the s̄, s̃ and loss of every micro-step: the sequence weights each micro-step's objective returns
    (tests/tiny.py's ``record_row_weights``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, Any]] = []
        self.used: list[Any] = record_row_weights(self)  # every micro-step's RowWeights, in order

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        loss = super()._compute_loss(model, inputs)
        w = self.used[-1]
        self.records.append({"row_ids": inputs["row_ids"].cpu(), "s_bar": w.s_bar.detach().float().cpu(),
                             "s_tilde": w.s_tilde.detach().float().cpu(), "loss": float(loss.detach()),
                             "layout": self.group_layout})
        return loss


def reference_weights(logps: torch.Tensor, old_logps: torch.Tensor, completion_mask: torch.Tensor,
                      advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s̄ (the sequence ratio clipped on the advantage's side, eq. 47) and s̃ (``TRANSFORM`` per group of G
    consecutive rows) of every row, in one process: what a sharded run's weights must equal."""
    rho = sequence_log_ratio(logps, old_logps, completion_mask)
    s_bar = sign_aware_post_clip(rho.exp(), advantages, EPS_LOW, EPS_HIGH)
    groups = (-1, SIZES["num_generations"])
    return s_bar, get_transform(TRANSFORM).apply(s_bar.view(groups), advantages.view(groups), 0.5, 1e-6).reshape(-1)


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


def phase_reference(args: argparse.Namespace) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    batch = fixed_batch(args.model, args.world)
    logps = model_logps(model, batch)
    batch["old_per_token_logps"] = logps - batch.pop("log_ratio_shift")
    s_bar, s_tilde = reference_weights(logps, batch["old_per_token_logps"], batch["completion_mask"],
                                       batch["advantages"])
    torch.save({"batch": batch, "s_bar": s_bar, "s_tilde": s_tilde}, args.out_dir / "zero3_reference.pt")
    print(f"reference: {s_bar.numel()} rows, transform changed {(s_tilde != s_bar).sum().item()} weights")


def base_config(args: argparse.Namespace, **overrides: Any) -> DFPOConfig:
    """What every trainer of the job shares (GSPO's sequence ratio and clip range, no saving), then ``overrides``."""
    return DFPOConfig(**{**dict(
        output_dir="/tmp/dfpo-zero3-trainer", importance_sampling_level="sequence", loss_type="grpo",
        epsilon=EPS_LOW, epsilon_high=EPS_HIGH, group_transform=TRANSFORM, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, max_completion_length=32, disable_tqdm=True, seed=0,
        use_cpu=not torch.cuda.is_available()), **overrides})


def phase_zero3(args: argparse.Namespace) -> None:
    reference = torch.load(args.out_dir / "zero3_reference.pt")
    task = get_task("arithmetic")
    dataset = task.build_dataset("train", 256, 0)
    # 1. exactness: one optimizer step (two micro-steps) on the fixed batch. DFPOConfig refuses a learning rate of
    # 0 (its range checks); at 1e-30 every update rounds off, so θ stays the initial θ as at 0.
    config = base_config(args, **SIZES, learning_rate=1e-30, max_steps=1)
    trainer = Recorder(model=args.model, reward_funcs=task.reward_funcs, args=config, train_dataset=dataset)
    rank = trainer.accelerator.process_index
    local = SIZES["per_device_train_batch_size"] * SIZES["steps_per_generation"]
    serve_fixed_rows(trainer, reference["batch"], rank, local, SIZES["num_generations"])
    trainer.train()
    torch.save(trainer.records, args.out_dir / f"zero3_rank{rank}.pt")
    # 2. step time: the pre-pass layout against whole groups per micro-batch, same generation batch.
    timings = {}
    for name, sizes in (
        ("co_located", dict(per_device_train_batch_size=8, num_generations=8, steps_per_generation=4)),
        ("pre_pass", dict(per_device_train_batch_size=4, num_generations=8, steps_per_generation=8,
                          gradient_accumulation_steps=2, group_layout="pre_pass")),  # auto would redistribute
    ):
        clock = StepClock()
        config = base_config(args, **sizes, learning_rate=1e-6, max_steps=args.timing_steps)
        run = DFPOTrainer(model=args.model, reward_funcs=task.reward_funcs, args=config, train_dataset=dataset,
                          callbacks=[clock])
        run.train()
        timings[name] = {"layout": run.group_layout, "step_s": [s["total_s"] for s in clock.steps],
                         "loss_finite": all(math.isfinite(h["loss"]) for h in run.state.log_history if "loss" in h)}
    plugin = trainer.accelerator.state.deepspeed_plugin
    timings["_run"] = {"zero_stage": plugin.zero_stage if plugin is not None else 0,
                       "processes": trainer.accelerator.num_processes}
    if rank == 0:
        (args.out_dir / "zero3_timing.json").write_text(json.dumps(timings))


def phase_compare(args: argparse.Namespace) -> None:
    reference = torch.load(args.out_dir / "zero3_reference.pt")
    diffs, layouts, losses = [], set(), []
    for path in sorted(args.out_dir.glob("zero3_rank*.pt")):
        for record in torch.load(path):
            ids = record["row_ids"]
            diffs += [(record[key] - reference[key][ids]).abs().max().item() for key in ("s_bar", "s_tilde")]
            layouts.add(record["layout"])
            losses.append(record["loss"])
    timing = json.loads((args.out_dir / "zero3_timing.json").read_text())
    run = timing.pop("_run")
    median = {k: statistics.median(v["step_s"][2:] or v["step_s"]) for k, v in timing.items()}  # warm steps
    result = {
        "device": args.device_name, "gpus": run["processes"], "zero_stage": run["zero_stage"],
        "steps": args.timing_steps, "layout": sorted(layouts),
        "coefficients_match_reference": bool(diffs) and max(diffs) < args.tolerance,
        "max_abs_diff": max(diffs) if diffs else None, "tolerance": args.tolerance,
        "loss_finite": all(map(math.isfinite, losses)) and all(v["loss_finite"] for v in timing.values()),
        "median_step_s": median, "layouts_timed": {k: v["layout"] for k, v in timing.items()},
        "pre_pass_over_co_located": median["pre_pass"] / median["co_located"],
    }
    (args.out_dir / "zero3.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["reference", "zero3", "compare"], required=True)
    parser.add_argument("--model", default="/root/models/smollm2-135m-instruct")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timing-steps", type=int, default=6)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--device-name", default=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    {"reference": phase_reference, "zero3": phase_zero3, "compare": phase_compare}[args.phase](args)


if __name__ == "__main__":
    main()
