"""At the users' size on one GPU: whole-loop cost, time split, memory and φ against TRL's GRPOTrainer, colocated vLLM.

    # the LoRA recipe on Qwen3-8B's architecture (random init, built on the GPU and saved for vLLM on first use)
    python -m dfpo_bench.cost.users_size --shape qwen3-8b --lora --methods trl dfpo_off min_replace \\
        --vllm-memory 0.3 --budget-s 480 --out $OUT/users_size_8b_lora.json
    # a full fine-tune of Qwen3-1.7B's architecture: every transform and the gradient target, and the pre-pass
    # layout (per-device batch 4 < G = 8) with DFPO's group order and with TRL's per-sample order
    python -m dfpo_bench.cost.users_size --shape qwen3-1.7b --methods all --budget-s 480 --out $OUT/users_size_1p7b.json
    # CPU smoke test (no vLLM, tiny random Qwen3)
    python -m dfpo_bench.cost.users_size --shape tiny --no-vllm --methods trl min_replace --rounds 1 --out /tmp/u.json

A random-init model answers nothing right, so the reward is ``id_parity`` (1 when the completion's token ids sum
to an odd number): every group gets both advantage signs and the transforms act. The tokenizer is SmolLM2's (the
only one on the GPU machine) with added tokens up to Qwen3's vocabulary of 151,936, so the embedding and LM head
have Qwen3's real size and every sampled id decodes. The batch, lengths, LoRA and clip settings are
``recipes/qwen3_8b_lora.yaml``'s (per-device batch 8 = G, 4 micro-batches per optimizer step, 8 per rollout: two
optimizer steps per rollout, the second off-policy; completions of up to 768 tokens; gradient checkpointing; bf16);
the prompts are the arithmetic task's (about 40 tokens, shorter than GSM8K's).

Design: ONE model and ONE vLLM engine per process (TRL's ``vllm.LLM`` returns the first engine for every later
trainer; each run pushes its own initial weights into it before training). A run is one method trained from the
same initial weights (LoRA: a fresh adapter, seeded; full: the initial weights restored) for ``--rollouts``
rollouts; a round runs every method once, in a shuffled order; a warm-up run precedes round 0. Per optimizer step
(CUDA synchronised): its wall time, the time in TRL's ``_generate_and_score_completions`` (the rollout), in vLLM's
``generate`` and in the weight sync; the loss steps are the rest. The ratio to the baseline is taken within a
round (same GPU, seconds apart) on the run's total time, on its loss-step time and on its generation alone
(vLLM's ``generate``, or with ``--no-vllm`` TRL's one-turn generation through transformers' ``generate``); the summary
gives each ratio's median over rounds with a percentile-bootstrap 95% interval over rounds. ``--cap-gib`` caps
PyTorch's allocator (``torch.cuda.set_per_process_memory_fraction``), a smaller card on a larger GPU.
Peak memory is torch's ``max_memory_allocated`` over the run (the engine's weights and KV cache included: vLLM
allocates through torch in this process) and the engine's own allocation measured when it was built. The JSON is
rewritten after every run, so a job cut by its time limit keeps every finished run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]

import torch  # noqa: E402

from dfpo_bench.lib import common, provenance, stats, trainers  # noqa: E402
from dfpo_bench.lib.timing import StepClock, synchronize  # noqa: E402

RECIPE = ROOT / "recipes" / "qwen3_8b_lora.yaml"
QWEN3_VOCAB = 151936
# Published configs (Qwen/Qwen3-8B and Qwen/Qwen3-1.7B config.json): hidden, intermediate, layers, heads, KV heads,
# head_dim 128, rope θ 1e6, RMSNorm ε 1e-6; the 8B unties its LM head, the 1.7B ties it.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}
TRANSFORMS = ["min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance"]
# name -> (DFPO fields or None for GRPOTrainer, per-device batch override, baseline of its ratios)
METHODS: dict[str, tuple[dict[str, Any] | None, int | None, str]] = {
    "trl": (None, None, "trl"),
    "dfpo_off": ({"group_transform": "none"}, None, "trl"),
    **{t: ({"group_transform": t}, None, "trl") for t in TRANSFORMS},
    "min_replace_gradient": ({"group_transform": "min_replace", "cancellation_target": "gradient"}, None, "trl"),
    # The pre-pass layout: per-device batch 4 < G = 8, one process. "_per_sample" keeps TRL's per-sample order
    # (the layout before DFPO ordered the pre-pass rollout by groups): the pre-pass then forwards every local group.
    "trl_b4": (None, 4, "trl_b4"),
    "min_replace_b4": ({"group_transform": "min_replace"}, 4, "trl_b4"),
    "min_replace_b4_per_sample": ({"group_transform": "min_replace"}, 4, "trl_b4"),
    "dfpo_off_b4": ({"group_transform": "none"}, 4, "trl_b4"),
}


# ------------------------------------------------------------------------------------------------- model
def padded_tokenizer(path: str, vocab: int) -> Any:
    """SmolLM2's tokenizer with added tokens up to ``vocab`` ids: every id a Qwen3-sized head samples decodes."""
    tokenizer = trainers.load_tokenizer(path)
    missing = vocab - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<|unused{i}|>" for i in range(missing)], special_tokens=True)
    return tokenizer


