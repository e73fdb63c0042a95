"""Rows the pre-pass forwards per off-policy optimizer step, DFPO's group order against TRL's per-sample order (CPU).

A forward pre-hook counts the rows of every no-grad forward of a tiny Llama trained with Min-Replace in the pre-pass
layout; in steps that do not generate that is the pre-pass's F. ``per_sample`` keeps TRL's order by replacing the
regrouping with the whole-group marking alone; several seeds, as TRL's shuffle makes F random there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.testing import addition_dataset, last_digit_reward, tiny_config_kwargs, tiny_model, tiny_tokenizer
from dfpo_trl.testing.measures import pre_pass_rows

from dfpo_bench.lib import common

CASES = [(2, 4, 2, 8), (1, 4, 2, 8), (3, 6, 1, 4), (2, 8, 2, 8), (3, 4, 4, 8), (2, 3, 3, 6), (3, 4, 1, 4)]
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28)


def keep_per_sample_order(trainer: Any) -> None:
    """In the pre-pass layout, keep TRL's per-sample order of each rollout: the regrouping replaced by the
    whole-group marking alone (the pre-pass stays exact either way)."""
    layout = trainer.layout

    def per_sample(buffered: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        layout._mark_whole_groups(buffered)
        return buffered

    layout.regroup = per_sample


def count(b: int, G: int, A: int, S: int, seed: int, order: str) -> list[int]:
    """F of each off-policy optimizer step of two rollouts."""
    model = tiny_model(seed)
    rows = [0]

    def hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            rows[0] += kwargs.get("input_ids", args[0] if args else None).size(0)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    per_rollout = S // A
    args = DFPOConfig(**tiny_config_kwargs(**GSPO, per_device_train_batch_size=b, num_generations=G,
                                           gradient_accumulation_steps=A, steps_per_generation=S, seed=seed,
                                           max_steps=2 * per_rollout, max_completion_length=4,
                                           group_transform="min_replace"))
    trainer = DFPOTrainer(model=model, reward_funcs=last_digit_reward, args=args, train_dataset=addition_dataset(64),
                          processing_class=tiny_tokenizer())
    if order == "per_sample":
        keep_per_sample_order(trainer)
    counts: list[int] = []
    step = trainer.training_step

    def counted(*a: Any, **kw: Any) -> Any:
        rows[0] = 0
        out = step(*a, **kw)
        counts.append(rows[0])
        return out

    trainer.training_step = counted
    trainer.train()
    per_step = [sum(counts[k * A:(k + 1) * A]) for k in range(2 * per_rollout)]
    return [per_step[k] for k in range(2 * per_rollout) if k % per_rollout]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/prepass_rows.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    common.quiet()
    results = []
    for b, G, A, S in CASES:
        entry: dict[str, Any] = {"b": b, "G": G, "A": A, "steps_per_generation": S, "R": A * b,
                                 "predicted": pre_pass_rows(b, A, S, G)[1:]}
        for order in ("groups", "per_sample"):
            counted = [count(b, G, A, S, seed, order) for seed in range(args.seeds)]
            entry[order] = {"per_seed": counted, "mean_F": statistics.fmean(v for c in counted for v in c)}
        entry["F_over_R"] = {o: entry[o]["mean_F"] / (A * b) for o in ("groups", "per_sample")}
        results.append(entry)
        print(f"b {b} G {G} A {A} S {S} R {A * b}: F {entry['groups']['mean_F']:.2f} (groups) vs "
              f"{entry['per_sample']['mean_F']:.2f} (per-sample order)", flush=True)
    common.write_json(args.out, {"card": common.device_name("cpu"), "versions": common.versions(),
                                 "command": "python -m dfpo_bench.cost.prepass_rows " + " ".join(sys.argv[1:]),
                                 "cases": results})


if __name__ == "__main__":
    main()
