"""Is the drift meter's set log-probability the probability with which the policy samples the canonical forms?

The equivalent-solution drift meter (dfpo_trl.metrics.drift, DriftMeterCallback) scores each held-out prompt's
canonical completions y_f = (form text, end token) and logs D4, ``drift/set_logp_mean`` = mean over prompts of
log Σ_f π(y_f | x). This check samples K completions per prompt from the same model as TRL's trainer samples them
(the chat template rendered as TRL renders it, TRL's generation settings from DFPOConfig's defaults, TRL's end tokens,
transformers' ``align_special_tokens`` applied first as the Trainer applies it) and counts the completions that are
exactly a canonical form as the meter defines it: the form's tokens followed by one of the end tokens. Both numbers
and their gap go to JSON; the gate is |set_logp_mean − log(sampled frequency)| ≤ 1 nat.

Since set_logp_mean is a mean of logs over prompts and the pooled frequency a mean of probabilities, the JSON also has
the like-for-like number log(mean over prompts of Σ_f π(y_f | x)) and its gap (Jensen: it is ≥ set_logp_mean), the
frequency's 95% Wilson interval, and the same per form. A completion is sampled only up to the longest form's length
plus the end token: a longer one cannot be a canonical form, so the count is exact.

    python -m dfpo_bench.studies.drift_meter_check                     # embedded SmolLM2 on the CPU, 16 prompts x 64
    python -m dfpo_bench.studies.drift_meter_check --device cuda --model /root/models/smollm2-135m-instruct \
        --samples 256
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]

import torch  # noqa: E402
from dfpo_trl import DFPOConfig  # noqa: E402
from dfpo_trl.cli import get_task  # noqa: E402
from dfpo_trl.testing.measures import (  # noqa: E402
    DriftMeterCallback,
    completion_log_probs,
    end_token_ids,
    equivalent_set_stats,
)

from dfpo_bench.lib.common import device_name, quiet, versions, write_json  # noqa: E402

GAP_GATE = 1.0  # nats


def trl_sampling_defaults() -> dict[str, Any]:
    """TRL's sampling settings as DFPOConfig defaults them (GRPOTrainer passes these to ``generate``)."""
    fields = {f.name: f.default for f in dataclasses.fields(DFPOConfig)}
    return {name: fields[name] for name in ("top_p", "top_k", "min_p", "repetition_penalty")}


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def safe_log(x: float) -> float | None:
    return math.log(x) if x > 0 else None


def load(model_path: str | None, device: str, dtype: str) -> tuple[Any, Any, str]:
    from dfpo_trl.cli import embedded_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(embedded_model_path()) if model_path is None else model_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    return tokenizer, model, path


def sample_counts(
    model: Any, tokenizer: Any, prompt: Any, form_ids: list[list[int]], end_ids: list[int], samples: int,
    batch_size: int, temperature: float, chat_template_kwargs: dict[str, Any],
) -> tuple[list[int], list[int], list[int]]:
    """Per form: completions that are exactly its tokens + an end token; those whose text (before an end token) is
    the form's text in another tokenization; and the prompt ids as TRL tokenizes them."""
    from transformers import DynamicCache, GenerationConfig

    encoded = tokenizer.apply_chat_template(  # as GRPOTrainer._tokenize_prompts renders a conversational prompt
        conversation=[prompt], add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
    )
    prompt_ids = list(encoded["input_ids"][0])
    settings = trl_sampling_defaults()
    generation = GenerationConfig(
        max_new_tokens=max(len(ids) for ids in form_ids) + 1, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end_ids, temperature=temperature,
        top_p=settings["top_p"], top_k=settings["top_k"], min_p=settings["min_p"],
        repetition_penalty=settings["repetition_penalty"], disable_compile=True,
    )
    forms_text = [tokenizer.decode(ids) for ids in form_ids]
    exact, text_only = [0] * len(form_ids), [0] * len(form_ids)
    device = next(model.parameters()).device
    done = 0
    while done < samples:
        rows = min(batch_size, samples - done)
        ids = torch.tensor([prompt_ids] * rows, device=device)
        with torch.no_grad():
            # the prompt's cache computed once and repeated for the rows: the same logits, a fraction of the time
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:1, :-1], past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(rows)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=generation,
                                 past_key_values=cache)
        for completion in out[:, len(prompt_ids):].tolist():
            # TRL's completion: up to and including the first end token
            end = next((i for i, t in enumerate(completion) if t in end_ids), None)
            if end is None:
                continue
            body = completion[:end]
            for f, ids_f in enumerate(form_ids):
                if body == ids_f:
                    exact[f] += 1
                elif tokenizer.decode(body) == forms_text[f]:
                    text_only[f] += 1
        done += rows
    return exact, text_only, prompt_ids


