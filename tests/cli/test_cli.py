"""``dfpo-train``: recipes parse into DFPOConfig, the paper recipe's values, accelerate configs, clear errors, and a
tiny end-to-end run through the CLI (summary + PNG) on a model built in the test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny import write_tiny_recipe

from dfpo_trl import DFPOConfig
from dfpo_trl.cli.args import DFPOScriptArguments, RecipeError
from dfpo_trl.cli.main import main
from dfpo_trl.cli.model import ModelUnavailableError, resolve_model
from dfpo_trl.cli.parser import parse_args
from dfpo_trl.cli.precheck import stored_field_table

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
ACCELERATE = ROOT / "recipes" / "accelerate"



def write_recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


# ------------------------------------------------------------------------------------------------ recipes


def test_recipes_exist() -> None:
    names = {p.name for p in RECIPES}
    assert {"qwen3_32b.yaml", "qwen3_next_80b_a3b.yaml", "qwen3_8b_lora.yaml", "smollm2_cpu.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses_into_dfpo_config(recipe: Path, gpu_recipes_parse_here: None) -> None:
    script_args, training_args, model_args = parse_args([str(recipe)])
    assert isinstance(training_args, DFPOConfig) and isinstance(script_args, DFPOScriptArguments)
    head = recipe.read_text().splitlines()[:12]
    assert any(("dfpo-train" in line or "dfpo_trl" in line) for line in head), "recipe must state its launch command"
    if training_args.group_transform != "none":  # the transform must act: off-policy
        assert training_args.steps_per_generation > training_args.gradient_accumulation_steps


def test_qwen3_32b_carries_appendix_i_and_j(gpu_recipes_parse_here: None) -> None:
    script_args, args, model_args = parse_args([str(ROOT / "recipes" / "qwen3_32b.yaml")])
    assert model_args.model_name_or_path == "Qwen/Qwen3-32B"
    assert args.learning_rate == pytest.approx(8e-7)
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "cosine_with_min_lr"
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.2}
    assert args.warmup_steps == pytest.approx(0.03)  # a ratio in transformers 5
    assert args.beta == 0.0 and args.entropy_coef == 0.0
    assert args.num_generations == 32
    assert args.group_transform == "min_replace" and args.importance_sampling_level == "sequence"
    assert args.use_vllm and args.vllm_mode == "server"
    assert args.bf16 and args.gradient_checkpointing
    assert getattr(args, "activation_checkpointing", True)  # the field transformers >= 5.24 reads (5.17 has none)
    assert script_args.max_prompt_length + args.max_completion_length == 32768 == args.vllm_max_model_length
    assert (args.temperature, args.top_p, args.top_k, args.min_p) == (0.6, 0.95, 20, 0.0)
    # mini-batch 32 prompts x 32 rollouts per optimizer step on 32 processes; off-policy steps in every rollout
    assert args.per_device_train_batch_size * 32 * args.gradient_accumulation_steps == 32 * 32
    assert args.steps_per_generation > args.gradient_accumulation_steps
    assert args.steps_per_generation % args.gradient_accumulation_steps == 0  # the pre-pass layout's requirement


def test_qwen3_next_context_and_decoding(gpu_recipes_parse_here: None) -> None:
    script_args, args, _ = parse_args([str(ROOT / "recipes" / "qwen3_next_80b_a3b.yaml")])
    assert script_args.max_prompt_length + args.max_completion_length == 262144 == args.vllm_max_model_length
    assert (args.temperature, args.top_p, args.top_k, args.min_p) == (0.7, 0.8, 20, 0.0)
    assert args.learning_rate == pytest.approx(8e-7) and args.num_generations == 32


def test_lora_recipe_builds_a_peft_config(gpu_recipes_parse_here: None) -> None:
    pytest.importorskip("peft")
    from trl import get_peft_config

    _, args, model_args = parse_args([str(ROOT / "recipes" / "qwen3_8b_lora.yaml")])
    peft_config = get_peft_config(model_args)
    assert peft_config is not None and peft_config.r == 32 and "q_proj" in peft_config.target_modules
    assert args.per_device_train_batch_size % args.num_generations == 0  # group-granular, free layout


PAPER_RECIPES = [ROOT / "recipes" / n for n in ("qwen3_32b.yaml", "qwen3_next_80b_a3b.yaml", "qwen3_8b_lora.yaml")]
# The commented-out fields the paper recipes show for tracking and the hub (report_to is chosen per backend).
TRACKING_AND_HUB = ("project", "run_name", "push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo")


def uncommented(recipe: Path, backend: str) -> str:
    """The recipe with its tracking and hub examples uncommented, reporting to ``backend`` instead of none."""
    lines = []
    for line in recipe.read_text().splitlines():
        key, _, value = line.removeprefix("# ").partition(":")
        if line == "report_to: none":
            continue
        if line.startswith("# ") and (key in TRACKING_AND_HUB or (key == "report_to" and
                                                                  value.split("#")[0].strip() == backend)):
            line = line.removeprefix("# ")
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("backend", ["trackio", "wandb", "tensorboard"])
@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=lambda p: p.name)
def test_paper_recipes_tracking_and_hub_examples_parse(
    recipe: Path, backend: str, tmp_path: Path, gpu_recipes_parse_here: None
) -> None:
    """Each paper recipe shows report_to (trackio, wandb, tensorboard) and push_to_hub/hub_model_id commented out,
    as TRL users write them; uncommented, they parse into DFPOConfig (as shipped: no reporting, no push)."""
    _, shipped, _ = parse_args([str(recipe)])
    assert shipped.report_to == [] and not shipped.push_to_hub
    path = tmp_path / recipe.name
    text = uncommented(recipe, backend)
    assert text.count("\nreport_to:") == 1 and "\npush_to_hub: true" in text
    path.write_text(text)
    _, args, _ = parse_args([str(path)])
    assert args.report_to == [backend]
    assert args.push_to_hub and args.hub_model_id.startswith("your-username/") and args.hub_model_id.endswith("-DFPO")
    assert str(getattr(args.hub_strategy, "value", args.hub_strategy)) == "every_save" and args.hub_private_repo
    assert args.project.startswith("dfpo-") and args.run_name


@pytest.mark.parametrize(("value", "expected"), [("none", []), ("tensorboard", ["tensorboard"]),
                                                 ("[tensorboard]", ["tensorboard"]),
                                                 ("[trackio, wandb]", ["trackio", "wandb"])])
def test_report_to_in_a_recipe(value: str, expected: list[str], tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, f"""\
        output_dir: {tmp_path / "out"}
        use_cpu: true
        report_to: {value}
        push_to_hub: true
        hub_model_id: someone/tiny-DFPO
        """)
    _, args, _ = parse_args([recipe])
    assert args.report_to == expected and args.push_to_hub and args.hub_model_id == "someone/tiny-DFPO"
    _, args, _ = parse_args([recipe, "--report_to", "none", "--push_to_hub", "false"])  # a flag beats the recipe
    assert args.report_to == [] and not args.push_to_hub


def test_cpu_recipe_is_the_embedded_default() -> None:
    script_args, args, model_args = parse_args([str(ROOT / "recipes" / "smollm2_cpu.yaml")])
    assert model_args.model_name_or_path is None and script_args.task == "arithmetic"
    assert args.use_cpu and not args.bf16 and script_args.eval_size >= 50
    assert args.learning_rate == pytest.approx(2e-6) and args.num_generations == 8 and args.max_steps == 12
    assert script_args.eval_every == 2  # the held-out curve over the run
    assert args.temperature == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("name", "processes", "machines"),
    [("zero3_2gpu.yaml", 2, 1), ("zero3_4gpu.yaml", 4, 1), ("zero3_8gpu.yaml", 8, 1), ("zero3_4x8.yaml", 32, 4),
     ("zero3_2x2_rank0.yaml", 4, 2), ("zero3_2x2_rank1.yaml", 4, 2), ("fsdp2_2gpu.yaml", 2, 1)],
)
def test_accelerate_configs_load(name: str, processes: int, machines: int) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ACCELERATE / name))
    assert (config.num_processes, config.num_machines) == (processes, machines)
    if name.startswith("fsdp2"):
        assert str(getattr(config.distributed_type, "value", config.distributed_type)) == "FSDP"
        assert config.mixed_precision == "bf16"
        return
    assert str(getattr(config.distributed_type, "value", config.distributed_type)) == "DEEPSPEED"
    assert int(config.deepspeed_config["zero_stage"]) == 3


def test_fsdp2_config_launches_fully_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `accelerate launch --config_file recipes/accelerate/fsdp2_2gpu.yaml` hands each process: the
    environment accelerate's launcher derives from the file, and the FSDP plugin an Accelerator builds from it
    (as Trainer's does when TrainingArguments set no fsdp): FSDP2, full shard, one unit per transformer block, bf16."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.fsdp import CPUOffloadPolicy

    argv = ["--config_file", str(ACCELERATE / "fsdp2_2gpu.yaml"), "-m", "dfpo_trl", "recipe.yaml"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    assert args.use_fsdp and args.num_processes == 2 and args.module and args.training_script == "dfpo_trl"
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert not plugin.activation_checkpointing and not isinstance(plugin.cpu_offload, CPUOffloadPolicy)


# ------------------------------------------------------------------------------------------------ parser


def test_help_lists_dfpo_fields(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "--group_transform" in text and "In-group transform of the post-clip sequence weights" in text
    assert "--symmetric_clip" in text and "--delta_lambda_min" in text and "--task" in text
    assert "model_name_or_path" in text and "--help-all" in text
    assert "--lr_scheduler_kwargs" not in text  # TRL's full list is behind --help-all
    assert len(out.splitlines()) < 200
    # The first screen leads with what most runs set, before the math: each with its default and help.
    first_screen = "\n".join(out.splitlines()[:40])
    for name in ("model_name_or_path", "task", "output_dir", "max_steps", "learning_rate"):
        assert f"  --{name}" in first_screen and out.index(f"  --{name}") < out.index("--group_transform"), name
    assert "--learning_rate (default: 1e-06)\n      The initial learning rate for AdamW." in out
    assert "dfpo-train refuses 0 and values below -1; -1 trains num_train_epochs epochs." in text
    assert "Unset: the embedded SmolLM2-135M-Instruct" in text


def _help_text(capsys: pytest.CaptureFixture[str], flag: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([flag])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _dataclass_default(cls: type, name: str) -> object:
    import dataclasses

    spec = next(f for f in dataclasses.fields(cls) if f.name == name)
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def test_short_help_shows_every_default_the_dataclasses_have(capsys: pytest.CaptureFixture[str]) -> None:
    """Every `--field (default: X)` of `dfpo-train --help` is the dataclass's default; a field shown without one
    defaults to None. The bool fields that default to True (save_model, plot, transform_stop_gradient,
    log_mechanism_metrics) were shown as False: the short help read their `--no_*` twin's default."""
    import re

    from trl import ModelConfig

    from dfpo_trl.cli.help import LEADING_FIELDS
    from dfpo_trl.cli.tasks import TASKS
    from dfpo_trl.config.fields import dfpo_fields

    out = _help_text(capsys, "--help")
    entries = re.findall(r"^  --(\w+)(?: \(default: (.*?)[;)].*)?$", out, flags=re.MULTILINE)
    shown = dict(entries)
    assert len(entries) == len(shown)  # each field once
    owner = {name: DFPOConfig for name in (*(f.name for f in dfpo_fields()), *LEADING_FIELDS)}
    owner.update({name: DFPOScriptArguments for name in DFPOScriptArguments.__dataclass_fields__})
    owner["model_name_or_path"] = ModelConfig
    assert set(shown) == set(owner)
    for name, text in shown.items():
        default = _dataclass_default(owner[name], name)
        assert text == ("" if default is None else repr(default)), name
    for name in ("save_model", "plot", "transform_stop_gradient", "log_mechanism_metrics"):
        assert shown[name] == "True" and f"--no_{name} turns it off" in out
    # The leading fields, then DFPO's, then the other script arguments.
    assert out.index("--task") < out.index("--group_transform") < out.index("--delta_random") < out.index("--plot")
    task_help = " ".join(out[out.index("  --task") : out.index("  --dataset")].split())
    assert all(f"'{name}'" in task_help for name in TASKS)  # sum_sentence was missing


