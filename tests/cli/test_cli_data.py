"""The math task's dataset from the command line: a hub dataset without network is one line naming the field and
how to point it at a local copy (not the hub client's retries and a traceback); a local copy loads, including a
folder written by ``save_to_disk``."""

from __future__ import annotations

from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from datasets import Dataset, DatasetDict

from dfpo_trl.cli.args import DFPOScriptArguments, RecipeError
from dfpo_trl.cli.data import build_datasets, build_task

ROWS = {"question": ["1 + 1?", "2 + 3?", "4 + 4?"], "answer": ["#### 2", "#### 5", "#### 8"]}


def _math_args(dataset: str) -> DFPOScriptArguments:
    return DFPOScriptArguments(task="math", dataset=dataset, problem_column="question", eval_size=2)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub unreachable, as on a machine without network (restored after the test)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", "/nonexistent-dfpo-test-cache")


def test_hub_dataset_without_network_is_one_line_naming_the_field(no_network: None) -> None:
    script_args = _math_args("dfpo-test-org/no-such-dataset")
    task = build_task(script_args)
    with pytest.raises(RecipeError) as refused:
        build_datasets(script_args, task, seed=0, origin=lambda name: f"--{name} on the command line")
    said = str(refused.value)
    assert said.startswith("--dataset on the command line: dataset 'dfpo-test-org/no-such-dataset' cannot be loaded: "
                           "no network access to the Hugging Face Hub and no cached copy")
    assert "Point dataset at a local copy" in said and "save_to_disk" in said and "\n" not in said


@pytest.mark.parametrize("form", ["save_to_disk", "data files"])
def test_a_local_copy_loads_without_network(form: str, tmp_path: Path, no_network: None) -> None:
    copy = tmp_path / "gsm"
    data = DatasetDict({"train": Dataset.from_dict(ROWS), "test": Dataset.from_dict(ROWS)})
    if form == "save_to_disk":
        data.save_to_disk(str(copy))
    else:
        copy.mkdir()
        for split, rows in data.items():
            rows.to_json(str(copy / f"{split}.jsonl"))
    script_args = _math_args(str(copy))
    train, heldout = build_datasets(script_args, build_task(script_args), seed=0)
    assert sorted(train["answer"]) == sorted(ROWS["answer"]) and len(heldout) == 2
    assert "1 + 1?" in heldout[0]["prompt"][0]["content"]


def test_the_refusal_leaves_output_dir_as_it_was(tmp_path: Path, no_network: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command line: exit 2, one line, and an earlier run's results where they were (the dataset is
    built before they are set aside)."""
    from dfpo_trl.cli.main import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "dfpo_summary.json").write_text('{"steps": 3, "files": ["dfpo_summary.json"]}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"use_cpu: true\ntask: math\nproblem_column: question\noutput_dir: {out}\n")
    assert main([str(recipe), "--dataset", "dfpo-test-org/no-such-dataset"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dfpo-train: error: --dataset on the command line: dataset 'dfpo-test-org/no-such-dataset'")
    assert "\n" not in err and {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_dataset_path_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    script_args = _math_args(str(tmp_path / "no-such-folder"))
    with pytest.raises(RecipeError) as refused:
        build_datasets(script_args, build_task(script_args), seed=0, origin=lambda name: f"{name} in r.yaml, line 4")
    said = str(refused.value)
    assert said.startswith(f"dataset in r.yaml, line 4: dataset '{tmp_path / 'no-such-folder'}' not found (")
    assert "save_to_disk" in said and "\n" not in said
