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


def committed(name: str = "study_v4_long.json") -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def section(tmp_path: pathlib.Path, analysis: dict[str, Any], superseded: dict[str, Any] | None = None) -> str:
    results = tmp_path / "results"
    results.mkdir(parents=True)
    (results / "study_v4_long.json").write_text(json.dumps(analysis))
    if superseded is not None:
        (results / "study_v4_long_r1.json").write_text(json.dumps(superseded))
    return "\n".join(report_study_v4_long.study_v4_long_section(results, tmp_path / "figures",
                                                                tmp_path / "RESULTS.md", 16))


def test_the_committed_analyses_give_the_section_with_their_numbers_and_figures(tmp_path: pathlib.Path) -> None:
    current, first = committed(), committed("study_v4_long_r1.json")
    text = section(tmp_path, current, first)
    assert text.startswith("## 16. Study v4, part 3")
    head, sub = text.split("### 16.1. Revision 1 (superseded)")
    for part, analysis in ((head, current), (sub, first)):
        cov, prim = analysis["coverage"], analysis["primary"]
        assert f"{cov['complete']} of {cov['planned']} planned runs complete" in part
        assert f"{prim['difference']:+.3f} [{prim['low']:+.3f}, {prim['high']:+.3f}]" in part
        assert "Nothing crashed." in part
    assert "(revision 2)" in head and "**Did the arms start where the gate measured?** Yes." in head
    assert "FAILED" not in head and "not the registered one" not in head
    assert "e2 the same weights" in head  # the warm start laid twice: the same hash
    assert "(revision 1, since revised" in sub and "**Did the arms start where the gate measured?** No." in sub
    assert "FAILED" in sub and "not the registered one" in sub
    launches = ", ".join(str(n) for n in current["at_a_time"]["main"])  # one entry per launch of the stage
    assert f"main ({launches} at a time)" in head and "main (9 at a time)" in sub
    sessions = [lay for lay in current["warmstart_layings"]["layings"] if not lay["folder"].startswith("replay/")]
    assert len(sessions) >= 3 and f"The warm start laid in {len(sessions)} sessions" in head
    assert "hashing the same in every laying" in head
    assert "laid in" not in sub  # one laying: nothing to compare
    for figure in ("study_v4_long_curves.png", "study_v4_long_r1_curves.png"):
        assert (tmp_path / "figures" / figure).exists()


def test_the_start_sentence_the_replay_and_the_crash_line_follow_the_analysis(tmp_path: pathlib.Path) -> None:
    analysis = copy.deepcopy(committed())
    analysis["start_check"]["stages"]["main"]["threshold_reread_passed"] = False
    analysis["warmstart_replay"]["entries"]["e2"]["identical"] = False
    analysis["warmstart_replay"]["all_identical"] = False
    analysis["arms"]["mr_w"]["crashed"] = [104]
    analysis["coverage"]["crashed"] = 1
    text = section(tmp_path, analysis)
    assert "### 16.1" not in text  # no superseded analysis, no subsection
    assert "**Did the arms start where the gate measured?** No." in text and "FAILED" in text
    assert "not the registered one" in text
    assert "e2 OTHER weights" in text and "continues the stages" not in text
    assert "hashing the same in every laying" in text
    analysis["warmstart_layings"]["all_identical"] = False
    assert "NOT hashing the same in every laying" in section(tmp_path / "tampered", analysis)
    assert "* Crashes: 1 runs" in text and "mr_w [104]" in text and "Nothing crashed." not in text


def test_the_main_stage_lines_say_whether_every_planned_run_started(tmp_path: pathlib.Path) -> None:
    """While planned runs were never started the lines count them; once every planned run started, the primary is
    the registered test, and the lines no longer explain runs that were never started."""
    analysis = copy.deepcopy(committed())
    analysis["coverage"]["not_started"] = 33
    text = section(tmp_path / "interim", analysis)
    assert "33 never started (a session's device time ended first" in text
    assert "(registered target 0.05; 33 planned runs were never started)." in text
    assert "the registered test)" not in text
    analysis["coverage"]["not_started"] = 0
    text = section(tmp_path / "finished", analysis)
    assert "every planned run started;" in text and "every planned run started: the registered test)." in text
    assert "never started" not in text


def test_the_records_line_names_every_layer_in_unpacking_order(tmp_path: pathlib.Path) -> None:
    assert report_study_v4_long.records_text(tmp_path, "run") == (
        "not in the repository (`results/run/records.tgz` is missing)")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "records.tgz").write_bytes(b"")
    assert report_study_v4_long.records_text(tmp_path, "run").startswith("`results/run/records.tgz` (the run folder")
    for n in (10, 2):
        (tmp_path / "run" / f"records_{n}.tgz").write_bytes(b"")
    text = report_study_v4_long.records_text(tmp_path, "run")
    assert text.startswith("`results/run/records.tgz`, then `records_2.tgz`, `records_10.tgz` (the run folder")
    assert "record_layers unpack" in text
    committed_text = report_study_v4_long.records_text(RESULTS, report_study_v4_long.RUNS[0][1])
    assert "then `records_2.tgz`" in committed_text  # the current run's records span sessions
