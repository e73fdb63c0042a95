"""``dfpo-train``'s closed options (cli/choices.py): a value spelt in another case, or with ``-`` for ``_``, is read
as the one option it names, in a recipe and as a flag; a misspelt one is refused with the nearest value, before
torch and by the full parse in the same words. The unknown-field message ends its "did you mean" sentence once."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dfpo_trl.cli.args import RecipeError
from dfpo_trl.cli.choices import canonical, did_you_mean
from dfpo_trl.cli.main import main
from dfpo_trl.cli.parser import parse_args
from dfpo_trl.cli.precheck import precheck, stored_field_table

FAST_PATH = stored_field_table() is not None  # the stored table is for the installed TRL and transformers


def _recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_matching_ignores_case_and_dashes_and_suggests_the_nearest() -> None:
    assert canonical("MIN_REPLACE", ["none", "min_replace"]) == "min_replace"
    assert canonical("min-replace", ["none", "min_replace"]) == "min_replace"
    assert canonical(" Sequence ", ["token", "sequence"]) == "sequence"
    assert canonical("min_replase", ["none", "min_replace"]) is None
    assert canonical("TOKEN", ["Token", "token"]) is None  # two options of one spelling: no guess
    assert did_you_mean("Min_Replase", ["none", "min_replace"]) == " Did you mean 'min_replace'?"
    assert did_you_mean("zzz", ["none", "min_replace"]) == ""


def test_a_recipe_and_flags_in_another_case_are_read_as_the_option(tmp_path: Path) -> None:
    """YAML users write MIN_REPLACE, Cosine, Sequence: each is the one option it can be, in the recipe and on the
    command line (DFPO's own fields, TRL's string fields, transformers' enums, the transform registry)."""
    recipe = _recipe(tmp_path, f"""\
        output_dir: {tmp_path / "out"}
        use_cpu: true
        group_transform: MIN_REPLACE
        importance_sampling_level: Sequence
        lr_scheduler_type: Cosine
        steps_per_generation: 4
    """)
    _, args, _ = parse_args([recipe, "--transform-gradient", "Score", "--loss_type=DR_GRPO",
                             "--group_layout", "PRE-PASS"])
    assert (args.group_transform, args.importance_sampling_level, args.transform_gradient) == (
        "min_replace", "sequence", "score")
    assert (args.loss_type, args.group_layout) == ("dr_grpo", "pre_pass")
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "cosine"
    precheck([recipe, "--transform-gradient", "Score"])  # the fast path reads them alike


@pytest.mark.parametrize(("where", "flags", "said"), [
    ("flag", ["--loss_type", "dapoo"],
     "--loss_type on the command line: loss_type='dapoo' is not one of its values ('grpo', 'dr_grpo', 'dapo', "
     "'bnpo', 'cispo', 'sapo', 'luspo', 'vespo'). Did you mean 'dapo'?"),
    ("recipe", [],
     "transform_gradient in {recipe}, line 3: transform_gradient='ratoi' is not one of its values ('ratio', "
     "'score'). Did you mean 'ratio'?"),
    ("flag", ["--lr_scheduler_type", "cosin"], "Did you mean 'cosine'?"),
    ("flag", ["--group_transform", "Min_Replase"], "is not a DFPO transform; use one of 'none', 'min_replace'"),
])
def test_a_misspelt_option_is_refused_with_the_nearest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, flags: list[str], said: str
) -> None:
    recipe = _recipe(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n"
                               + ("transform_gradient: ratoi\n" if where == "recipe" else ""))
    said = said.format(recipe=recipe)
    with pytest.raises(RecipeError) as full:
        parse_args([recipe, *flags])
    assert said in str(full.value)
    if "DFPO transform" in said:
        assert str(full.value).endswith("Did you mean 'min_replace'?")
    if FAST_PATH:  # under other versions the fast path is skipped, and the full parse alone refuses
        with pytest.raises(RecipeError) as fast:
            precheck([recipe, *flags])
        assert str(fast.value) == str(full.value)
    assert main([recipe, *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0]
    assert not (tmp_path / "out").exists()


def test_unknown_field_message_ends_its_question_once(tmp_path: Path) -> None:
    """'did you mean 'learning_rate'?' was followed by '.': the sentence ends with the question mark, from the full
    parse and (with the stored table) the fast path."""
    recipe = _recipe(tmp_path, "use_cpu: true\n")
    for check in (parse_args, precheck) if FAST_PATH else (parse_args,):
        with pytest.raises(RecipeError) as raised:
            check([recipe, "--learning_rat", "3"])
        said = str(raised.value)
        assert "'learning_rat': did you mean 'learning_rate'? Fields come from DFPOScriptArguments" in said
        assert "?." not in said
        with pytest.raises(RecipeError) as raised:
            check([recipe, "--zzzqqq", "3"])
        assert "'zzzqqq': no similar field. Fields come from" in str(raised.value)
