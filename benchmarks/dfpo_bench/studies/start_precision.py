"""Study v4 part 3's hand-off check: does a warm start survive the precision the arms train in?

    python -m dfpo_bench.studies.start_precision --base BASE_DIR --warm-start WARM_DIR --out OUT.json [--accuracy]

Reads the warm-start checkpoint's drift set (the 64 held-out prompts the gate and the runs' drift meter read, the
two correct-sum forms; ``dfpo_trl.metrics.drift``) three ways: float32 weights and forwards (what the gate read),
float32 weights under bf16 autocast (what TRL's ``bf16: true`` gives the arms) and bf16 weights; with ``--accuracy``
also greedy held-out accuracy on 100 problems each way (32 new tokens, as the runs' held-out evaluation). And the
rounding itself, weight by weight against the base checkpoint: the share of the base on the bf16 grid, the share
the SFT changed, the share of those that rounding to bf16 returns exactly to the base value, and the share of the
update's squared norm that rounding keeps (the projection <round(w) - b, w - b> / |w - b|^2). Why:
benchmarks/README.md, "Study v4, part 3", "The hand-off".
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
from typing import Any

from dfpo_bench import study_v4_tasks
from dfpo_bench.lib import common

MODES = ("float32", "bf16_autocast", "bf16_weights")


def rounding(base: dict[str, Any], tuned: dict[str, Any]) -> dict[str, float]:
    """The bf16 rounding of the tuned weights against the base, over every distinct tensor (a tied embedding and LM
    head counted once)."""
    import torch

    total = on_grid = changed = reverted = 0
    update_sq = kept = 0.0
    seen: set[int] = set()
    for name, w in tuned.items():
        if w.data_ptr() in seen:
            continue
        seen.add(w.data_ptr())
        w, b = w.detach().double(), base[name].detach().double()
        rounded = w.to(torch.bfloat16).double()
        moved = w != b
        total += w.numel()
        on_grid += int((b.to(torch.bfloat16).double() == b).sum())
        changed += int(moved.sum())
        reverted += int((moved & (rounded == b)).sum())
        update_sq += float(((w - b) ** 2).sum())
        kept += float(((rounded - b) * (w - b)).sum())
    return {"weights": total, "base_on_bf16_grid": on_grid / total, "changed_by_sft": changed / total,
            "changed_reverted_by_bf16": reverted / changed if changed else 0.0,
            "update_kept_by_bf16": kept / update_sq if update_sq else 1.0}


def reading(model: Any, tokenizer: Any, mode: str, accuracy: bool) -> dict[str, Any]:
    """The drift set's summary (and greedy accuracy) with ``model`` as loaded for ``mode``."""
    import torch
    from dfpo_trl.cli import greedy_accuracy
    from dfpo_trl.testing.measures import (
        completion_log_probs,
        end_token_ids,
        summarise_equivalent_sets,
    )

    task = study_v4_tasks.two_digit()
    rows = list(task.build_dataset("test", 64))
    device = next(model.parameters()).device.type
    context = torch.autocast(device, dtype=torch.bfloat16) if mode == "bf16_autocast" else contextlib.nullcontext()
    with context:
        logps = completion_log_probs(model, tokenizer, [r["prompt"] for r in rows for _ in range(2)],
                                     [f for r in rows for f in task.equivalent_forms(r)],
                                     end_ids=end_token_ids(tokenizer, model)).view(-1, 2)
        out: dict[str, Any] = dict(summarise_equivalent_sets(logps))
        if accuracy:
            out["greedy_accuracy_100"] = greedy_accuracy(model, tokenizer, list(task.build_dataset("test", 100)), task,
                                                         max_new_tokens=32)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the base checkpoint the warm start was trained from")
    p.add_argument("--warm-start", required=True, help="the warm start's saved checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--accuracy", action="store_true", help="also greedy held-out accuracy on 100 problems")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.warm_start)
    load = {mode: torch.bfloat16 if mode == "bf16_weights" else torch.float32 for mode in MODES}
    readings = {}
    for mode in MODES:
        model = AutoModelForCausalLM.from_pretrained(args.warm_start, dtype=load[mode]).to(device)
        readings[mode] = reading(model, tokenizer, mode, args.accuracy)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(args.warm_start, dtype=torch.float32).state_dict()
    result = {"base": str(pathlib.Path(args.base)), "warm_start": str(pathlib.Path(args.warm_start)),
              "device": device, "card": common.card(), "versions": common.versions(), "readings": readings,
              "rounding": rounding(base, tuned), "written_at": common.utc_now()}
    common.write_json(args.out, result)
    for mode in MODES:
        print(mode, {k: round(v, 4) for k, v in readings[mode].items()})
    print("rounding", {k: round(v, 4) for k, v in result["rounding"].items()})
    return result


if __name__ == "__main__":
    main()
