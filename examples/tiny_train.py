"""The smallest end-to-end DFPO run: a randomly initialised tiny Llama learns nothing useful, but every piece
(rollout, group-granular micro-batches, Min-Replace, mechanism metrics) runs, offline, in seconds on a CPU."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer  # noqa: E402

from dfpo_trl import DFPOConfig, DFPOTrainer  # noqa: E402

config = DFPOConfig(
    **base_args(
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        group_transform="min_replace", steps_per_generation=4, max_steps=8, temperature=1.5,
        output_dir="outputs/tiny",
    )
)
trainer = DFPOTrainer(
    model=tiny_model(), reward_funcs=last_digit_reward, args=config, train_dataset=addition_dataset(32),
    processing_class=tiny_tokenizer(),
)
trainer.train()
for row in trainer.state.log_history:
    if "transform/phi_min" in row:
        print(f"step {row['step']}: phi_min={row['transform/phi_min']:.4f} asym {row['asym/before']:.4f} -> "
              f"{row['asym/after']:.4f} orth_residual={row['transform/orth_residual']:.1e}")
