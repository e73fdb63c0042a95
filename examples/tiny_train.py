"""The smallest end-to-end DFPO run: a randomly initialised tiny Llama learns nothing useful, but every piece
(rollout, group-granular micro-batches, Min-Replace, mechanism metrics) runs, offline, in seconds on a CPU.

Needs only the package: the model, tokenizer, data and reward come from ``dfpo_trl.testing`` (built in the process,
no download).
"""

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.testing import addition_dataset, last_digit_reward, tiny_model, tiny_tokenizer

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
        model=tiny_model(), reward_funcs=last_digit_reward, args=config, train_dataset=addition_dataset(32),
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.train()
    for row in trainer.state.log_history:
        if "transform/phi_min" in row:
            print(
                f"step {row['step']}: phi_min={row['transform/phi_min']:.4f} asym {row['asym/before']:.4f} -> "
                f"{row['asym/after']:.4f} orth_residual={row['transform/orth_residual']:.1e}"
            )
