"""The 8B LoRA recipe's card rows, as its header states them (``#   24 GB: FLAGS``): every row is the recipe plus
those flags alone, and dfpo-train takes it: the checks before torch, the full parse, one process's whole groups
and group layout, the held-out evaluation's batch and the colocated engine's context. The GPU benchmark
(``benchmarks/dfpo_bench/trained/cards_8b.py``) runs these same rows; its own test holds it to this header."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "qwen3_8b_lora.yaml"


def header_rows() -> dict[int, list[str]]:
    """card GB -> the flags its header line gives (``(none)``: the recipe alone)."""
    rows = {}
    for line in RECIPE.read_text().splitlines():
        if line.startswith("#   ") and " GB: " in line and line[4:].split(" GB: ")[0].isdigit():
            card, rest = line[4:].split(" GB: ", 1)
            stated = rest.split("  (")[0].strip()
            rows[int(card)] = [] if stated == "(none)" else shlex.split(stated)
    return rows


def test_the_header_has_a_row_per_card() -> None:
    assert sorted(header_rows()) == [24, 32, 40, 48, 80]


@pytest.mark.parametrize("card", sorted(header_rows()))
def test_every_row_is_the_recipe_plus_its_flags_and_passes_every_check(card: int, gpu_recipes_parse_here: None) -> None:
    from dfpo_trl.cli.parser import parse_args
    from dfpo_trl.cli.precheck import precheck
    from dfpo_trl.cli.train import size_engine
    from dfpo_trl.cli.vllm_eval import check_eval_batch, default_eval_batch
    from dfpo_trl.config.trl_field_rules import whole_groups_problem
    from dfpo_trl.groups.choice import choose_layout

    flags = header_rows()[card]
    argv = [str(RECIPE), *flags]
    precheck(argv)  # the checks before torch
    script, args, _ = parse_args(argv)  # the full parse: DFPOConfig's, TRL's and transformers' own checks
    names = ("per_device_train_batch_size", "steps_per_generation", "gradient_accumulation_steps",
             "generation_batch_size", "num_generations")
    assert whole_groups_problem({n: getattr(args, n) for n in names}, 1) is None  # one process, one GPU
    whole = args.per_device_train_batch_size % args.num_generations == 0
    assert choose_layout(args, 1) == ("group_granular" if whole else "pre_pass")
    assert args.steps_per_generation > args.gradient_accumulation_steps  # off-policy steps: the transform acts
    given = {flag[2:] for flag in flags if flag.startswith("--")}
    assert given <= {"per_device_train_batch_size", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization"}
    if args.use_vllm:
        assert args.vllm_mode == "colocate" and 0 < args.vllm_gpu_memory_utilization < 1
        default_eval_batch(args, script.eval_size, 1)
        check_eval_batch(args)
        # many problems per call, but no more rows than a training rollout sends (the 40 and 48 GB rows ran out of
        # memory in an evaluation of all 16 problems in one call)
        from dfpo_trl.cli.vllm_eval import rollout_rows

        k = args.num_generations_eval or args.num_generations
        assert args.per_device_eval_batch_size == min(k * script.eval_size, k * (rollout_rows(args) // k))
        assert k < args.per_device_eval_batch_size <= rollout_rows(args)
        assert size_engine(args, script, None, None) == "set"  # the recipe states the engine's context:
        assert args.vllm_max_model_length == script.max_prompt_length + args.max_completion_length
