"""The smallest end-to-end DFPO run: a randomly initialised tiny Llama learns nothing useful, but every piece
(rollout, group-granular micro-batches, Min-Replace, mechanism metrics) runs, offline, in seconds on a CPU.

Needs only the package: the model, tokenizer, data and reward are built here.
"""

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dfpo_trl import DFPOConfig, DFPOTrainer

WORDS = ["<pad>", "<eos>", "<bos>"] + list("0123456789+=") + ["Compute", "Answer:", "is", "the", "so"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS: no download."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.padding_side = "left"  # prompts end where the completions start
    return tokenizer


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with hidden size 32, randomly initialised."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def addition_prompts(n: int, seed: int = 0) -> Dataset:
    pairs = torch.randint(0, 10, (n, 2), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = [f"Compute {a} + {b} =" for a, b in pairs]
    return Dataset.from_dict({"prompt": prompts, "answer": [str(a + b) for a, b in pairs]})


def last_digit_reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1 when the completion contains the answer's last digit: noisy, so groups have signal."""
    return [float(ans[-1] in comp) for comp, ans in zip(completions, answer, strict=True)]


if __name__ == "__main__":
    config = DFPOConfig(
        output_dir="outputs/tiny", use_cpu=True, bf16=False, seed=0, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, learning_rate=1e-2, max_completion_length=6, temperature=1.5,
        # GSPO's sequence-level ratio and clip range, plus DFPO Min-Replace; 4 steps per rollout: off-policy
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        group_transform="min_replace", num_generations=4, per_device_train_batch_size=4, steps_per_generation=4,
        max_steps=8,
    )  # fmt: skip
    trainer = DFPOTrainer(
        model=tiny_model(), reward_funcs=last_digit_reward, args=config, train_dataset=addition_prompts(32),
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.train()
    for row in trainer.state.log_history:
        if "transform/phi_min" in row:
            print(
                f"step {row['step']}: phi_min={row['transform/phi_min']:.4f} asym {row['asym/before']:.4f} -> "
                f"{row['asym/after']:.4f} orth_residual={row['transform/orth_residual']:.1e}"
            )
