"""What vLLM's 16-bit logits do to the ratio against the truncated support, with trained weights, on the CPU.

    python -m dfpo_bench.trained.logit_rounding --model DIR --out results/trained/logit_rounding.json

vLLM's head returns the logits in the model's dtype (bf16 for the recipes) and its sampler casts them to float32
before the temperature, min-p, top-k and top-p; TRL's fused head scores the same hidden states in float32. This
emulates both from ONE forward of the trained model (its bf16 weights computed in float32), so every difference it
measures comes from the logits' rounding alone, none from the engines' kernels. Per setting of ``is_ratio.SETTINGS``
it samples completions as vLLM does (support and probabilities from the rounded logits) and keeps, per row, the log
ratio of TRL (Σ ℓ^old − s), of the truncated support rebuilt from the float32 logits (the product before this
benchmark) and from the rounded ones (the product since), plus how many sampled tokens fall outside the float32
support. Slopes are OLS of a row's log ratio on its length (nats per token), as in ``is_ratio``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import torch

from dfpo_bench.lib.common import ROOT
from dfpo_bench.lib.provenance import checkout_state
from dfpo_bench.trained.is_ratio import PROMPTS, SETTINGS, log_mass_on, ols_slope, rebuild_support

KINDS = ("trl", "support_float32", "support_rounded")


@torch.no_grad()
def sample_rows(model: Any, tokenizer: Any, setting: tuple[float, float, int, float], rows_per_prompt: int,
                max_new: int) -> list[dict[str, Any]]:
    """``rows_per_prompt`` completions of every prompt, each token drawn from the rounded logits' support."""
    temperature, top_p, top_k, min_p = setting
    weight = model.get_output_embeddings().weight.float()
    ends = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    rows = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        step = tokenizer(text, return_tensors="pt").input_ids.repeat(rows_per_prompt, 1)
        cache, alive = None, torch.ones(rows_per_prompt, dtype=torch.bool)
        kept = [{k: 0.0 for k in (*KINDS, "length", "outside_float32")} for _ in range(rows_per_prompt)]
        for _ in range(max_new):
            out = model.model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            raw = out.last_hidden_state[:, -1].float() @ weight.T  # TRL's fused head: float32
            rounded = raw.to(torch.bfloat16).float()  # vLLM's head: the checkpoint's bf16
            keep16 = rebuild_support(rounded, temperature, top_p, top_k, min_p)
            keep32 = rebuild_support(raw, temperature, top_p, top_k, min_p)
            processed = torch.log_softmax((rounded / temperature).masked_fill(~keep16, float("-inf")), -1)
            token = torch.multinomial(processed.exp(), 1)
            s = processed.gather(1, token).squeeze(1)
            tempered = raw / temperature
            old = torch.log_softmax(tempered, -1).gather(1, token).squeeze(1)
            values = {"trl": old - s, "support_float32": old - log_mass_on(tempered, keep32) - s,
                      "support_rounded": old - log_mass_on(tempered, keep16) - s,
                      "outside_float32": (~keep32.gather(1, token).squeeze(1)).float(),
                      "length": torch.ones(rows_per_prompt)}
            for r in range(rows_per_prompt):
                if alive[r]:
                    for name, value in values.items():
                        kept[r][name] += float(value[r])
                    alive[r] = int(token[r]) not in ends
            if not alive.any():
                break
            step = token
        rows += kept
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["length"] for r in rows)
    return {"rows": len(rows), "tokens": int(tokens),
            "slope_per_token": {k: ols_slope([(r["length"], r[k]) for r in rows]) for k in KINDS},
            "mean_log_ratio_per_token": {k: sum(r[k] for r in rows) / tokens for k in KINDS},
            "sampled_outside_float32_support": sum(r["outside_float32"] for r in rows) / tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(prog="python -m dfpo_bench.trained.logit_rounding", description=__doc__)
    parser.add_argument("--model", required=True, help="a bf16 checkpoint (the GPU kit's Qwen2.5-Coder-0.5B)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rows-per-prompt", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=160)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()  # the bf16 weights
    flags = " ".join(sys.argv[1:] if argv is None else argv)
    result: dict[str, Any] = {"command": f"python -m dfpo_bench.trained.logit_rounding {flags}",
                              "checkout": checkout_state(ROOT), "model": args.model, "device": "cpu",
                              "rows_per_prompt": args.rows_per_prompt, "max_new": args.max_new, "settings": {}}
    for name in args.settings:
        start = time.perf_counter()
        result["settings"][name] = summarise(sample_rows(model, tokenizer, SETTINGS[name], args.rows_per_prompt,
                                                         args.max_new))
        result["settings"][name]["seconds"] = round(time.perf_counter() - start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(name, json.dumps(result["settings"][name]), flush=True)
    return result


if __name__ == "__main__":
    main()
