"""Pieces of ``benchmarks/`` whose mistakes would silently change what a GPU run measures: the recipe a smoke run
derives from a shipped recipe, and the random-init configs of the overhead benchmark."""

from __future__ import annotations

from pathlib import Path

import yaml
from dfpo_trl.cli import parse_recipe

from dfpo_bench.launch import recipe_smoke

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_recipe_keeps_the_objective_batch_and_lora(tmp_path: Path, gpu_recipes_parse_here: None) -> None:
    source = ROOT / "recipes" / "qwen3_8b_lora.yaml"
    out = tmp_path / "smoke.yaml"
    model = tmp_path / "tiny"
    model.mkdir()  # dfpo-train refuses a local model path that does not exist
    recipe_smoke.main([str(source), "--model", str(model), "--max-steps", "3", "--output-dir", str(tmp_path / "o"),
                       "--out", str(out)])
    original = yaml.safe_load(source.read_text())
    derived = yaml.safe_load(out.read_text())
    assert not set(recipe_smoke.DATASET_KEYS) & set(derived)
    script_args, args, model_args = parse_recipe([str(out)])
    assert (model_args.model_name_or_path, script_args.task, args.max_steps) == (str(model), "arithmetic", 3)
    kept = ("group_transform", "importance_sampling_level", "loss_type", "epsilon", "epsilon_high", "num_generations",
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "use_peft", "lora_r",
            "lora_alpha", "lora_target_modules", "learning_rate", "bf16")
    assert {k: derived[k] for k in kept} == {k: original[k] for k in kept}
    assert args.save_strategy == "no" and args.max_completion_length == 128


def test_random_configs_leave_no_zero_pad_embedding() -> None:
    """A ``pad_token_id`` in the config zeroes that embedding row at init (nn.Embedding padding_idx), which gave
    1.7B-sized random inits non-finite gradients on the GPU; the benchmark configs must not set it."""
    from transformers import AutoModelForCausalLM

    from dfpo_bench.lib import trainers

    class Tokenizer:
        pad_token_id, eos_token_id, bos_token_id = 2, 1, 0

        def __len__(self) -> int:
            return 64

    for name in trainers.RANDOM_CONFIGS:
        config = trainers.random_config(name, Tokenizer())
        assert config.pad_token_id is None, name
    model = AutoModelForCausalLM.from_config(trainers.random_config("tiny", Tokenizer()))
    assert float(model.get_input_embeddings().weight.detach()[Tokenizer.pad_token_id].abs().sum()) > 0