def check(args: argparse.Namespace) -> dict[str, Any]:
    from transformers.trainer_utils import align_special_tokens

    torch.manual_seed(args.seed)
    tokenizer, model, path = load(args.model, args.device, args.dtype)
    if args.tokenizer_eos is not None:  # reproduce a reader's wrong end token (transformers 5.17: <|im_start|>)
        tokenizer.eos_token = args.tokenizer_eos
    before = {"tokenizer_eos": [tokenizer.eos_token, tokenizer.eos_token_id],
              "generation_config_eos": model.generation_config.eos_token_id}
    align_special_tokens(model, tokenizer)  # what transformers' Trainer does to the model before training
    end_ids = end_token_ids(tokenizer, model)  # what TRL's trainer stops at
    task = get_task(args.task)
    problems = [dict(row) for row in task.build_dataset("test", args.prompts, args.seed)]
    chat_kwargs: dict[str, Any] = {}

    start = time.monotonic()
    meter = DriftMeterCallback(task, problems, every=1, temperature=args.temperature, batch_size=args.batch_size)
    meter.on_train_begin(None, argparse.Namespace(global_step=0, max_steps=1), None, model=model,
                         processing_class=tokenizer)
    logged = meter.results["curve"][0]
    forms = [task.equivalent_forms(row) for row in problems]
    per_form_logp = completion_log_probs(
        model, tokenizer, [row["prompt"] for row in problems for _ in task.form_names],
        [text for per_row in forms for text in per_row], temperature=args.temperature, batch_size=args.batch_size,
        end_ids=end_ids,
    ).view(len(problems), -1)
    set_logp = equivalent_set_stats(per_form_logp)["set_logp"]
    tokenizer_eos_only = None  # what the meter logged before it summed over TRL's end tokens
    if len(end_ids) > 1:
        tokenizer_eos_only = float(equivalent_set_stats(completion_log_probs(
            model, tokenizer, [row["prompt"] for row in problems for _ in task.form_names],
            [text for per_row in forms for text in per_row], temperature=args.temperature, batch_size=args.batch_size,
        ).view(len(problems), -1))["set_logp"].mean())
    meter_seconds = time.monotonic() - start

    start = time.monotonic()
    per_prompt = []
    for row, texts, logps, row_set_logp in zip(problems, forms, per_form_logp.tolist(), set_logp.tolist(),
                                               strict=True):
        form_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        exact, text_only, prompt_ids = sample_counts(
            model, tokenizer, row["prompt"], form_ids, end_ids, args.samples, args.batch_size, args.temperature,
            chat_kwargs,
        )
        meter_prompt = tokenizer(tokenizer.apply_chat_template(row["prompt"], tokenize=False,
                                                               add_generation_prompt=True),
                                 add_special_tokens=False)["input_ids"]
        per_prompt.append({
            "answer": row["answer"], "form_logp": logps, "set_logp": row_set_logp, "hits": exact,
            "text_hits_other_tokenization": text_only, "prompt_ids_as_meter": prompt_ids == meter_prompt,
        })
    sample_seconds = time.monotonic() - start

    n = args.prompts * args.samples
    hits = sum(sum(p["hits"]) for p in per_prompt)
    freq = hits / n
    low, high = wilson(hits, n)
    mean_prob = float(torch.logsumexp(set_logp, 0) - math.log(len(problems)))
    log_freq = safe_log(freq)
    forms_out = []
    for f, name in enumerate(task.form_names):
        form_hits = sum(p["hits"][f] for p in per_prompt)
        form_mean = float(torch.logsumexp(per_form_logp[:, f], 0) - math.log(len(problems)))
        forms_out.append({"form": name, "hits": form_hits, "log_sampled_frequency": safe_log(form_hits / n),
                          "log_mean_meter_probability": form_mean})
    gap = None if log_freq is None else logged["set_logp_mean"] - log_freq
    return {
        "what": "drift meter set log-probability vs sampled frequency of the canonical forms, before training",
        "model": path, "task": args.task, "device": device_name(args.device), "dtype": args.dtype,
        "versions": versions(), "seed": args.seed, "prompts": args.prompts, "samples_per_prompt": args.samples,
        "temperature": args.temperature, "sampling": trl_sampling_defaults(),
        "end_tokens": {"before_alignment": before, "end_ids": end_ids,
                       "end_tokens": tokenizer.convert_ids_to_tokens(end_ids),
                       "meter_warning": meter.results.get("end_token_warning")},
        "prompt_ids_as_meter": all(p["prompt_ids_as_meter"] for p in per_prompt),
        "meter_set_logp_mean": logged["set_logp_mean"],
        "set_logp_mean_scoring_only_the_tokenizer_eos": tokenizer_eos_only,
        "log_mean_meter_probability": mean_prob,
        "sampled_hits": hits, "sampled_total": n, "sampled_frequency": freq,
        "log_sampled_frequency": log_freq,
        "log_sampled_frequency_95": [safe_log(low), safe_log(high)],
        "text_hits_other_tokenization": sum(sum(p["text_hits_other_tokenization"]) for p in per_prompt),
        "gap_set_logp_mean": gap,
        "gap_like_for_like": None if log_freq is None else mean_prob - log_freq,
        "gate_nats": GAP_GATE, "gate_passed": gap is not None and abs(gap) <= GAP_GATE,
        "forms": forms_out, "per_prompt": per_prompt,
        "seconds": {"meter": round(meter_seconds, 1), "sampling": round(sample_seconds, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded SmolLM2)")
    parser.add_argument("--task", default="two_forms")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=64, help="completions sampled per prompt")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-eos", default=None,
                        help="force the tokenizer's end token (e.g. '<|im_start|>', as transformers 5.17's GGUF reader "
                             "sets it for SmolLM2) to check the meter under that fault")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/drift_meter_check_<device>"
                                                    ".json)")
    args = parser.parse_args(argv)
    quiet()
    result = check(args)
    out = args.out or ROOT / "benchmarks" / "results" / f"drift_meter_check_{args.device.split(':')[0]}.json"
    write_json(out, result)
    print(f"set_logp_mean {result['meter_set_logp_mean']:.3f}, log mean meter probability "
          f"{result['log_mean_meter_probability']:.3f}, log sampled frequency {result['log_sampled_frequency']} "
          f"({result['sampled_hits']}/{result['sampled_total']}), gap {result['gap_set_logp_mean']}, "
          f"gate {'passed' if result['gate_passed'] else 'FAILED'}; wrote {out}")
    return 0 if result["gate_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
