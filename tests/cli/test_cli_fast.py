"""``dfpo-train``'s fast path: ``--help`` and the errors of the recipe, the field names and the paths come before
torch, transformers and TRL are imported (10-25 s on a loaded 2-core machine; docs/source/guides/cli.md has the
numbers), from a stored field table that must equal what the installed TRL and transformers give."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dfpo_trl.cli.args import RecipeError
from dfpo_trl.cli.field_builder import help_all_text
from dfpo_trl.cli.fields import build_field_table, table_source
from dfpo_trl.cli.help import short_help
from dfpo_trl.cli.parser import make_parser, parse_args
from dfpo_trl.cli.precheck import (
    TABLE_FILE,
    library_versions,
    precheck,
    read_field_table,
    stored_field_table,
    stored_help_all,
)

FIELD_TABLE = read_field_table()

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "trl", "datasets", "accelerate")


def test_stored_field_table_is_what_the_parser_gives() -> None:
    """Regenerate with `python -m dfpo_trl.cli.fields` after a field changes (ours or TRL's)."""
    if FIELD_TABLE["versions"] != library_versions():  # other libraries: the fast path stands aside
        assert stored_field_table() is None
        return
    parser = make_parser()
    built = build_field_table(parser)
    assert built == FIELD_TABLE, "dfpo_trl/cli/field_table.json is out of date: run python -m dfpo_trl.cli.fields"
    assert TABLE_FILE.read_text(encoding="utf-8") == table_source(built)
    assert stored_field_table() is FIELD_TABLE
    assert stored_help_all() == help_all_text(parser), "dfpo_trl/cli/help_all.txt is out of date: run the same"
    assert "--lr_scheduler_kwargs" in stored_help_all() and "--group_transform" in stored_help_all()


def test_other_library_versions_turn_the_fast_path_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under a TRL or transformers the table was not built from, nothing is judged from it: the full parse checks,
    and `--help` comes from the parser."""
    import dfpo_trl.cli.precheck as precheck_module
    from dfpo_trl.cli.main import main

    monkeypatch.setattr(precheck_module, "library_versions", lambda: {"trl": "0.0", "transformers": "0.0"})
    assert stored_field_table() is None
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("no_such_field: 1\n")
    precheck([str(recipe)])  # no field list to judge by
    with pytest.raises(RecipeError, match="not found"):
        precheck([str(tmp_path / "missing.yaml")])
    assert main([str(recipe)]) == 2  # the full parse refuses it
    assert "'no_such_field' (line 1): no similar field" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out == short_help(build_field_table(make_parser()))
    # the output_dir a failed run must not leave behind empty is still read, from the flag over the recipe
    recipe.write_text(f"output_dir: {tmp_path / 'from_recipe'}\n")
    assert precheck_module.given_output_dir([str(recipe)]) == str(tmp_path / "from_recipe")
    assert precheck_module.given_output_dir([str(recipe), "--output-dir=elsewhere"]) == "elsewhere"
    assert precheck_module.given_output_dir([str(tmp_path / "missing.yaml")]) is None


def test_help_from_the_stored_table_is_the_help_from_the_parser(live_table: dict) -> None:
    if stored_field_table() is not None:
        assert short_help(FIELD_TABLE) == short_help(live_table)


def _cases(tmp_path: Path) -> dict[str, list[str]]:
    """Commands the fast path refuses, each with what the refusal says."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"use_cpu: true\noutput_dir: {tmp_path / 'out'}\nmax_steps: 4\n")
    (tmp_path / "typo.yaml").write_text("use_cpu: true\nnum_generaitons: 4\n")
    (tmp_path / "bad.yaml").write_text("use_cpu: true\ninstruction: Answer: a number\n")
    return {
        "recipe not found": [str(tmp_path / "missing.yaml")],
        "no recipe": [],
        "unknown field in the recipe": [str(tmp_path / "typo.yaml")],
        "unknown flag": [str(recipe), "--learning-rat=3"],
        "not YAML": [str(tmp_path / "bad.yaml")],
        "output_dir cannot be created": [str(recipe), "--output_dir", "/proc/forbidden_dir"],
        "not a checkpoint": [str(recipe), "--resume_from_checkpoint", str(tmp_path / "nope")],
        "no checkpoint to resume": [str(recipe), "--resume_from_checkpoint", "true"],
        "max_steps 0": [str(recipe), "--max_steps", "0"],
        "max_steps below -1": [str(recipe), "--max_steps", "-5"],
        "local model path missing": [str(recipe), "--model_name_or_path", str(tmp_path / "no_model")],
        "local model path is a file": [str(recipe), "--model_name_or_path", str(tmp_path / "typo.yaml")],
        "save_steps and save_strategy no": [str(recipe), "--save_steps", "2", "--save_strategy", "no"],
    }


def _run_time_cases(tmp_path: Path) -> dict[str, list[str]]:
    """Commands the run refuses after torch when the fast path is bypassed (a caller of ``run``), and the fast path
    before it, in the same words headed by where the field was set."""
    recipe = str(tmp_path / "recipe.yaml")
    (tmp_path / "no_tokenizer").mkdir(exist_ok=True)
    (tmp_path / "no_tokenizer" / "config.json").write_text("{}")
    return {
        "reward model path missing": [recipe, "--reward_funcs", str(tmp_path / "no_rm")],
        "reward model without a tokenizer": [recipe, "--reward_funcs", str(tmp_path / "no_tokenizer")],
        "dataset the task does not read": [recipe, "--dataset", "openai/gsm8k"],
        "avg@k eval batch splits a problem": [recipe, "--use_vllm", "true", "--per_device_eval_batch_size", "6"],
    }


@pytest.fixture(scope="module")
def live_table() -> dict:
    """The field table of the installed libraries (the stored one when they are the versions it was built from)."""
    return build_field_table(make_parser())


def test_precheck_says_what_the_full_parse_says(tmp_path: Path, live_table: dict) -> None:
    """Each refusal of the fast path is word for word the full parse's (which stays, for callers of parse_args)."""
    for name, argv in _cases(tmp_path).items():
        with pytest.raises(RecipeError) as fast:
            precheck(argv, live_table)
        with pytest.raises(RecipeError) as full:
            parse_args(argv)
        assert str(fast.value) == str(full.value), name


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_help_and_input_errors_import_no_torch(tmp_path: Path, live_table: dict) -> None:
    """In a fresh interpreter: `--help`, `--help-all` and every refusal of the fast path, without torch,
    transformers, TRL, datasets or accelerate ever imported, each in under a second of CPU time with the
    interpreter's start and the imports (a refusal of a missing model path took 44 s through torch). The table is
    the installed libraries' (the stored one is, unless they are other versions than it was built from: then the
    fast path stands aside, tested above)."""
    script = textwrap.dedent(f"""
        import contextlib, io, json, resource, sys

        def cpu():
            usage = resource.getrusage(resource.RUSAGE_SELF)
            return usage.ru_utime + usage.ru_stime

        import dfpo_trl.cli.precheck
        table = json.loads(sys.argv[2])
        dfpo_trl.cli.precheck.read_field_table = lambda: table
        from dfpo_trl.cli.main import main
        results = {{}}
        seconds = {{"start and imports": cpu()}}
        for name, argv in json.loads(sys.argv[1]).items():
            before = cpu()
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    code = main(argv)
                except SystemExit as exc:
                    code = exc.code
            results[name] = [code, err.getvalue(), len(out.getvalue())]
            seconds[name] = cpu() - before
        results["imported"] = sorted(m for m in {HEAVY!r} if m in sys.modules)
        results["cpu"] = seconds
        print(json.dumps(results))
    """)
    cases = {**_cases(tmp_path), **_run_time_cases(tmp_path), "help": ["--help"],
             "help after a recipe": [str(tmp_path / "recipe.yaml"), "-h"], "help-all": ["--help-all"]}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases), json.dumps(live_table)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    assert results.pop("imported") == []
    seconds = results.pop("cpu")
    start = seconds.pop("start and imports")
    slowest = max(seconds, key=seconds.get)
    assert start + seconds[slowest] < 1.0, (start, slowest, seconds[slowest])
    for name in ("help", "help after a recipe", "help-all"):
        code, err, printed = results.pop(name)
        assert (code, err) == (0, "") and printed > (50_000 if name == "help-all" else 2000), name
    for name, (code, err, _) in results.items():
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("dfpo-train: error: "), (name, err)


