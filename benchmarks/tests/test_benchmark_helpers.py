"""Pieces of ``benchmarks/`` whose mistakes would silently change what a GPU run measures: the recipe a smoke run
derives from a shipped recipe, and the random-init configs of the overhead benchmark."""

from __future__ import annotations

from pathlib import Path

import yaml
from dfpo_trl.cli import parse_recipe

ROOT = Path(__file__).resolve().parents[2]

from dfpo_bench.launch import recipe_smoke  # noqa: E402


def test_smoke_recipe_keeps_the_objective_batch_and_lora(tmp_path: Path, gpu_recipes_parse_here: None) -> None:
    source = ROOT / "recipes" / "qwen3_8b_lora.yaml"
    out = tmp_path / "smoke.yaml"
    recipe_smoke.main([str(source), "--model", "/models/tiny", "--max-steps", "3", "--output-dir", str(tmp_path / "o"),
                       "--out", str(out)])
    original = yaml.safe_load(source.read_text())
    derived = yaml.safe_load(out.read_text())
    assert not set(recipe_smoke.DATASET_KEYS) & set(derived)
    script_args, args, model_args = parse_recipe([str(out)])
    assert (model_args.model_name_or_path, script_args.task, args.max_steps) == ("/models/tiny", "arithmetic", 3)
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


def test_the_launcher_starts_no_run_its_arm_says_the_deadline_would_cut(tmp_path: Path, monkeypatch) -> None:
    """On a virtual clock, one run at a time: an anchor run lasts 50 s, a stale run 20 s, deadline 115 s. After the
    anchor (0-50 s) and a stale run (51-71 s), the next anchor is expected to last 50 s, so it would end at about
    122 s and must not start (the median of the ended runs, 35 s, would have started it and had it cut)."""
    import argparse
    import types

    from dfpo_bench.lib import common

    clock = types.SimpleNamespace(now=0.0)
    fake_time = types.SimpleNamespace(time=lambda: clock.now, sleep=lambda s: setattr(clock, "now", clock.now + s))
    lasts = {"anchor": 50.0, "gspo": 20.0}
    intervals: list[tuple[str, float, float]] = []

    class Process:
        def __init__(self, run: common.Run) -> None:
            self.run, self.end = run, clock.now + lasts[run.method]

        def poll(self) -> int | None:
            return 0 if clock.now >= self.end else None

    def start(run: common.Run, args: argparse.Namespace, index: int) -> None:
        run.attempts, run.started, run.process = run.attempts + 1, clock.now, Process(run)

    def finish(run: common.Run, args: argparse.Namespace, code: int) -> dict:
        intervals.append((run.name, run.started, clock.now))
        return {"complete": True, "wall_s": clock.now - run.started, "steps": 1}

    monkeypatch.setattr(common, "time", fake_time)
    monkeypatch.setattr(common, "start", start)
    monkeypatch.setattr(common, "finish", finish)
    monkeypatch.setattr(common, "card", lambda: "virtual")
    monkeypatch.setattr(common, "installed_versions", lambda: {})
    args = argparse.Namespace(parallel=1, gpus=None, deadline_s=115.0, expected_run_s=30.0, skip_done=[],
                              out_dir=str(tmp_path), start_timeout=0.0)
    queue = [common.Run("t", m, s, []) for s, m in ((0, "anchor"), (0, "gspo"), (1, "anchor"), (1, "gspo"))]
    common.launch(args, queue)
    assert [name for name, _, _ in intervals] == ["t__anchor__s0", "t__gspo__s0"]
    assert all(end <= args.deadline_s for _, _, end in intervals)
