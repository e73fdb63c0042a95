"""dfpo_bench.reports.report_study_v4_long: the section states whether the arms started where the warm start's gate
measured (from the analysis's start check, not a fixed sentence), the primary's wording follows its interval, crashes
are listed as crashes, and the committed analysis gives a section with its figure."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

from dfpo_bench.reports import report_study_v4_long  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def committed() -> dict[str, Any]:
    return json.loads((RESULTS / "study_v4_long.json").read_text())


def section(tmp_path: pathlib.Path, analysis: dict[str, Any]) -> str:
    results = tmp_path / "results"
    results.mkdir(parents=True)
    (results / "study_v4_long.json").write_text(json.dumps(analysis))
    return "\n".join(report_study_v4_long.study_v4_long_section(results, tmp_path / "figures",
                                                                tmp_path / "RESULTS.md", 16))


def test_the_committed_analysis_gives_the_section_with_its_numbers_and_figure(tmp_path: pathlib.Path) -> None:
    analysis = committed()
    text = section(tmp_path, analysis)
    cov, prim = analysis["coverage"], analysis["primary"]
    assert text.startswith("## 16. Study v4, part 3")
    assert f"{cov['complete']} of {cov['planned']} planned runs complete" in text
    assert f"{prim['difference']:+.3f} [{prim['low']:+.3f}, {prim['high']:+.3f}]" in text
    assert "**Did the arms start where the gate measured?** No." in text and "FAILED" in text
    assert "not the registered one" in text and "Nothing crashed." in text
    assert (tmp_path / "figures" / "study_v4_long_curves.png").exists()


def test_the_start_sentence_and_the_crash_line_follow_the_analysis(tmp_path: pathlib.Path) -> None:
    analysis = copy.deepcopy(committed())
    for stage in analysis["start_check"]["stages"].values():
        stage["threshold_reread_passed"] = True
    analysis["arms"]["mr_w"]["crashed"] = [104]
    analysis["coverage"]["crashed"] = 1
    text = section(tmp_path, analysis)
    assert "**Did the arms start where the gate measured?** Yes." in text and "FAILED" not in text
    assert "not the registered one" not in text
    assert "* Crashes: 1 runs" in text and "mr_w [104]" in text and "Nothing crashed." not in text