def test_help_describes_each_task_whole() -> None:
    """`--help`'s task list: two_forms's description is whole (it was cut at the ". " of its quoted example), and a
    task registered without a summary is described by its docstring's whole first paragraph."""
    from dfpo_trl.cli.parser import docstring_summary

    help_text = " ".join(short_help(FIELD_TABLE).split())
    assert "'two_forms' (the same problems answered in either of two sentences the reward treats alike, 'The sum " \
           "is N.' or 'The answer is N.'" in help_text

    class Quoting:
        """Answers in a sentence such as: "Compute 3 + 5. The sum is 8." Then stops.

        Details that --help leaves out.
        """

    assert docstring_summary(Quoting) == 'Answers in a sentence such as: "Compute 3 + 5. The sum is 8." Then stops'


def test_the_first_line_says_what_runs_next_before_torch_is_imported(tmp_path: Path) -> None:
    """Within a second, before the imports that take 10 to 40 s on a loaded machine: what runs next, in order (the
    imports, the model, the held-out evaluation before training, the optimizer steps), with the embedded model's
    measured conversion time when it converts. Here the model is a hub id that cannot be reached offline, refused
    after torch: the line came first."""
    from dfpo_trl.cli.embedded import CONVERSION_MEASURED
    from dfpo_trl.cli.first_screen import next_steps
    from dfpo_trl.cli.precheck import stored_field_table

    if stored_field_table() is None:  # the stored table is another transformers/TRL's (CI's lower-bounds venv)
        pytest.skip("the fast path needs the stored field table of the installed libraries; without it the checks "
                    "run after the imports and the line comes from the full parse")

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"use_cpu: true\noutput_dir: {tmp_path / 'out'}\nmax_steps: 12\neval_size: 50\n")
    code = textwrap.dedent(f"""
        import sys
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    print("FIRST TORCH IMPORT", file=sys.stderr, flush=True)
                    sys.meta_path.remove(self)
                return None
        sys.meta_path.insert(0, Watch())
        from dfpo_trl.cli.main import main
        sys.exit(main([{str(recipe)!r}, "--model_name_or_path", "no-such-org/no-such-model-dfpo"]))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=env)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and "FIRST TORCH IMPORT" in lines, proc.stderr[-3000:]
    first = next(i for i, line in enumerate(lines) if "next: " in line)
    assert first < lines.index("FIRST TORCH IMPORT")
    assert lines[first] == (
        "INFO dfpo_trl.cli: next: importing torch, transformers and TRL (seconds; a minute on a loaded machine); "
        "then loading no-such-org/no-such-model-dfpo; then the held-out greedy accuracy on 50 problems before "
        "training (a bar shows its time left); then 12 optimizer steps"
    )
    values = {"model_name_or_path": None, "eval_size": 4, "skip_eval": True, "max_steps": -1, "disable_tqdm": True}
    said = next_steps(values.get)
    assert "held-out" not in said and said.endswith("then num_train_epochs epochs of optimizer steps")
    assert "SmolLM2-135M-Instruct" in said and ("earlier run" in said or CONVERSION_MEASURED in said)


def test_split_recipe_takes_the_path_after_config_and_keeps_every_other_item() -> None:
    from dfpo_trl.cli.precheck import split_recipe

    assert split_recipe(["--config", "r.yaml", "--seed", "1"]) == ("r.yaml", ["--seed", "1"])
    assert split_recipe(["--seed", "1", "--config", "r.yaml", "--bf16"]) == ("r.yaml", ["--seed", "1", "--bf16"])
    assert split_recipe(["--seed", "1"]) == (None, ["--seed", "1"])