def test_help_all_shows_the_default_each_flag_leaves(capsys: pytest.CaptureFixture[str]) -> None:
    """`--help-all` (argparse's own help, transformers' `ArgumentDefaultsHelpFormatter`): every "(default: X)" is
    the value the field gets when the flag is absent, `--no_*` twins included (they said False for fields that
    default to True)."""
    import re

    from dfpo_trl.cli.parser import make_parser

    parser = make_parser()
    absent = vars(parser.parse_args([]))
    out = _help_text(capsys, "--help-all")
    blocks = re.split(r"\n(?=  -)", out[out.index("options:") :])
    checked = 0
    for block in blocks:
        flag = re.match(r"\s*(--[\w-]+)", block)
        text = " ".join(block.split())
        default = re.search(r".*\(default: (.*)\)$", text)
        if flag is None or default is None:
            continue
        action = parser._option_string_actions[flag.group(1)]
        value, shown = absent[action.dest], default.group(1)
        # argparse converts a string default with the flag's type only when it is used ("no" -> False)
        as_parsed = action.type(shown) if isinstance(action.default, str) and action.type else shown
        assert shown == str(value) or as_parsed == value, (flag.group(1), shown, value)
        checked += 1
    assert checked > 200
    for name in ("save_model", "plot", "transform_stop_gradient", "log_mechanism_metrics"):
        assert absent[name] is True
        assert f"Set {name} to False" in " ".join(out.split())