def build_model(shape: str, tokenizer_path: str, out: pathlib.Path, device: str,
                seed: int) -> tuple[Any, dict[str, Any]]:
    """A random-init model of ``shape`` in bf16, saved with its tokenizer to ``out`` (what vLLM and TRL load); the
    model (kept, so that the run needs no second load) and what was built."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    vocab = QWEN3_VOCAB if shape != "tiny" else 0
    tokenizer = padded_tokenizer(tokenizer_path, vocab)
    # No pad_token_id in the config: a zero pad embedding row made random inits' gradients non-finite
    # (lib/trainers.random_config).
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         **SHAPES[shape])
    start = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    built = time.perf_counter() - start
    model.save_pretrained(out, max_shard_size="5GB")
    tokenizer.save_pretrained(out)
    model.name_or_path = str(out)  # what TRL's colocated engine loads
    params = sum(p.numel() for p in model.parameters())
    return model, {"shape": shape, "parameters": params, "vocab": len(tokenizer), **SHAPES[shape],
                   "build_s": built, "save_s": time.perf_counter() - start - built, "path": str(out)}






# -------------------------------------------------------------------------------------------------- runs
def recipe_config(args: argparse.Namespace) -> dict[str, Any]:
    """GRPOConfig keyword arguments: the recipe's objective, batch, lengths and decoding, this benchmark's I/O."""
    from trl import GRPOConfig

    values = yaml.safe_load(RECIPE.read_text())
    fields = {f for f in GRPOConfig.__dataclass_fields__}
    dfpo_only = {"group_transform"}
    config = {k: v for k, v in values.items() if k in fields and k not in dfpo_only}
    on_gpu = torch.cuda.is_available()
    config.update(
        output_dir=tempfile.mkdtemp(prefix="users-size-"), save_strategy="no", report_to="none", logging_steps=1,
        disable_tqdm=True, seed=args.seed, max_completion_length=args.completion_length, bf16=on_gpu,
        use_cpu=not on_gpu, lr_scheduler_type="constant", warmup_steps=0,
    )
    if args.vllm:
        config.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory,
                      vllm_max_model_length=args.max_model_length)
    config["max_steps"] = args.rollouts * config["steps_per_generation"] // config["gradient_accumulation_steps"]
    config.update(getattr(args, "config_extra", None) or {})  # a caller's further fields (the cards job's sleep mode)
    return config


def lora_config() -> Any:
    from peft import LoraConfig

    values = yaml.safe_load(RECIPE.read_text())
    return LoraConfig(r=values["lora_r"], lora_alpha=values["lora_alpha"], lora_dropout=values["lora_dropout"],
                      target_modules=values["lora_target_modules"], task_type="CAUSAL_LM")


class Runner:
    """One model, one engine, many short runs."""

    def __init__(self, args: argparse.Namespace, model_path: str, model: Any = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.args, self.model_path = args, model_path
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
        self.model = model.to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.initial = None if args.lora else {k: v.detach().to("cpu", copy=True)
                                               for k, v in self.model.state_dict().items()}
        task, self.rewards = trainers.task_and_rewards("id_parity")
        self.dataset = task.build_dataset("train", 2000, args.seed)
        self.engine: dict[str, Any] = {}

    def share_engine(self) -> None:
        """Every ``vllm.LLM`` TRL builds after the first is the first; the first's allocation is measured."""
        import trl.generation.vllm_generation as generation

        build, engine = generation.LLM, self.engine

        def shared(*a: Any, **kw: Any) -> Any:
            if "llm" not in engine:
                synchronize()
                before, start = torch.cuda.memory_allocated(), time.perf_counter()
                engine["llm"] = build(*a, **kw)
                synchronize()
                engine["allocated_gib"] = (torch.cuda.memory_allocated() - before) / 2**30
                engine["start_s"] = time.perf_counter() - start
            return engine["llm"]

        generation.LLM = shared

    def run(self, method: str) -> dict[str, Any]:
        from dfpo_trl import DFPOConfig, DFPOTrainer
        from trl import GRPOConfig, GRPOTrainer

        fields, batch, _ = METHODS[method]
        config = recipe_config(self.args)
        if batch is not None:
            config["per_device_train_batch_size"] = batch
        if self.initial is not None:
            self.model.load_state_dict(self.initial)
        torch.manual_seed(self.args.seed)  # the same LoRA initialisation in every run
        clock = StepClock()
        kwargs = dict(model=self.model, reward_funcs=self.rewards, train_dataset=self.dataset,
                      processing_class=self.tokenizer, callbacks=[clock],
                      peft_config=lora_config() if self.args.lora else None)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if fields is None:
            trainer = GRPOTrainer(args=GRPOConfig(**config), **kwargs)
        else:
            trainer = DFPOTrainer(args=DFPOConfig(**config, **fields), **kwargs)
        trainer._generate_and_score_completions = clock.timed("rollout_s", trainer._generate_and_score_completions)
        forwarded: list[int] = []
        if getattr(trainer, "pre_pass", None) is not None:
            forward = clock.timed("pre_pass_s", trainer.pre_pass.forward)
            trainer.pre_pass.forward = lambda ids, *rest: (forwarded.append(ids.size(0)), forward(ids, *rest))[1]
        if method.endswith("_per_sample"):
            trainers.keep_per_sample_order(trainer)
        if not self.args.vllm:  # transformers' generate, inside TRL's one-turn generation
            trainer._generate_single_turn = clock.timed("generation_s", trainer._generate_single_turn)
        if self.args.vllm:
            generation = trainer.vllm_generation
            generation.generate = clock.timed("generation_s", generation.generate)
            generation.sync_weights()  # the shared engine holds the last run's weights: load this run's
            generation.sync_weights = clock.timed("weight_sync_s", generation.sync_weights)
        start = time.perf_counter()
        crash, crash_frames = None, []
        try:
            trainer.train()
        except Exception as error:  # a crash is recorded as a crash, and the next run goes on
            crash = f"{type(error).__name__}: {error}"
            crash_frames = [f"{frame.name} ({pathlib.Path(frame.filename).name}:{frame.lineno})"
                            for frame in traceback.extract_tb(error.__traceback__)[-8:]]
        for step in clock.steps:  # the optimizer steps' own time: the step without its rollout
            step["loss_steps_s"] = step["total_s"] - step.get("rollout_s", 0.0)
        record: dict[str, Any] = {
            "method": method, "trainer": type(trainer).__name__, "crash": crash,
            "layout": getattr(trainer, "group_layout", "trl"),
            "per_device_batch": config["per_device_train_batch_size"],
            "steps": clock.steps, "run_s": time.perf_counter() - start,
            "total_s": sum(s["total_s"] for s in clock.steps),
            "loss_steps_s": sum(s["loss_steps_s"] for s in clock.steps),
            "pre_pass_rows": sum(forwarded), "pre_pass_chunks": len(forwarded),
            "crash_frames": crash_frames if crash else None,
        }
        history = trainer.state.log_history
        for key in ("transform/phi_mean", "transform/phi_min", "clip_ratio/region_mean", "reward_std"):
            values = [h[key] for h in history if key in h]
            record[key] = values
        if torch.cuda.is_available():
            record["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            record["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            free, total = torch.cuda.mem_get_info()
            record["device_used_gib_at_end"] = (total - free) / 2**30
        if self.args.lora:
            base = trainer.model.unload()  # the base model without this run's adapter, for the next run
            self.model = base
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return record


# --------------------------------------------------------------------------------------------- summaries
def summarise(rounds: list[dict[str, dict[str, Any]]], methods: list[str]) -> dict[str, Any]:
    """Per method: median over rounds of the ratio to its baseline (total and loss steps), bootstrap intervals."""
    out: dict[str, Any] = {}
    for method in methods:
        base = METHODS[method][2]
        complete = [r for r in rounds if method in r and base in r and not r[method]["crash"] and not r[base]["crash"]]
        entry: dict[str, Any] = {"baseline": base, "rounds": len(complete),
                                 "crashes": sum(1 for r in rounds if method in r and r[method]["crash"])}
        runs = [r[method] for r in complete]
        if runs:
            entry["median_total_s"] = statistics.median(r["total_s"] for r in runs)
            entry["median_loss_steps_s"] = statistics.median(r["loss_steps_s"] for r in runs)
            for part in ("rollout_s", "generation_s", "weight_sync_s"):
                entry[f"median_{part}"] = statistics.median(common.part_seconds(r, part) for r in runs)
            entry["peak_allocated_gib"] = max((r.get("peak_allocated_gib") or 0.0) for r in runs)
            phi = [v for r in runs for v in r["transform/phi_mean"]]
            entry["phi_mean"] = statistics.fmean(phi) if phi else None
            entry["pre_pass_rows_per_run"] = statistics.median(r["pre_pass_rows"] for r in runs)
        if method != base and complete:
            for key in ("total_s", "loss_steps_s"):
                ratios = [r[method][key] / r[base][key] for r in complete]
                entry[f"{key}_ratio"] = {"median": statistics.median(ratios),
                                         "interval_95": stats.bootstrap_median(ratios), "values": ratios}
            # the generation alone: vLLM's ``generate``, or TRL's one-turn generation with transformers
            generated = [(common.part_seconds(r[method], "generation_s"), common.part_seconds(r[base], "generation_s"))
                         for r in complete]
            if all(a > 0 and b > 0 for a, b in generated):  # the same work in both
                ratios = [a / b for a, b in generated]
                entry["generation_s_ratio"] = {"median": statistics.median(ratios),
                                               "interval_95": stats.bootstrap_median(ratios), "values": ratios}
        out[method] = entry
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-1.7b")
    p.add_argument("--model-dir", help="where the random-init model is (built there if absent); "
                                       "default /root/models/random-<shape> or a temp dir on CPU")
    p.add_argument("--tokenizer", default=None, help="default: the GPU kit's SmolLM2, else the embedded one")
    p.add_argument("--lora", action="store_true", help="the recipe's LoRA (r 32 on every linear layer)")
    p.add_argument("--methods", nargs="+", default=["trl", "dfpo_off", "min_replace"])
    p.add_argument("--rounds", type=int, default=100, help="at most this many rounds (--budget-s ends them first)")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no round that would end after this")
    p.add_argument("--rollouts", type=int, default=1, help="rollouts per run (2 optimizer steps each)")
    p.add_argument("--completion-length", type=int, default=768)
    p.add_argument("--max-model-length", type=int, default=2048)
    p.add_argument("--vllm-memory", type=float, default=None,
                   help="vllm_gpu_memory_utilization (default: --vllm-gib of the card's memory, at most 0.45)")
    p.add_argument("--vllm-gib", type=float, default=32.0)
    p.add_argument("--no-vllm", dest="vllm", action="store_false")
    p.add_argument("--cap-gib", type=float, default=None,
                   help="cap PyTorch's allocator at this many GiB (a smaller card on a larger GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.methods == ["all"]:
        args.methods = list(METHODS)
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {list(METHODS)} or 'all'")
    for method in list(args.methods):
        if METHODS[method][2] not in args.methods:
            args.methods.insert(0, METHODS[method][2])
    common.quiet()
    started = time.perf_counter()
    if args.vllm_memory is None and torch.cuda.is_available():
        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        args.vllm_memory = round(min(0.45, args.vllm_gib / total_gib), 3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.cap_gib and device == "cuda":
        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib / total_gib), 0)
    tokenizer = args.tokenizer or trainers.default_tokenizer_path()
    model_dir = pathlib.Path(args.model_dir or (f"/root/models/random-{args.shape}" if device == "cuda"
                                                else tempfile.mkdtemp(prefix="users-size-model-")))
    result: dict[str, Any] = {"card": common.device_name(device), "versions": common.versions(),
                              **provenance.checkout_state(ROOT),
                              "command": "python -m dfpo_bench.cost.users_size " + " ".join(argv or sys.argv[1:]),
                              "shape": args.shape, "lora": args.lora, "methods": args.methods,
                              "cap_gib": args.cap_gib, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                              "config": None, "rounds": []}
    model = None
    if not (model_dir / "config.json").exists():
        model, result["model"] = build_model(args.shape, tokenizer, model_dir, device, args.seed)
    else:
        result["model"] = {"shape": args.shape, "path": str(model_dir), "built": "earlier"}
    runner = Runner(args, str(model_dir), model)
    del model
    result["model"]["parameters"] = sum(p.numel() for p in runner.model.parameters())
    result["config"] = {k: v for k, v in recipe_config(args).items() if k != "output_dir"}
    if args.vllm:
        runner.share_engine()
    rng = random.Random(args.seed)
    out = pathlib.Path(args.out)
    warm = runner.run(args.methods[0])
    result["warm_up"] = warm
    result["engine"] = {k: v for k, v in runner.engine.items() if k != "llm"}
    common.write_json(out, result)
    round_s = warm["run_s"] * len(args.methods) * 1.15
    for index in range(args.rounds):
        if time.perf_counter() - started + round_s > args.budget_s:
            break
        order = list(args.methods)
        rng.shuffle(order)
        begun = time.perf_counter()
        runs: dict[str, Any] = {}
        for method in order:
            runs[method] = runner.run(method)
            result["rounds"] = [*result["rounds"][:index], {"order": order, "runs": runs}]
            common.write_json(out, result)
        round_s = max(round_s, time.perf_counter() - begun)
        print(f"round {index}: " + ", ".join(f"{m} {runs[m]['total_s']:.2f}s" for m in order), flush=True)
    result["summary"] = summarise([r["runs"] for r in result["rounds"]], args.methods)
    result["wall_s"] = time.perf_counter() - started
    common.write_json(out, result)
    print(json.dumps({m: {k: v for k, v in s.items() if not isinstance(v, dict)} | {
        k: [round(v["median"], 4), [round(x, 4) for x in v["interval_95"]]] for k, v in s.items()
        if isinstance(v, dict)} for m, s in result["summary"].items()}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
