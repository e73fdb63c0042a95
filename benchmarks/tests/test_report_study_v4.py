"""dfpo_bench.reports.report_study_v4: the section's wording follows the intervals (an interval holding 0 reads "not
detected above" the MDE reached, one excluding it reads "detected" with its direction), the same-step points are
the ones with equal gradient norms and a zero effect, the exploratory fits start from the registered one, and the
committed analysis gives a section with its figure."""

from __future__ import annotations

import copy
import json
import pathlib
import random
from typing import Any

import pytest

from dfpo_bench.lib import stats
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
    """One clause per source hash, in the sessions' order whatever the analysis's, summing the entries that differ
    only in their diff; a hash the report does not list says so instead of naming a commit, and comes last."""
    def run(commit: str, source: str, diff: str, n: int) -> dict[str, Any]:
        return {"checkout": {"commit": commit, "dirty": True, "diff_sha256": diff, "source_sha256": source},
                "trajectories": n}
    first, second, third = list(report_study_v4.RUN_COMMITS)[:3]
    text = report_study_v4.checkouts_sentence([run("abc", "f" * 64, "d", 2),
                                               run("a625e137", third + "11", "e", 48),
                                               run("4931addee", first + "00", "a", 20),
                                               run("327d7e93", second + "ff", "b", 1),
                                               run("327d7e93", second + "ff", "c", 13)])
    assert text.startswith("The trajectories ran under 4 checkouts: 20 under source hash " + first)
    assert (f"14 under source hash {second}… (the hash of `{report_study_v4.RUN_COMMITS[second]}`; the records name "
            "commit 327d7e9 with uncommitted changes)") in text
    assert text.index(f"hash {second}") < text.index(f"hash {third}") < text.index("an unlisted commit")
    assert "an unlisted commit" in report_study_v4.checkouts_sentence([run("abc", "f" * 64, "d", 3)])
    assert "under 1 checkout:" in report_study_v4.checkouts_sentence([run("abc", "f" * 64, "d", 3)])


def test_the_control_says_where_its_mde_stands_against_the_target(tmp_path: pathlib.Path) -> None:
    """The control's sentence compares the MDE it reached with the registered target both ways, and gives the points
    with signal per trajectory of the pilot and of the main stage."""
    analysis = committed()
    control = analysis["settings"]["control"]
    target = report_study_v4.PREREGISTRATION["mde"]["relative_effect"]
    per_trajectory = control["points"] / control["trajectories"]
    control["mde_relative"] = target * 0.99
    text = section(tmp_path / "a", analysis)
    assert f"the MDE reached is at or below the registered target {target:g}" in text
    assert f"the main stage's trajectories had {per_trajectory:.1f} ({control['points']} of " in text
    control["mde_relative"] = target * 3
    assert f"the MDE reached is above the registered target {target:g}" in section(tmp_path / "b", analysis)
    assert report_study_v4.power_word(None, target) == "not known against"


def test_a_secondary_is_named_only_when_its_interval_excludes_0_with_the_arm_it_favours(
        tmp_path: pathlib.Path) -> None:
    """The pair is GSPO − Min-Replace: a positive interval names GSPO's step, a negative one Min-Replace's, and an
    interval holding 0 gives no line."""
    analysis = committed()
    main, control = analysis["settings"]["main"], analysis["settings"]["control"]
    main["abs_log_odds"].update(value=0.01, low=0.005, high=0.02)
    main["set_logp"].update(value=-0.2, low=-0.3, high=-0.1)
    control["abs_log_odds"].update(value=-0.01, low=-0.02, high=-0.005)
    control["set_logp"].update(value=0.0, low=-0.1, high=0.1)
    lines = [line for line in section(tmp_path, analysis).splitlines() if line.startswith("* Secondary")]
    assert lines == [
        "* Secondary, main: GSPO's step left the forms' |log-odds| larger, by 0.0100 (GSPO − MR "
        f"{report_study_v4.interval(main['abs_log_odds'])}); one of the 4 secondary intervals above, unadjusted, "
        "not a registered prediction.",
        "* Secondary, main: Min-Replace's step left the rewarded set more log-mass, by 0.2000 nats (GSPO − MR "
        f"{report_study_v4.interval(main['set_logp'])}); one of the 4 secondary intervals above, unadjusted, "
        "not a registered prediction.",
        "* Secondary, control: Min-Replace's step left the forms' |log-odds| larger, by 0.0100 (GSPO − MR "
        f"{report_study_v4.interval(control['abs_log_odds'])}); one of the 4 secondary intervals above, "
        "unadjusted, not a registered prediction."]


def test_the_sums_bootstrap_is_the_cluster_bootstrap_of_ols() -> None:
    """stats.cluster_bootstrap_ols (each draw from its clusters' sums) gives what cluster_bootstrap gives with ols's
    slope and intercept as the statistic, draw for draw; it refuses one cluster and an x that does not vary."""
    rng = random.Random(3)
    clusters = {f"t{k}": [(x := rng.uniform(0, 0.6), 0.2 * x - 0.03 + rng.gauss(0, 0.05 + 0.02 * k))
                          for _ in range(rng.randint(3, 30))] for k in range(25)}
    clusters["t3"] = [(0.0, 0.0)] * 7  # same-step points at I = 0
    slope, intercept = stats.cluster_bootstrap_ols(clusters, draws=500, seed=1)
    for got, i in ((slope, 0), (intercept, 1)):
        want = stats.cluster_bootstrap(clusters, lambda pts, i=i: (f := stats.ols(pts)) and f[i], draws=500, seed=1)
        assert got.keys() == want.keys()
        for key in ("value", "low", "high", "se"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        assert (got["draws"], got["items"], got["clusters"]) == (want["draws"], want["items"], want["clusters"])
    assert stats.cluster_bootstrap_ols({"a": clusters["t0"]}) == (None, None)
    assert stats.cluster_bootstrap_ols({"a": [(0.5, 1.0), (0.5, 2.0)], "b": [(0.5, 0.0)]}) == (None, None)


def test_the_exploratory_fits_start_from_the_registered_one_and_say_which_way_a_subset_pulled(
        tmp_path: pathlib.Path) -> None:
    """The pooled fit recomputed from the point columns is the analysis's registered slope and intercept; the
    sentence gives the fit without the same-step points with the way they pulled the slope, and each setting's."""
    analysis = committed()
    fits = report_study_v4.exploratory_fits(analysis["settings"])
    for got, want in zip(fits["all"], (analysis["slope"], analysis["intercept"]), strict=True):
        for key in ("value", "low", "high", "se"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    assert [report_study_v4.pulled(*pair) for pair in ((0.1, 0.2), (0.2, 0.1), (0.1, -0.1), (-0.1, -0.1))] == [
        "towards 0", "away from 0", "across 0", "neither way"]
    without, control = fits["without same-step points"], fits["control"]
    line = next(line for line in section(tmp_path, analysis).splitlines() if line.startswith("* Not registered"))
    assert (f"without the same-step points, slope {report_study_v4.interval(without[0], 3)}, intercept "
            f"{report_study_v4.interval(without[1], 3)} (so those points pulled the pooled slope "
            f"{report_study_v4.pulled(analysis['slope']['value'], without[0]['value'])})") in line
    assert f"control alone, slope {report_study_v4.interval(control[0], 3)}" in line
    items = sum(len(e["point_columns"]["trajectory"]) for e in analysis["settings"].values())
    assert fits["all"][0]["items"] == items > without[0]["items"] == items - sum(
        sum(report_study_v4.identical_steps(e["point_columns"])) for e in analysis["settings"].values())