def test_help_all_lists_every_trl_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["recipes/smollm2_cpu.yaml", "--help-all"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--lr_scheduler_kwargs" in text and "--group_transform" in text and "--model_name_or_path" in text


def test_unknown_recipe_key_names_the_nearest_field(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "group_transfrom: min_replace\nuse_cpu: true\n")
    with pytest.raises(RecipeError, match=r"'group_transfrom'.*did you mean 'group_transform'"):
        parse_args([recipe])


def test_renamed_key_says_where_it_went(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "warmup_ratio: 0.03\nuse_cpu: true\n")
    with pytest.raises(RecipeError, match=r"recipe '.*recipe.yaml' sets .*'warmup_ratio' \(line 1\): use warmup_steps"):
        parse_args([recipe])


def test_unknown_flag_names_the_nearest_field(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "use_cpu: true\n")
    with pytest.raises(RecipeError, match=r"'learning_rat'.*did you mean 'learning_rate'"):
        parse_args([recipe, "--learning_rat", "1e-5"])


def test_main_reports_recipe_errors_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write_recipe(tmp_path, "num_generaitons: 4\nuse_cpu: true\n")
    assert main([recipe]) == 2
    assert "did you mean 'num_generations'" in capsys.readouterr().err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dfpo-train: error: "), err
    return lines[0]


def test_recipe_that_is_not_yaml_is_one_line_with_its_position(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_model(monkeypatch)
    recipe = write_recipe(tmp_path, "use_cpu: true\nlearning_rate: 3.0e-5\ninstruction: Answer: a number\n")
    assert main([recipe]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"recipe {recipe!r} is not valid YAML at line 3, column 20" in line
    assert "'instruction: Answer: a number'" in line and "quote a value that holds ': '" in line
    recipe = write_recipe(tmp_path, "use_cpu: true\nmax_steps 4\nseed: 0\n")
    assert main([recipe]) == 2
    assert "at line 2, column 1 ('max_steps 4')" in _one_error_line(capsys.readouterr().err)


def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading a model fail the test: the errors under test must come first."""
    import dfpo_trl.cli.train as app_train

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(app_train, "resolve_model", no_model)


def test_bad_value_names_flag_or_recipe_line_and_what_the_field_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value of the wrong type, on the command line or in the recipe (where YAML had already typed `2.5` as a
    float, which argparse never checked: an int field took it and train() failed minutes later)."""
    _no_model(monkeypatch)
    recipe = write_recipe(tmp_path, "use_cpu: true\nlearning_rate: 3.0e-5\n")
    assert main([recipe, "--learning_rate", "abc"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == (
        "dfpo-train: error: --learning_rate on the command line: invalid float value: 'abc'; learning_rate takes a "
        "number, e.g. 1e-06 (its default)."
    )
    recipe = write_recipe(tmp_path, "use_cpu: true\nmax_steps: 2.5\n")
    assert main([recipe]) == 2
    assert f"max_steps in {recipe}, line 2: invalid int value: '2.5'; max_steps takes an integer" in _one_error_line(
        capsys.readouterr().err
    )
    assert main([recipe, "--max_steps", "2", "--save_model", "maybe"]) == 2
    assert "--save_model on the command line" in _one_error_line(capsys.readouterr().err)
    # typed YAML scalars that fit their field still parse as before
    recipe = write_recipe(tmp_path, "use_cpu: true\nmax_steps: 3\nlearning_rate: 1\nskip_eval: true\nbeta: 0\n")
    script_args, args, _ = parse_args([recipe])
    assert (args.max_steps, args.learning_rate, args.beta, script_args.skip_eval) == (3, 1.0, 0.0, True)
    assert isinstance(args.learning_rate, float) and isinstance(args.max_steps, int)


def test_output_dir_that_is_a_file_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_model(monkeypatch)
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a directory")
    recipe = write_recipe(tmp_path, f"use_cpu: true\noutput_dir: {a_file}\n")
    assert main([recipe]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"output_dir in {recipe}, line 2: output_dir {str(a_file)!r} is an existing file" in line
    assert "name a directory" in line
    assert main([recipe, "--output_dir", str(a_file / "run1")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--output_dir on the command line: output_dir {str(a_file / 'run1')!r} cannot be created" in line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_output_dir_that_cannot_be_created_is_one_line_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/forbidden_dir: /proc is a directory whose permission bits (and root) say writable, yet nothing can be
    created in it; the model loaded and transformers failed with a traceback. The check creates a scratch folder."""
    _no_model(monkeypatch)
    recipe = write_recipe(tmp_path, "use_cpu: true\n")
    assert main([recipe, "--output_dir", "/proc/forbidden_dir"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--output_dir on the command line: output_dir '/proc/forbidden_dir' cannot be created" in line
    assert "in '/proc'" in line and "name a directory you can write" in line
    before = sorted(tmp_path.iterdir())  # a directory that can be created passes, and the probe leaves nothing
    _, args, _ = parse_args([recipe, "--output_dir", str(tmp_path / "new" / "run")])
    assert args.output_dir == str(tmp_path / "new" / "run") and sorted(tmp_path.iterdir()) == before


def _checkpoint(path: Path, weights: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_resume_from_checkpoint_is_checked_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that is not a checkpoint is one line saying what a checkpoint folder holds (the model loaded first,
    then transformers raised "Can't find a valid checkpoint"); `true` is the latest checkpoint-N/ in output_dir,
    as Trainer.train(resume_from_checkpoint=True) picks it, and refused when there is none."""
    _no_model(monkeypatch)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path, f"use_cpu: true\noutput_dir: {out}\nresume_from_checkpoint: true\n")
    assert main([recipe]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"resume_from_checkpoint in {recipe}, line 3: resume_from_checkpoint true resumes from the latest" in line
    assert "there is none" in line and "holding trainer_state.json and the model's weights" in line
    for path, problem in [(tmp_path / "nope", "no such directory"),
                          (_checkpoint(tmp_path / "no_weights", weights=False), "no model weights in it"),
                          (Path(recipe), "a file, not a directory")]:
        assert main([recipe, "--resume_from_checkpoint", str(path)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"--resume_from_checkpoint on the command line: resume_from_checkpoint {str(path)!r} is not a " \
               f"checkpoint ({problem}" in line
        assert "checkpoint-N/ folder" in line and "or true for the latest" in line
    (tmp_path / "state_only").mkdir()
    (tmp_path / "state_only" / "model.safetensors").write_bytes(b"w")
    assert main([recipe, "--resume_from_checkpoint", str(tmp_path / "state_only")]) == 2
    assert "(no trainer_state.json in it)" in _one_error_line(capsys.readouterr().err)
    for step in (2, 10, 9):
        _checkpoint(out / f"checkpoint-{step}")
    (out / "checkpoint-11").write_text("a file, not a checkpoint")
    _, args, _ = parse_args([recipe])
    assert args.resume_from_checkpoint == str(out / "checkpoint-10")
    _, args, _ = parse_args([recipe, "--resume_from_checkpoint", str(out / "checkpoint-2")])
    assert args.resume_from_checkpoint == str(out / "checkpoint-2")
    _, args, _ = parse_args([recipe, "--resume_from_checkpoint", "false"])
    assert args.resume_from_checkpoint is None


def test_half_written_checkpoint_is_refused_and_true_takes_the_whole_one_before_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each process of a multi-process run writes its own rng_state_<p>.pth and dfpo_rollout_state_<p>.pt into a
    checkpoint without waiting for the others: a process killed during the save leaves its files out while the
    others complete theirs (trainer_state.json included), and resumed, the processes waited on each other until
    ddp_timeout (tests/cli/test_killed_rank.py). Such a folder is refused naming the missing files, and `true` takes
    the latest whole checkpoint; a folder without trainer_state.json (the main process killed first) too."""
    _no_model(monkeypatch)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path, f"use_cpu: true\noutput_dir: {out}\nresume_from_checkpoint: true\n")
    for step in (3, 6, 9):
        folder = _checkpoint(out / f"checkpoint-{step}")
        for process in (0, 1):
            (folder / f"rng_state_{process}.pth").write_bytes(b"r")
            (folder / f"dfpo_rollout_state_{process}.pt").write_bytes(b"s")
    (out / "checkpoint-6" / "dfpo_rollout_state_1.pt").unlink()  # process 1 killed between its two files
    for name in ("rng_state_1.pth", "dfpo_rollout_state_1.pt"):  # process 1 killed before its files
        (out / "checkpoint-9" / name).unlink()
    (out / "checkpoint-12").mkdir()  # the main process killed first: only process 1's files
    (out / "checkpoint-12" / "rng_state_1.pth").write_bytes(b"r")
    _, args, _ = parse_args([recipe])
    assert args.resume_from_checkpoint == str(out / "checkpoint-3")
    for step, missing in ((9, "rng_state_1.pth, dfpo_rollout_state_1.pt"), (6, "dfpo_rollout_state_1.pt")):
        assert main([recipe, "--resume_from_checkpoint", str(out / f"checkpoint-{step}")]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"is not a checkpoint (half-written: {missing} missing, the files of a process stopped while the " \
               "checkpoint was saved; resume from the checkpoint before it)" in line
    single = _checkpoint(tmp_path / "single" / "checkpoint-4")  # one process: rng_state.pth, its rollout file
    (single / "rng_state.pth").write_bytes(b"r")
    (single / "dfpo_rollout_state_0.pt").write_bytes(b"s")
    _, args, _ = parse_args([recipe, "--resume_from_checkpoint", str(single)])
    assert args.resume_from_checkpoint == str(single)


def test_task_factory_that_gives_no_task_names_what_it_gave(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--task os:getcwd` loaded the model, called the function and failed on `.reward_funcs` of a str, 16 lines
    later; now one line, before the model is looked at."""
    _no_model(monkeypatch)
    assert main([*write_tiny_recipe(tmp_path, output_dir=tmp_path / "out"), "--task", "os:getcwd"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"task 'os:getcwd' gave a str ({os.getcwd()!r}), not a task: it lacks name, reward_funcs, " in line
    assert "build_dataset(split, n, seed) method" in line


def test_max_steps_0_is_refused_with_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers reads max_steps <= 0 as "train num_train_epochs epochs": 0 trained a whole run, and -5 started a
    3000-step run of 3 epochs. Both are refused; -1 (transformers' default) still means epochs."""
    _no_model(monkeypatch)
    recipe = write_recipe(tmp_path, f"use_cpu: true\noutput_dir: {tmp_path / 'out'}\nmax_steps: 0\n")
    assert main([recipe]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"max_steps in {recipe}, line 3: max_steps 0 would not stop at 0 steps" in line
    assert "Set max_steps to the optimizer steps to train (>= 1), or -1 to train num_train_epochs epochs" in line
    assert main([recipe, "--max_steps", "0"]) == 2
    assert "--max_steps on the command line: max_steps 0" in _one_error_line(capsys.readouterr().err)
    for value in ("-5", "-2"):
        assert main([recipe, "--max_steps", value]) == 2
        assert _one_error_line(capsys.readouterr().err) == (
            f"dfpo-train: error: --max_steps on the command line: max_steps {value} would not stop at {value} steps: "
            "transformers reads max_steps <= 0 as 'train num_train_epochs epochs'. Set max_steps to the optimizer "
            "steps to train (>= 1), or -1 to train num_train_epochs epochs over the training prompts."
        )
    _, args, _ = parse_args([recipe, "--max_steps", "-1", "--num_train_epochs", "2"])
    assert (args.max_steps, args.num_train_epochs) == (-1, 2)


def test_start_line_says_how_many_steps_the_epochs_make(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """max_steps -1 trains num_train_epochs epochs: the line that opens training says how many optimizer steps that
    is (4 prompts x G = 4 are 16 rows, 4 per optimizer step: 4 steps per epoch, 2 epochs), then what comes first."""
    import logging

    argv = [*write_tiny_recipe(tmp_path, tiny_model_dir, tmp_path / "out", plot=False, train_size=4, eval_size=2),
            "--max_steps", "-1", "--num_train_epochs", "2"]
    with caplog.at_level(logging.INFO, logger="dfpo_trl"):
        assert main(argv) == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training ")]
    assert said == ["training 8 optimizer steps (max_steps -1: num_train_epochs 2 over 4 training prompts); first "
                    "the held-out greedy accuracy before training on 2 problems"]
    assert json.loads((tmp_path / "out" / "dfpo_summary.json").read_text())["steps"] == 8


def test_command_line_beats_recipe(tmp_path: Path) -> None:
    recipe = write_recipe(
        tmp_path,
        """
        use_cpu: true
        learning_rate: 3.0e-5
        group_transform: min_replace
        importance_sampling_level: sequence
        eval_size: 7
        """,
    )
    script_args, args, _ = parse_args([recipe, "--learning_rate", "1e-4", "--group_transform", "none"])
    assert args.learning_rate == pytest.approx(1e-4) and args.group_transform == "none"
    assert script_args.eval_size == 7
    # --config works as in TRL's own scripts
    _, args, _ = parse_args(["--config", recipe])
    assert args.learning_rate == pytest.approx(3e-5) and args.group_transform == "min_replace"


def test_invalid_dfpo_value_is_a_recipe_error(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "use_cpu: true\ngroup_transform: min_replace\nimportance_sampling_level: token\n")
    with pytest.raises(RecipeError, match="importance_sampling_level='sequence'"):
        parse_args([recipe])


def test_missing_recipe_file() -> None:
    with pytest.raises(RecipeError, match="not found"):
        parse_args(["no/such/recipe.yaml"])
    with pytest.raises(RecipeError, match="no recipe given"):
        parse_args([])


# ------------------------------------------------------------------------------------------------ model, data


def test_offline_hub_id_says_use_local_path_or_embedded(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dfpo_trl",
            str(ROOT / "recipes" / "smollm2_cpu.yaml"),
            "--model_name_or_path",
            "no-such-org/no-such-model-dfpo",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no-such-org/no-such-model-dfpo" in proc.stderr
    assert "no network access" in proc.stderr
    assert "local path" in proc.stderr and "omit model_name_or_path" in proc.stderr


def test_local_path_that_is_not_a_directory(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model path written as a local path (absolute, ./, ../, ~) that is not there is refused, not taken for a
    hub id (the command line does it before torch: tests/cli/test_cli_fast.py); ~ is expanded for a folder."""
    from trl import ModelConfig

    with pytest.raises(ModelUnavailableError, match="'.*missing' does not exist; give a transformers checkpoint"):
        resolve_model(ModelConfig(model_name_or_path=str(tmp_path / "missing")))
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ModelUnavailableError, match="is a file, not a checkpoint directory or a .gguf file"):
        resolve_model(ModelConfig(model_name_or_path=str(tmp_path / "weights.bin")))
    monkeypatch.setenv("HOME", str(tiny_model_dir.parent))
    shown = f"~/{tiny_model_dir.name}"
    assert resolve_model(ModelConfig(model_name_or_path=shown)) == (str(tiny_model_dir), shown)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + word-level tokenizer with a chat template, saved like a real checkpoint."""
    from tiny import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_model"))


def _math_dir(tmp_path: Path) -> Path:
    data = tmp_path / "mathdata"
    data.mkdir()
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return data


def test_missing_dataset_column_names_it_and_the_flag(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before torch from the dataset's own files, and by the run after loading it, in the same line: where
    the field was set, the columns there are, and the flag as it is spelt."""
    from dfpo_trl.cli.data import build_datasets, build_task
    from dfpo_trl.cli.train import command_line_origin

    recipe = write_recipe(tmp_path, f"use_cpu: true\ntask: math\ndataset: {_math_dir(tmp_path)}\n")
    argv = [recipe, "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "out")]
    code = main(argv)
    err = capsys.readouterr().err
    said = ("problem_column (its default): math task: column 'problem' not found; available columns: ['question', "
            "'answer']; set problem_column (CLI: --problem_column) to the dataset's column")
    assert code == 2 and err.splitlines()[-1] == f"dfpo-train: error: {said}"
    if stored_field_table() is not None:  # refused from the dataset's files before loading it: nothing else printed
        assert err == f"dfpo-train: error: {said}\n"
    script_args, training_args, _ = parse_args(argv)
    task = build_task(script_args, command_line_origin(argv))
    with pytest.raises(RecipeError) as refused:
        build_datasets(script_args, task, training_args.seed, command_line_origin(argv))
    assert str(refused.value) == said


def test_max_prompt_length_drops_long_prompts(tiny_model_dir: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer

    from dfpo_trl.cli.data import filter_long_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [[{"role": "user", "content": " ".join(["1"] * n)}] for n in (2, 4, 8)]
    kept = filter_long_prompts(Dataset.from_dict({"prompt": prompts}), tokenizer, 5, None)
    assert [len(p[0]["content"].split()) for p in kept["prompt"]] == [2, 4]
    with pytest.raises(RecipeError, match="drops every training prompt"):
        filter_long_prompts(Dataset.from_dict({"prompt": prompts}), tokenizer, 1, None)


def test_dataset_with_non_math_task_is_refused(tmp_path: Path) -> None:
    from dfpo_trl.cli.data import build_task

    with pytest.raises(RecipeError, match="task: math"):
        build_task(DFPOScriptArguments(task="arithmetic", dataset="gsm8k"))


def test_unknown_task_and_reward_suggest_names() -> None:
    from dfpo_trl.cli.data import build_rewards, build_task

    with pytest.raises(RecipeError, match="Did you mean 'arithmetic'"):
        build_task(DFPOScriptArguments(task="arithmetik"))
    task = build_task(DFPOScriptArguments())
    with pytest.raises(RecipeError, match="Did you mean 'accuracy_reward'"):
        build_rewards(DFPOScriptArguments(reward_funcs=["acuracy_reward"]), task)


def test_tiny_end_to_end_writes_summary_and_plot(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main(write_tiny_recipe(tmp_path, tiny_model_dir, out)) == 0
    summary = json.loads((out / "dfpo_summary.json").read_text())
    assert summary["steps"] == 2 and summary["method"] == "DFPO min_replace"
    assert summary["heldout"]["n"] == 4
    assert 0.0 <= summary["heldout"]["before"] <= 1.0 and 0.0 <= summary["heldout"]["after"] <= 1.0
    assert summary["reward_threshold"] == 0.6
    # The reward curve has one point per optimizer step; the summary reports its EMA, not first/last rollout.
    assert summary["reward_curve"] == "step_reward" and "reward_first" not in summary
    assert summary["reward_ema_peak"] >= max(summary["reward_ema_first"], summary["reward_ema_last"])
    split = summary["time_split"]
    parts = ("model_conversion", "setup", "eval_before", "training", "eval_after", "save_and_plot")
    assert all(split[k] >= 0 for k in parts) and split["eval_before"] == summary["heldout"]["before_seconds"]
    assert sum(split[k] for k in parts) == pytest.approx(split["total"], abs=0.5)
    # one training time (time_split["training"]); the seed, the versions and when it ran
    assert "train_seconds" not in summary and "total_seconds" not in summary
    import datetime as dt

    import torch
    import trl

    assert summary["seed"] == 0 and summary["signal"] is None
    assert summary["versions"]["torch"] == torch.__version__ and summary["versions"]["trl"] == trl.__version__
    assert set(summary["versions"]) >= {"python", "dfpo_trl", "transformers", "accelerate", "datasets", "peft"}
    started, finished = (dt.datetime.strptime(summary[k], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
                         for k in ("started_utc", "finished_utc"))
    assert (finished - started).total_seconds() == pytest.approx(split["total"], abs=1.5)
    assert abs((dt.datetime.now(dt.UTC) - finished).total_seconds()) < 120
    png = out / "dfpo_metrics.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "held-out greedy accuracy" in printed and "DFPO run summary" in printed
    assert "eval before" in printed and "training reward, EMA 0.3" in printed


def test_callbacks_given_in_python_see_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``dfpo_train(argv, callbacks=[...])``: each callback gets the trainer's events after the run's own callbacks,
    a checkpoint's ``on_save`` once the checkpoint folder (DFPO's rollout state included) is complete."""
    from transformers import TrainerCallback, TrainerState

    out = tmp_path / "out"

    class Seen(TrainerCallback):
        def __init__(self) -> None:
            self.events: list[tuple[str, int, bool]] = []

        def on_save(self, args: object, state: TrainerState, control: object, **kwargs: object) -> None:
            folder = out / f"checkpoint-{state.global_step}"
            self.events.append(("save", state.global_step, (folder / "dfpo_rollout_state_0.pt").is_file()))

        def on_train_end(self, args: object, state: TrainerState, control: object, **kwargs: object) -> None:
            self.events.append(("end", state.global_step, True))

    seen = Seen()
    argv = write_tiny_recipe(tmp_path, tiny_model_dir, out, skip_eval=True, save_model=False)
    assert main([*argv, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"], callbacks=[seen]) == 0
    assert seen.events == [("save", 1, True), ("save", 2, True), ("end", 2, True)]


def test_ctrl_c_stops_with_one_line_a_partial_summary_and_no_stale_results(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A completed run saves its model; the next run is interrupted (KeyboardInterrupt, as Ctrl-C raises it) when
    its third step begins. It exits 130 with one line, its summary says interrupted after 2 of 4 steps with the
    reward curve so far and a fresh figure, and the earlier run's summary and model are in previous_run/, not
    beside it. With real signals at other points, and reruns: tests/cli/test_cli_reruns.py."""
    pytest.importorskip("matplotlib")
    import dfpo_trl.cli.train as app_train
    from dfpo_trl.cli.callbacks import CurveMetricsCallback

    out = tmp_path / "out"
    argv = write_tiny_recipe(tmp_path, tiny_model_dir, out, eval_size=2)
    assert main([*argv, "--max_steps", "1", "--save_model", "true"]) == 0
    first = json.loads((out / "dfpo_summary.json").read_text())
    assert first["interrupted"] is False and first["steps"] == 1
    assert {"model.safetensors", "config.json", "dfpo_metrics.png", "dfpo_summary.json"} <= set(first["files"])
    capsys.readouterr()

    class CtrlCAtStep3(CurveMetricsCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(app_train, "CurveMetricsCallback", CtrlCAtStep3)
    code = main([*argv, "--max_steps", "4", "--disable_tqdm", "false"])
    captured = capsys.readouterr()
    assert code == 130
    assert "Traceback" not in captured.err and "DFPO run summary" not in captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines[-1] == (f"dfpo-train: interrupted at step 2 of 4; partial results in {out} (the earlier run's moved "
                         f"to {out / 'previous_run'}/)")
    summary = json.loads((out / "dfpo_summary.json").read_text())
    assert summary["interrupted"] is True and (summary["steps"], summary["max_steps"]) == (2, 4)
    assert summary["signal"] == "SIGINT"
    assert summary["reward_curve"] == "step_reward" and summary["reward_ema_last"] is not None
    assert summary["heldout"]["before"] is not None and summary["heldout"]["after"] is None
    assert summary["files"] == ["dfpo_metrics.png", "dfpo_summary.json"]
    assert (out / "dfpo_metrics.png").stat().st_mtime >= (out / "dfpo_summary.json").stat().st_mtime - 60
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    previous = out / "previous_run"
    assert json.loads((previous / "dfpo_summary.json").read_text())["steps"] == 1
    assert (previous / "model.safetensors").is_file() and (previous / "dfpo_metrics.png").is_file()


def test_sigterm_stops_like_ctrl_c_with_exit_code_143(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGTERM (how schedulers stop a job; it killed the run with nothing written) sent to this process when
    the third step begins: one line, a partial summary marked with the signal, exit code 128 + 15; the handler
    that was there before is back afterwards."""
    import signal

    import dfpo_trl.cli.train as app_train
    from dfpo_trl.cli.callbacks import CurveMetricsCallback

    class SigtermAtStep3(CurveMetricsCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(app_train, "CurveMetricsCallback", SigtermAtStep3)
    out = tmp_path / "out"
    code = main([*write_tiny_recipe(tmp_path, tiny_model_dir, out, eval_size=2), "--max_steps", "4"])
    captured = capsys.readouterr()
    assert code == 143 and signal.getsignal(signal.SIGTERM) is before
    assert "Traceback" not in captured.err and "DFPO run summary" not in captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines[-1] == f"dfpo-train: stopped by SIGTERM at step 2 of 4; partial results in {out}"
    summary = json.loads((out / "dfpo_summary.json").read_text())
    assert (summary["interrupted"], summary["signal"], summary["steps"]) == (True, "SIGTERM", 2)
    assert summary["reward_ema_last"] is not None and summary["heldout"]["after"] is None


def test_sigterm_outside_training_exits_143(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while the model loads: `dfpo-train: stopped by SIGTERM`, exit 143, no traceback."""
    import signal

    import dfpo_trl.cli.train as app_train

    def loading(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(app_train, "resolve_model", loading)
    assert main(write_tiny_recipe(tmp_path, output_dir=tmp_path / "out")) == 143
    assert capsys.readouterr().err.strip() == "dfpo-train: stopped by SIGTERM"


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


REFUSALS = {
    "unknown task": ["--task", "nosuchtask"],
    "unknown reward": ["--reward_funcs", "no_such_reward"],
    "drift without forms": ["--drift_every", "2"],
    "unknown field": ["--no_such_field", "1"],
    "factory gives no task": ["--task", "os:getcwd"],
    "not a checkpoint": ["--resume_from_checkpoint", "/no/such/checkpoint"],
    "no checkpoint to resume": ["--resume_from_checkpoint", "true"],
    "max_steps 0": ["--max_steps", "0"],
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refusal_leaves_output_dir_as_it_was(
    refusal: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An earlier run's results (and the run before it, in previous_run/) stay where they are, byte for byte, when
    the next command is refused (they once moved to previous_run/ before the task was checked). Runs that start and
    then end before their first step: tests/cli/test_cli_reruns.py."""
    out = tmp_path / "out"
    (out / "previous_run").mkdir(parents=True)
    (out / "previous_run" / "dfpo_summary.json").write_text(json.dumps({"steps": 1, "files": ["dfpo_summary.json"]}))
    files = ["dfpo_summary.json", "dfpo_metrics.png", "model.safetensors", "config.json"]
    (out / "dfpo_summary.json").write_text(json.dumps({"steps": 16, "files": files}))
    for name in files[1:]:
        (out / name).write_bytes(name.encode())
    before = _tree(out)
    _no_model(monkeypatch)  # every refusal comes before the model is looked at
    argv = [*write_tiny_recipe(tmp_path, output_dir=out), *REFUSALS[refusal]]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err)
    assert _tree(out) == before


def test_layout_and_its_cost_are_said_at_start_up(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """3 rows per process and G = 4: groups straddle micro-steps on one process, so the trainer takes the pre-pass;
    the CLI says so in one line with its cost (3 of every 4 steps re-forward the groups their 3 rows touch, laid out
    in consecutive rows: 8, 8 and 4 rows, 6.67 on average: +74%)."""
    import logging

    argv = [*write_tiny_recipe(tmp_path, tiny_model_dir, tmp_path / "out", skip_eval=True, plot=False),
            "--per_device_train_batch_size", "3", "--steps_per_generation", "4", "--max_steps", "1"]
    with caplog.at_level(logging.INFO, logger="dfpo_trl"):
        assert main(argv) == 0
    layout = [r.getMessage() for r in caplog.records if "group layout" in r.getMessage()]
    assert layout == [
        "DFPO group layout: pre_pass (per_device_train_batch_size 3 is not a multiple of num_generations 4): 3 of "
        "every 4 optimizer steps add a no-grad forward over 6.67 rows per process (3 trained), about +74% of their "
        "compute (docs/source/concepts/layouts.md, the pre-pass and its cost); a per_device_train_batch_size that is a "
        "multiple of 4 "
        "makes the layout free (group_granular)"
    ]


def test_every_layout_has_a_start_up_line() -> None:
    from dfpo_trl.groups.choice import (
        LAYOUT_CROSS_PROCESS,
        LAYOUT_GROUP_GRANULAR,
        LAYOUT_PER_SAMPLE,
        LAYOUT_PRE_PASS,
        LAYOUT_REDISTRIBUTED,
        describe_layout,
    )  # fmt: skip

    args = DFPOConfig(output_dir="unused", use_cpu=True, num_generations=4, per_device_train_batch_size=1,
                      steps_per_generation=8, gradient_accumulation_steps=2)  # fmt: skip
    lines = {
        layout: describe_layout(layout, args, processes=4)
        for layout in (LAYOUT_GROUP_GRANULAR, LAYOUT_CROSS_PROCESS, LAYOUT_REDISTRIBUTED, LAYOUT_PRE_PASS,
                       LAYOUT_PER_SAMPLE)
    }  # fmt: skip
    for layout, line in lines.items():
        assert line.startswith(f"DFPO group layout: {layout} (") and "\n" not in line
    # b = 1, A = 2, S = 8: 3 of 4 steps re-forward the one group (G = 4 rows) their 2 rows belong to: +67%
    assert "3 of every 4 optimizer steps" in lines[LAYOUT_PRE_PASS] and "over 4 rows" in lines[LAYOUT_PRE_PASS]
    assert "+67%" in lines[LAYOUT_PRE_PASS] and "all-gather" in lines[LAYOUT_PRE_PASS]
    assert "no extra forward" in lines[LAYOUT_REDISTRIBUTED] and "no extra cost" in lines[LAYOUT_GROUP_GRANULAR]


def test_failing_reward_names_function_and_completion(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line (exit 1): the user's frame, the exception, the completion, its group and the training row, and that
    row is one the function fails on (an even first operand). The output_dir the run created (nested two deep) is
    not left behind empty; its parent, which was there, stays."""
    from dfpo_trl.cli.tasks import get_task

    (tmp_path / "my_rewards.py").write_text(
        "def boom(prompts, completions, a, **kwargs):\n"
        "    return [1.0 / (x % 2) for x in a]  # fails on completions of prompts with an even first operand\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(write_tiny_recipe(tmp_path, tiny_model_dir, tmp_path / "out" / "run", reward_funcs=["my_rewards:boom"],
                                  skip_eval=True, plot=False))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and tmp_path.is_dir()
    said = re.fullmatch(
        r"dfpo-train: error: reward function 'boom' at .*my_rewards\.py:2: raised ZeroDivisionError: float division by "
        r"zero on completion (\d+) of the rollout's 8 \(group (\d+), its completion (\d+) of 4; training row (\d+)\); "
        r"fix the function or drop it from reward_funcs", err.strip().splitlines()[-1])
    assert said, err
    completion, group, within, row = map(int, said.groups())
    assert (group, within) == divmod(completion, 4)
    train = get_task("arithmetic").build_dataset("train", 16, 0)
    assert train[row]["a"] % 2 == 0


def _cli_process(rank: int, port: int, argv: list[str], out_dir: str) -> None:
    """One rank of `accelerate launch dfpo-train ...`, as the launcher's environment variables describe it."""
    import gc

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    code = main(argv)
    ddp_alive = any(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"code": code, "pg_alive": dist.is_initialized(), "ddp_alive": ddp_alive})
    )


@pytest.mark.distributed
def test_two_process_run_finishes_and_tears_down_the_process_group(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Both ranks finish with 0, the trainer's DDP model and the process group both gone before `main` returns.

    `run` ends the group so that torch joins gloo's threads with the GIL released; left to the DDP reducer or to
    interpreter exit, a rank could deadlock or abort after a run that succeeded.
    """
    from tiny import free_port, spawn_ranks

    out = tmp_path / "out"
    argv = write_tiny_recipe(tmp_path, tiny_model_dir, out, skip_eval=True, plot=False)
    spawn_ranks(_cli_process, (free_port(), argv, str(tmp_path)), nprocs=2)
    for rank in range(2):
        ended = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert ended == {"code": 0, "pg_alive": False, "ddp_alive": False}
    summary = json.loads((out / "dfpo_summary.json").read_text())
    assert summary["steps"] == 2


def test_unreachable_hub_fails_in_seconds_without_retries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    from huggingface_hub import constants
    from trl import ModelConfig

    from dfpo_trl.cli.model import hub_reachable

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://127.0.0.1:9")  # nothing listens on the discard port
    assert not hub_reachable(timeout=1.0)
    start = time.monotonic()
    with pytest.raises(ModelUnavailableError, match=r"no network access.*local path.*omit model_name_or_path"):
        resolve_model(ModelConfig(model_name_or_path="no-such-org/no-such-model-dfpo"))
    assert time.monotonic() - start < 10


def test_example_stands_on_the_package_alone(tmp_path: Path) -> None:
    example = ROOT / "examples" / "tiny_train.py"
    assert "tests" not in example.read_text().split('"""', 2)[2]  # no sys.path trick towards tests/
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the package only (as an installed dfpo_trl would be)
    proc = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("phi_min=") >= 6  # the off-policy steps of two rollouts


@pytest.mark.parametrize("has_activation_checkpointing", [True, False])
def test_gradient_checkpointing_flag_parses_on_either_transformers(has_activation_checkpointing: bool) -> None:
    """The field's metadata under both transformers generations: with a True default (transformers < 5.24) TRL's
    parser adds ``--no_gradient_checkpointing`` from the metadata, which must not carry ``nargs`` (start-up
    failed on transformers 5.17); with a None default ``--gradient_checkpointing`` alone must still mean True."""
    import dataclasses

    from trl import TrlParser

    from dfpo_trl.config.fields import gradient_checkpointing_metadata

    @dataclasses.dataclass
    class Args:
        gradient_checkpointing: bool | None = dataclasses.field(
            default=None if has_activation_checkpointing else True,
            metadata=gradient_checkpointing_metadata(has_activation_checkpointing),
        )

    parser = TrlParser(Args)
    default = None if has_activation_checkpointing else True
    assert parser.parse_args([]).gradient_checkpointing is default
    assert parser.parse_args(["--gradient_checkpointing"]).gradient_checkpointing is True
    assert parser.parse_args(["--gradient_checkpointing", "false"]).gradient_checkpointing is False
    if not has_activation_checkpointing:
        assert parser.parse_args(["--no_gradient_checkpointing"]).gradient_checkpointing is False
