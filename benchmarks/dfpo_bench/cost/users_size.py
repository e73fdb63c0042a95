"""The runner of ``trained/cards_8b.py``: one model and one vLLM engine per process, many short runs of one method
from the same initial weights at the users' size (Qwen3-8B's architecture, random init, built on the GPU and saved for
vLLM on first use). The users'-size study that it ran first (every method against TRL's GRPOTrainer in interleaved
rounds) is archived with its records: docs/source/research.md, "The users' size".

A random-init model answers nothing right, so the reward is ``id_parity`` (1 when the completion's token ids sum
to an odd number): every group gets both advantage signs and the transforms act. The tokenizer is SmolLM2's (the
only one on the GPU machine) with added tokens up to Qwen3's vocabulary of 151,936, so the embedding and LM head
have Qwen3's real size and every sampled id decodes. The batch, lengths, LoRA and clip settings are
``recipes/qwen3_8b_lora.yaml``'s (per-device batch 8 = G, 4 micro-batches per optimizer step, 8 per rollout: two
optimizer steps per rollout, the second off-policy; completions of up to 768 tokens; gradient checkpointing; bf16);
the prompts are the arithmetic task's (about 40 tokens, shorter than GSM8K's).

ONE model and ONE vLLM engine per process (TRL's ``vllm.LLM`` returns the first engine for every later trainer; each
run pushes its own initial weights into it before training). Per optimizer step (CUDA synchronised): its wall time,
the time in TRL's ``_generate_and_score_completions`` (the rollout), in vLLM's ``generate`` and in the weight sync;
the loss steps are the rest. Peak memory is torch's ``max_memory_allocated`` over the run (the engine's weights and
KV cache included: vLLM allocates through torch in this process) and the engine's own allocation measured when it
was built.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import tempfile
import time
import traceback
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]

import torch  # noqa: E402

from dfpo_bench.lib import trainers  # noqa: E402
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
