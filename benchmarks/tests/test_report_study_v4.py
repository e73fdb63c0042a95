"""dfpo_bench.reports.report_study_v4: the section's wording follows the intervals (an interval holding 0 reads "not
detected above" the MDE reached, one excluding it reads "detected" with its direction), the same-step points are
the ones with equal gradient norms and a zero effect, and the committed analysis gives a section with its figure."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

from dfpo_bench.reports import report_study_v4  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def committed() -> dict[str, Any]:
    return json.loads((RESULTS / "study_v4.json").read_text())


def section(tmp_path: pathlib.Path, analysis: dict[str, Any]) -> str:
    results = tmp_path / "results"
    (results / report_study_v4.RUN_FOLDER).mkdir(parents=True)
    (results / "study_v4.json").write_text(json.dumps(analysis))
    (results / report_study_v4.RUN_FOLDER / "plan.json").write_text(
        (RESULTS / report_study_v4.RUN_FOLDER / "plan.json").read_text())
    out = tmp_path / "RESULTS.md"
    return "\n".join(report_study_v4.study_v4_section(results, tmp_path / "figures", out, 15))


def test_the_wording_follows_the_primary_interval(tmp_path: pathlib.Path) -> None:
    analysis = committed()
    reached = f"Not detected above {analysis['settings']['main']['mde_relative']:.4f}"
    text = section(tmp_path / "a", analysis)
    assert f"**{reached}**" in text and "(tracked and clean" in text
    assert (tmp_path / "a" / "figures" / "study_v4_branch_scatter.png").exists()
    moved = copy.deepcopy(analysis)
    moved["settings"]["main"]["primary_relative"].update(value=0.05, low=0.02, high=0.08)
    text = section(tmp_path / "b", moved)
    assert "**Detected** (in the predicted direction)" in text and reached not in text
    moved["settings"]["main"]["primary_relative"].update(value=-0.05, low=-0.08, high=-0.02)
    assert "**Detected** (against the prediction)" in section(tmp_path / "c", moved)


def test_same_steps_need_equal_gradient_norms_and_a_zero_effect() -> None:
    columns = {"grad_norm_ratio": [1.0, 1.0, 0.9, None], "relative": [0.0, 0.1, 0.0, 0.0]}
    assert report_study_v4.identical_steps(columns) == [True, False, False, False]


def test_a_crash_is_named_and_a_failed_gate_said(tmp_path: pathlib.Path) -> None:
    analysis = committed()
    analysis["crashes"] = ["main/main/s120.jsonl"]
    analysis["settings"]["control"]["gate"].update(value=0.05, passed=False)
    text = section(tmp_path, analysis)
    assert "* Crashes: 1 (main/main/s120.jsonl;" in text and "was **not reached**, 0.050" in text


def test_each_checkout_is_named_with_its_count_and_the_commit_its_source_hash_is_of() -> None:
    """One clause per source hash, in the analysis's order, summing the entries that differ only in their diff; a
    hash the report does not list says so instead of naming a commit."""
    def run(commit: str, source: str, diff: str, n: int) -> dict[str, Any]:
        return {"checkout": {"commit": commit, "dirty": True, "diff_sha256": diff, "source_sha256": source},
                "trajectories": n}
    first, second = list(report_study_v4.RUN_COMMITS)
    text = report_study_v4.checkouts_sentence([run("4931addee", first + "00", "a", 20),
                                               run("327d7e93", second + "ff", "b", 1),
                                               run("327d7e93", second + "ff", "c", 13)])
    assert text.startswith("The trajectories ran under 2 checkouts: 20 under source hash " + first)
    assert (f"14 under source hash {second}… (the hash of `{report_study_v4.RUN_COMMITS[second]}`; the records name "
            "commit 327d7e9 with uncommitted changes)") in text
    assert "an unlisted commit" in report_study_v4.checkouts_sentence([run("abc", "f" * 64, "d", 3)])
    assert "under 1 checkout:" in report_study_v4.checkouts_sentence([run("abc", "f" * 64, "d", 3)])
