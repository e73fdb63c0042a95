"""``dfpo-train``'s value checks that need no model (dfpo_trl/cli/values.py): answered before torch, transformers
and TRL are imported, one line each, naming the field and where it was set (the flag, or the recipe's file and
line), the same words as the full parse; and paths the file system cannot take, refused without a traceback."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from dfpo_trl.cli.args import RecipeError
from dfpo_trl.cli.parser import parse_args
from dfpo_trl.cli.precheck import precheck, stored_field_table
from dfpo_trl.cli.values import whole_groups_problem

ROOT = Path(__file__).resolve().parents[2]
MAIN_RECIPE = ROOT / "recipes" / "smollm2_cpu.yaml"
HEAVY = ("torch", "transformers", "trl", "datasets", "accelerate")
RECIPE = "use_cpu: true\nmax_steps: 4\nnum_generations: 4\nper_device_train_batch_size: 4\n"


def _line(recipe: Path, field: str) -> int:
    return next(i for i, line in enumerate(recipe.read_text().splitlines(), 1) if line.startswith(f"{field}:"))


def _value_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Commands refused for a value (no model needed), each with a pattern its one line must match: the field,
    where it was set, and the fix. All of them are also refused by the full parse, in the same words."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'out'}\n")
    seq = tmp_path / "seq.yaml"
    seq.write_text(RECIPE + "importance_sampling_level: sequence\ngroup_transform: min_replace\n")
    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n")
    (tmp_path / "list.yaml").write_text("- use_cpu\n- max_steps\n")
    listed = tmp_path / "listed.yaml"
    listed.write_text(RECIPE + "learning_rate: [1.0e-5, 2.0e-5]\n")
    r = str(recipe)
    return {
        "negative epsilon": ([r, "--epsilon", "-0.1"], r"--epsilon on the command line: epsilon=-0.1 is out of range"),
        "one generation": ([r, "--num_generations", "1"],
                           r"--num_generations on the command line: num_generations=1 must be an integer >= 2"),
        "min_replace with token-level sampling": (
            [str(seq), "--importance_sampling_level", "token"],
            rf"group_transform in {re.escape(str(seq))}, line {_line(seq, 'group_transform')} and "
            r"--importance_sampling_level on the command line: group_transform='min_replace' .*Set "
            r"importance_sampling_level='sequence'",
        ),
        "empty recipe": ([str(tmp_path / "empty.yaml")], r"recipe '.*empty.yaml' is empty .*'field: value'"),
        "recipe that is a list": ([str(tmp_path / "list.yaml")], r"is a YAML list, not a mapping of fields"),
        "negative learning rate": ([r, "--learning_rate", "-3e-5"],
                                   r"--learning_rate on the command line: learning_rate=-3e-05 must be > 0"),
        "a list for a number": (
            [str(listed)],
            rf"learning_rate in {re.escape(str(listed))}, line {_line(listed, 'learning_rate')}: learning_rate is a "
            r"list \(\[1e-05, 2e-05\]\); learning_rate takes a number",
        ),
        "NaN epsilon": ([r, "--epsilon", "nan"],
                        r"--epsilon on the command line: epsilon=nan is NaN, not a finite number; GSPO and DFPO use "
                        r"3e-4"),
        "NaN learning rate": ([r, "--learning_rate", "nan"],
                              r"--learning_rate on the command line: learning_rate=nan is NaN, not a finite number; "
                              r"e\.g\. 2e-6"),
        "infinite temperature": ([r, "--temperature", "inf"],
                                 r"--temperature on the command line: temperature=inf is infinite, not a finite "
                                 r"number; use 1\.0"),
        "unknown group_transform": (
            [r, "--group_transform", "min_replase"],
            r"invalid value\(s\): --group_transform on the command line: group_transform='min_replase' is not a "
            r"DFPO transform; use one of 'none', 'min_replace', .*register the transform first",
        ),
        "text for a number": ([r, "--learning_rate", "fast"],
                              r"--learning_rate on the command line: invalid float value: 'fast'; .*takes a number"),
        "rollout without whole groups": (
            [r, "--per_device_train_batch_size", "5"],
            rf"--per_device_train_batch_size on the command line and num_generations in {re.escape(r)}, line "
            rf"{_line(recipe, 'num_generations')}: .* = 5 completions does not hold whole groups of num_generations 4.*"
            r"set per_device_train_batch_size to a multiple of 4 \(e.g. 4 or 8\), or num_generations to a divisor",
        ),
        "output_dir folder name over NAME_MAX": ([r, "--output_dir", str(tmp_path / ("a" * 300))],
                                                 r"--output_dir on the command line: output_dir .* is too long: a "
                                                 r"folder name in it has 300 bytes.*give a shorter path"),
        "output_dir over PATH_MAX": ([r, "--output_dir", str(tmp_path / "/".join(["b" * 200] * 23))],
                                     r"--output_dir on the command line: output_dir .* is too long: it has \d+ "
                                     r"bytes, over the file system's limit"),
    }


def _fast_only_cases(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, tuple[list[str], str]]:
    """Refused before torch too, though the full parse leaves them to the run (task) or imports them (plugins)."""
    (tmp_path / "dfpo_plugin_that_raises.py").write_text("raise RuntimeError('the plugin broke')\n")
    request.addfinalizer(lambda: sys.modules.pop("dfpo_plugin_that_raises", None))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    plugged = tmp_path / "plugged.yaml"
    plugged.write_text(RECIPE + "plugins: [dfpo_plugin_that_raises]\n")
    data = tmp_path / "mathdata"
    data.mkdir()
    (data / "train.jsonl").write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (saved / "train" / "dataset_info.json").write_text('{"features": {"q": {}, "answer": {}}}')
    math_recipe = tmp_path / "math.yaml"
    math_recipe.write_text(RECIPE + f"task: math\ndataset: {data}\n")
    return {
        "reward function module missing": (
            [str(recipe), "--reward_funcs", "arithmetic_correct", "no_such_module:f"],
            r"--reward_funcs on the command line: cannot import 'no_such_module' for 'no_such_module:f': No module "
            r"named 'no_such_module'$"),
        "task module missing": (
            [str(recipe), "--task", "no_such_pkg.tasks:make"],
            r"--task on the command line: cannot import 'no_such_pkg.tasks' for 'no_such_pkg.tasks:make': No module "
            r"named 'no_such_pkg'$"),
        "dataset folder without the problem column": (
            [str(math_recipe)],
            r"problem_column \(its default\): math task: column 'problem' not found; available columns: "
            r"\['question', 'answer'\]; set problem_column \(CLI: --problem_column\) to the dataset's column$"),
        "saved dataset without the set problem column": (
            [str(recipe), "--task", "math", "--dataset", str(saved), "--problem_column", "question"],
            r"--problem_column on the command line: math task: column 'question' not found; available columns: "
            r"\['q', 'answer'\]; set problem_column \(CLI: --problem_column\)"),
        "unknown task": ([str(recipe), "--task", "arithmetc"],
                         r"--task on the command line: unknown task 'arithmetc'; known tasks: .*Did you mean "
                         r"'arithmetic'\?"),
        "plugin that raises": ([str(plugged)],
                               rf"plugins in {re.escape(str(plugged))}, line 5: importing 'dfpo_plugin_that_raises' "
                               r"failed at dfpo_plugin_that_raises.py:1: RuntimeError: the plugin broke"),
    }


pytestmark = pytest.mark.skipif(stored_field_table() is None, reason="the stored field table is for other versions")


def test_value_refusals_name_the_field_and_where_it_was_set(tmp_path: Path) -> None:
    for name, (argv, pattern) in _value_cases(tmp_path).items():
        with pytest.raises(RecipeError) as fast:
            precheck(argv)
        assert re.search(pattern, str(fast.value)), (name, str(fast.value))
        assert "\n" not in str(fast.value)


def test_the_full_parse_says_the_same(tmp_path: Path) -> None:
    """parse_args (the path under other library versions, and for callers of the parser) refuses each the same."""
    for name, (argv, _) in _value_cases(tmp_path).items():
        with pytest.raises(RecipeError) as fast:
            precheck(argv)
        with pytest.raises(RecipeError) as full:
            parse_args(argv)
        assert str(full.value) == str(fast.value), name


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_value_refusals_come_before_torch(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """In a fresh interpreter, through main(): exit 2, one `dfpo-train: error:` line each, and torch,
    transformers, TRL, datasets and accelerate never imported; the user's output_dir untouched."""
    cases = {**_value_cases(tmp_path), **_fast_only_cases(tmp_path, request)}
    out = tmp_path / "out"
    out.mkdir()
    (out / "dfpo_summary.json").write_text('{"steps": 3}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from dfpo_trl.cli.main import main
        results = {{}}
        for name, argv in json.loads(sys.argv[1]).items():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            results[name] = [code, err.getvalue()]
        results["imported"] = sorted(m for m in {HEAVY!r} if m in sys.modules)
        print(json.dumps(results))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps({k: v[0] for k, v in cases.items()})],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    assert results.pop("imported") == []
    for name, (code, err) in results.items():
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("dfpo-train: error: "), (name, err)
        assert re.search(cases[name][1], lines[0]), (name, lines[0])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_negative_numbers_are_values(tmp_path: Path) -> None:
    """argparse reads `-3e-5` as an option ("expected one argument"); every number is a value here."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    _, args, _ = parse_args([str(recipe), "--weight_decay", "-1e-4", "--max_steps", "-1", "--adam_beta1", "-.5"])
    assert (args.weight_decay, args.max_steps, args.adam_beta1) == (-1e-4, -1, -0.5)
    with pytest.raises(RecipeError, match=r"learning_rate=-3e-05 must be > 0"):
        parse_args([str(recipe), "--learning_rate", "-3e-5"])


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_whole_groups_fix_is_a_fix(processes: int) -> None:
    """Every per_device_train_batch_size and num_generations the message suggests makes the rollout hold whole
    groups, and it says nothing when the rollout already does (TRL's rule, computed as TRL computes it)."""
    for batch in range(1, 13):
        for steps in range(1, 6):
            for generations in range(2, 10):
                values = {"per_device_train_batch_size": batch, "steps_per_generation": steps,
                          "gradient_accumulation_steps": 1, "generation_batch_size": None,
                          "num_generations": generations}  # fmt: skip
                problem = whole_groups_problem(values, processes)
                rollout = batch * processes * steps
                assert (problem is None) == (rollout % generations == 0)
                if problem is None:
                    continue
                fixes = re.search(r"multiple of (\d+) \(e\.g\. ([\d or]+)\)", problem)
                multiple = int(fixes.group(1))
                assert multiple == generations // math.gcd(generations, processes * steps)
                for b in map(int, fixes.group(2).split(" or ")):
                    assert b >= 1 and (b * processes * steps) % generations == 0
                divisors = re.search(r"divisor of (\d+) \(e\.g\. ([\d or]+)\)", problem)
                if divisors:
                    assert all(rollout % int(g) == 0 and int(g) >= 2 for g in divisors.group(2).split(" or "))


def test_learning_rate_example_is_the_main_jobs(tmp_path: Path) -> None:
    """The refusal's example learning rate is the one the CPU main job's recipe sets."""
    recipe_lr = float(yaml.safe_load(MAIN_RECIPE.read_text())["learning_rate"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    with pytest.raises(RecipeError) as refused:
        precheck([str(recipe), "--learning_rate", "0"])
    example = re.search(r"e\.g\. ([\d.e+-]+) as recipes/smollm2_cpu\.yaml", str(refused.value))
    assert example and float(example.group(1)) == recipe_lr


def test_rules_left_to_the_full_parse_name_where_their_fields_were_set(tmp_path: Path) -> None:
    """DFPO's own fields' rules and the rules between fields the value checks leave out run in the full parse
    only; their refusals are headed by where each field they name was set (recipe line or flag), in the order they
    name them. An unknown group_transform is the value checks' (the built-in names are in the stored table)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE + "importance_sampling_level: sequence\ngroup_transform: no_such_transform\n")
    with pytest.raises(RecipeError) as refused:
        parse_args([str(recipe), "--transform_scale", "0"])
    assert str(refused.value).startswith(
        f"invalid value(s): group_transform in {recipe}, line {_line(recipe, 'group_transform')}: "
        "group_transform='no_such_transform' is not a DFPO transform; use one of 'none', 'min_replace'"
    )
    recipe.write_text(RECIPE + "importance_sampling_level: sequence\n")
    with pytest.raises(RecipeError) as refused:
        parse_args([str(recipe), "--transform_scale", "0"])
    assert str(refused.value).startswith("--transform_scale on the command line: invalid value(s): transform_scale=0.0")
    recipe.write_text(RECIPE + "importance_sampling_level: sequence\ngroup_transform: min_replace\n"
                      "off_policy_mask_threshold: 0.5\n")
    with pytest.raises(RecipeError) as refused:
        parse_args([str(recipe)])
    assert str(refused.value).startswith(
        f"group_transform in {recipe}, line {_line(recipe, 'group_transform')} and off_policy_mask_threshold in "
        f"{recipe}, line {_line(recipe, 'off_policy_mask_threshold')}: group_transform='min_replace' with "
        "cancellation_target='weights' cannot be combined with off_policy_mask_threshold=0.5"
    )


def test_refusals_only_the_data_shows_name_where_the_field_was_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task, reward and drift refusals of the run's set-up (after the parse, before the model) say where the
    field was set, as the parse's refusals do."""
    import dfpo_trl.cli.train as app_train
    from dfpo_trl.cli.main import main

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(app_train, "resolve_model", no_model)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'out'}\ndrift_every: 2\n")
    cases = {
        "--reward_funcs on the command line: unknown reward function 'no_such_reward'": ["--reward_funcs",
                                                                                         "no_such_reward"],
        "--task on the command line: task 'os:getcwd' gave a str": ["--task", "os:getcwd"],
        f"drift_every in {recipe}, line {_line(recipe, 'drift_every')}: drift_every=2 needs a task": [],
        "--dataset on the command line: dataset='gsm8k' is set but task='arithmetic'": ["--dataset", "gsm8k"],
    }
    for head, flags in cases.items():
        assert main([str(recipe), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"dfpo-train: error: {head}") and "\n" not in err, err


def test_processes_come_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """WORLD_SIZE (accelerate launch, torchrun) counts the processes; a launcher that starts several without it
    (Slurm, MPI) leaves the whole-groups rule to TRL rather than judging it for one process."""
    from dfpo_trl.cli.values import launched_processes

    for name in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launched_processes() == 1
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert launched_processes() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_processes() == 4


def test_help_after_a_recipe_shows_the_recipes_value(capsys: pytest.CaptureFixture[str]) -> None:
    """`dfpo-train RECIPE --help` showed "--seed (default: 42)" beside a recipe that sets 0: the recipe's value is
    shown beside the default, and without a recipe only the default."""
    from dfpo_trl.cli.main import main

    for argv in ([str(MAIN_RECIPE), "--help"], ["--config", str(MAIN_RECIPE), "-h"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert f"  --seed (default: 42; {MAIN_RECIPE} sets 0)\n" in out
        assert f"  --max_steps (default: -1; {MAIN_RECIPE} sets 12)\n" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "  --seed (default: 42)\n" in capsys.readouterr().out
