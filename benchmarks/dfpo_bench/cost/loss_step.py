"""Loss + backward time of every objective on ONE fixed off-policy batch, against TRL's own GSPO, interleaved.

Whole loops drift by up to 28% between phases on the GPU machines, hiding an overhead of 1-2%; here only
``trainer.compute_loss`` and ``backward`` run, on one model and one hand-built batch (old log-probs shifted so that
some rows clip). Each round runs every method ``--reps`` times in a shuffled order; the ratio to TRL is taken within
a round, then bootstrapped over rounds. Writes ``loss_step_<tag>.json``, with whether ``dfpo_none``'s loss equals TRL's.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import time
from typing import Any

from dfpo_bench.lib import common, stats, trainers

BASELINE = "trl_gspo"
# TRL's GRPOTrainer itself, then DFPOTrainer with DFPO off, then each objective (weights and gradient targets).
DEFAULT_METHODS = (BASELINE, "dfpo_none", "min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance",
                   "min_replace_grad", "positive_orth_proj_grad", "min_replace_grad_zero", "none_score")


def fixed_batch(args: argparse.Namespace, tokenizer: Any, device: str) -> dict[str, Any]:
    """One off-policy rollout batch of ``--rows`` rows in groups of ``--group-size``: random prompt and completion
    tokens, completion lengths between half and all of ``--completion-length``, zero-mean advantages per group."""
    import torch
    from dfpo_trl.testing.measures import WHOLE_GROUPS_KEY, consecutive_group_ids

    g = torch.Generator().manual_seed(args.seed)
    rows, length, vocab = args.rows, args.completion_length, len(tokenizer)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    completion_mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards = torch.randint(0, 2, (rows // args.group_size, args.group_size), generator=g).float()
    advantages = (rewards - rewards.mean(1, keepdim=True)).view(-1)
    batch = {
        "prompt_ids": torch.randint(0, vocab, (rows, args.prompt_length), generator=g),
        "prompt_mask": torch.ones(rows, args.prompt_length, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (rows, length), generator=g), "completion_mask": completion_mask,
        "advantages": advantages, "num_items_in_batch": completion_mask.sum(),
        "group_ids": consecutive_group_ids(rows, args.group_size), "row_ids": torch.arange(rows),
        # marked by DFPOTrainer's _prepare_inputs on whole groups (TRL ignores it): the loss takes the training path
        WHOLE_GROUPS_KEY: True}
    # Old log-probs = current ones minus a per-row shift of a few ε (set after the model exists, in main()).
    batch["row_shift"] = args.shift * torch.randn(rows, 1, generator=g)
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items()}


def build_trainer(name: str, model: Any, tokenizer: Any, args: argparse.Namespace) -> Any:
    from datasets import Dataset

    # ``trl_gspo`` is TRL's GRPOTrainer with GSPO's settings; every other method runs through DFPOTrainer
    trainer_cls, config_cls, overrides = trainers.trainer_and_config(
        "gspo" if name == BASELINE else name, baseline_trainer="trl" if name == BASELINE else "dfpo")
    config = config_cls(**trainers.config_kwargs(
        device=args.device, seed=args.seed, max_steps=1, per_device_train_batch_size=args.rows,
        num_generations=args.group_size, steps_per_generation=2, max_completion_length=args.completion_length,
        learning_rate=1e-6, gradient_checkpointing=not args.no_gradient_checkpointing), **overrides)
    dataset = Dataset.from_dict({"prompt": ["x"] * args.rows})
    trainer = trainer_cls(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
                          train_dataset=dataset, processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="pretrained checkpoint (default: --random-config)")
    parser.add_argument("--random-config", default="tiny", choices=trainers.RANDOM_CONFIGS)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(trainers.DTYPES))
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=[BASELINE, *trainers.METHODS])
    for name, default in (("rows", 64), ("group-size", 8), ("prompt-length", 32), ("completion-length", 256),
                          ("rounds", 30), ("reps", 3), ("warmup", 2), ("seed", 0)):  # --warmup: untimed rounds first
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--shift", type=float, default=2e-3, help="std of the per-row log-ratio offset")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    common.quiet()
    import torch

    methods = args.methods
    if args.rows % args.group_size:
        raise SystemExit(f"--rows {args.rows} must be a multiple of --group-size {args.group_size}")
    tokenizer = trainers.load_tokenizer(args.tokenizer or args.model or trainers.default_tokenizer_path())
    model = trainers.build_model(args.model, None if args.model else args.random_config, tokenizer,
                                 trainers.DTYPES[args.dtype], args.device, args.seed)
    built = {name: build_trainer(name, model, tokenizer, args) for name in methods}
    batch = fixed_batch(args, tokenizer, args.device)
    shift = batch.pop("row_shift")
    probe = built[methods[0]]
    with torch.no_grad():
        current, _, _ = probe._get_per_token_logps_and_entropies(
            model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1))
    batch["old_per_token_logps"] = (current - shift).float()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def step(name: str) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        loss = built[name].compute_loss(model, dict(batch))
        loss.backward()
        sync()
        return time.perf_counter() - start, float(loss.detach())

    losses = {name: step(name)[1] for name in methods}
    times: dict[str, list[float]] = {name: [] for name in methods}
    order_rng = random.Random(args.seed)
    started = time.time()
    for round_index in range(args.warmup + args.rounds):
        order = list(methods)
        order_rng.shuffle(order)
        for name in order:
            per_rep = [step(name)[0] for _ in range(args.reps)]
            if round_index >= args.warmup:
                times[name].append(statistics.median(per_rep))
    result: dict[str, Any] = {
        "device": common.device_name(args.device), "versions": common.versions(),
        "model": pathlib.Path(args.model).name if args.model else f"random-{args.random_config}",
        "dtype": args.dtype, "rows": args.rows, "group_size": args.group_size,
        "completion_length": args.completion_length, "prompt_length": args.prompt_length,
        "gradient_checkpointing": not args.no_gradient_checkpointing, "rounds": args.rounds, "reps": args.reps,
        "wall_s": round(time.time() - started, 1), "baseline": BASELINE, "methods": {}}
    base = times[BASELINE] if BASELINE in times else None
    for name in methods:
        entry: dict[str, Any] = {"round_median_s": times[name], "median_s": statistics.median(times[name]),
                                 "loss": losses[name]}
        if base is not None and name != BASELINE:
            ratios = [t / b for t, b in zip(times[name], base, strict=True)]
            entry.update(ratio_to_trl=statistics.median(ratios), ratio_interval_95=stats.bootstrap_median(ratios))
        result["methods"][name] = entry
    if "dfpo_none" in losses and BASELINE in losses:
        result["dfpo_none_loss_equals_trl"] = losses["dfpo_none"] == losses[BASELINE]
    tag = args.tag or result["model"]
    common.write_json(pathlib.Path(args.out_dir) / f"loss_step_{tag}.json", result)
    print(f"device: {result['device']}; model {result['model']}, {args.rows} rows x {args.completion_length} "
          f"tokens, {args.rounds} rounds x {args.reps} reps, {result['wall_s']} s")
    print(f"{'method':26s} {'median ms':>10s} {'ratio':>7s}  95% interval")
    for name, entry in result["methods"].items():
        ratio, interval = entry.get("ratio_to_trl"), entry.get("ratio_interval_95")
        print(f"{name:26s} {1e3 * entry['median_s']:10.2f} "
              + (f"{ratio:7.3f}  [{interval[0]:.3f}, {interval[1]:.3f}]" if ratio is not None else "      -"))


if __name__ == "__main__":
    main()
