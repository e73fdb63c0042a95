"""benchmarks/study_v2.py: the primary metric, the MDE and Welch interval, the gates (and the main stage refused
without them), the aggregation on synthetic records; one slow CPU smoke of the whole pipeline."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study_v2  # noqa: E402

STEPS = 64
THRESHOLDS = {"learned_threshold": 0.8, "min_learned_share": 0.8, "max_phi": 0.95}


def record(arm: str, seed: int, after: float | None = 0.9, start: float = 0.6, end: float = 0.2,
           complete: bool = True, phi_off: float = 1.0, spg: int = 16, extra_series: dict | None = None
           ) -> dict[str, Any]:
    """A run record as common.finish writes it: a linear set-entropy curve from ``start`` to ``end`` (its AUC is
    exactly their mean), φ = 1 on the first step of each rollout and ``phi_off`` on the others."""
    steps = list(range(0, STEPS + 1, 8))
    curve = [{"step": s, "set_entropy": start + (end - start) * s / STEPS} for s in steps]
    phi = [[k, 1.0 if (k - 1) % spg == 0 else phi_off] for k in range(1, STEPS + 1)]
    series = {"transform/phi_mean": phi, "grad_norm": [[k, 0.0 if k % 4 == 0 else 1.0] for k in range(1, STEPS + 1)],
              "clip_ratio/region_mean": [[k, 0.1] for k in range(1, STEPS + 1)], **(extra_series or {})}
    return {"task": "two_forms", "method": arm, "seed": seed, "card": "test card", "versions": {"torch": "x"},
            "complete": complete, "steps": STEPS if complete else 3, "exit_code": 0 if complete else 1,
            "heldout": {"before": 0.3, "after": after}, "drift": {"curve": curve}, "series": series,
            "settings": {"flags": ["--steps_per_generation", str(spg), "--gradient_accumulation_steps", "1"],
                         "extra": []}}


def write_stage(folder: Path, records: list[dict[str, Any]], stage: dict[str, Any] | None = None) -> None:
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    for r in records:
        (folder / "runs" / f"two_forms__{r['method']}__s{r['seed']}.json").write_text(json.dumps(r))
    if stage is not None:
        (folder / "stage.json").write_text(json.dumps(stage))


# ------------------------------------------------------------------------------------------------ statistics
def test_auc_is_the_trapezoid_area_over_the_step_span() -> None:
    # 0-8: 8 (1 + 0.5) / 2 = 6; 8-16: 8 x 0.5 = 4; 16-64: 48 (0.5 + 0) / 2 = 12 -> 22 / 64
    curve = [[16, 0.5], [0, 1.0], [64, 0.0], [8, 0.5]]  # unsorted on purpose
    assert study_v2.curve_auc(curve) == pytest.approx(22 / 64, rel=1e-12)
    assert study_v2.curve_auc([[0, 0.3], [8, 0.3], [64, 0.3]]) == pytest.approx(0.3, rel=1e-12)
    assert study_v2.curve_auc([[0, 0.3]]) is None and study_v2.curve_auc([]) is None


def test_mde_against_a_hand_computation() -> None:
    # s = 0.2, 0.3, n = 40 each: sqrt(0.04/40 + 0.09/40) = sqrt(0.00325) = 0.0570088; x (1.959964 + 0.841621)
    assert study_v2.mde(0.2, 40, 0.3, 40) == pytest.approx(0.0570088 * 2.801585, rel=1e-5)
    # the n it asks for is the smallest equal n whose MDE reaches the effect
    n = study_v2.n_needed(0.2, 0.3, 0.1)
    assert study_v2.mde(0.2, n, 0.3, n) <= 0.1 < study_v2.mde(0.2, n - 1, 0.3, n - 1)
    with pytest.raises(ValueError, match="--effect"):
        study_v2.n_needed(0.2, 0.3, 0.0)


def test_welch_interval_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    a = [0.31, 0.42, 0.28, 0.55, 0.47, 0.39, 0.33]
    b = [0.21, 0.25, 0.19, 0.40, 0.22]
    result = study_v2.welch(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert result["difference"] == pytest.approx(statistics.fmean(a) - statistics.fmean(b), rel=1e-12)
    assert (result["low"], result["high"]) == pytest.approx((ci.low, ci.high), rel=1e-9)
    assert study_v2.welch(a, [0.2]) is None


def test_welch_mde_uses_t_at_the_welch_df() -> None:
    # 10 runs against 75: the MDE with t at Welch's df is (t_0.975,df + t_0.8,df) SE, above the z approximation
    stats = pytest.importorskip("scipy.stats")
    a = [0.31, 0.12, 0.45, 0.22, 0.38, 0.05, 0.29, 0.41, 0.18, 0.35]
    b = [0.3 + 0.01 * ((7 * i) % 13 - 6) for i in range(75)]
    result = study_v2.welch(a, b)
    t_mde = (stats.t.ppf(0.975, result["df"]) + stats.t.ppf(0.8, result["df"])) * result["se"]
    assert result["mde"] == pytest.approx(t_mde, rel=1e-9)
    assert result["mde"] > result["mde_z"] * 1.05  # df ≈ 9.5: t's quantiles are visibly wider than z's


def test_verdict_says_not_detected_above_the_mde_for_a_null() -> None:
    null = study_v2.welch([0.3, 0.5, 0.4], [0.35, 0.45, 0.5])
    text = study_v2.verdict("mr_w - gspo", null)
    assert "not detected above MDE" in text and "no effect" not in text
    assert f"{null['mde']:.3g}" in text
    found = study_v2.verdict("mr_w - gspo", study_v2.welch([0.9, 0.91, 0.92], [0.1, 0.11, 0.12]))
    assert "detected (the interval excludes 0)" in found


# ------------------------------------------------------------------------------------------------ per run
def test_offpolicy_phi_skips_each_rollouts_first_step_and_prefers_the_logged_key() -> None:
    r = record("mr_w", 0, phi_off=0.9, spg=16)
    assert study_v2.phi_offpolicy(r) == pytest.approx(0.9, rel=1e-12)  # steps 1, 17, 33, 49 (φ = 1) left out
    every = statistics.fmean(v for _, v in r["series"]["transform/phi_mean"])
    assert every > 0.9  # averaging every step would have said less than the transform did
    logged = record("mr_w", 0, phi_off=0.9, extra_series={"diagnostics/phi_mean_off_policy": [[2, 0.7], [3, 0.8]]})
    assert study_v2.phi_offpolicy(logged) == pytest.approx(0.75, rel=1e-12)
    assert study_v2.phi_offpolicy(record("anchor", 0, spg=1)) is None  # no off-policy step at all
    d = study_v2.diagnostics(r)
    assert d["zero_grad_share"] == pytest.approx(0.25) and d["clip_fraction"] == pytest.approx(0.1)


def test_arms_parse_as_the_design_says(gpu_recipes_parse_here: None) -> None:
    """Each arm's flags on the recipe give the config the design names: anchor on-policy (one rollout per optimizer
    step), the others S micro-steps per rollout, the transform and target of each, scale's κ."""
    from dfpo_trl.app.parser import parse_args

    design = {"steps_per_generation": 16, "grad_accum": 2, "learning_rate": 1e-5, "drift_every": 8,
              "use_vllm": False}
    want = {"anchor": (2, "none", "weights"), "gspo": (16, "none", "weights"), "mr_w": (16, "min_replace", "weights"),
            "mr_g": (16, "min_replace", "gradient"), "scale": (16, "scale", "weights")}
    for arm, (spg, transform, target) in want.items():
        _, config, _ = parse_args([str(study_v2.common.RECIPE), *study_v2.arm_flags(arm, design, 0.9)])
        got = (config.steps_per_generation, config.group_transform, config.cancellation_target)
        assert got == (spg, transform, target), arm
        assert (config.gradient_accumulation_steps, config.learning_rate, config.use_vllm) == (2, 1e-5, False)
        assert config.importance_sampling_level == "sequence" and config.epsilon == 3e-4
    assert config.transform_scale == pytest.approx(0.9)
    with pytest.raises(SystemExit, match="--kappa"):
        study_v2.arm_flags("scale", design, None)
    with pytest.raises(SystemExit, match="multiple of --grad-accum"):
        study_v2.arm_flags("gspo", {**design, "steps_per_generation": 3}, None)
    on_policy = record("anchor", 0, spg=2, phi_off=0.5)
    on_policy["settings"]["flags"] = study_v2.arm_flags("anchor", design, None)
    assert study_v2.rollout_steps(on_policy) == 1 and study_v2.phi_offpolicy(on_policy) is None


# ------------------------------------------------------------------------------------------------ gates
def test_gates_pass_and_fail() -> None:
    good = [record("gspo", s) for s in range(4)] + [record("mr_w", s, phi_off=0.9) for s in range(2)]
    gates = study_v2.compute_gates(good, THRESHOLDS)
    assert gates["passed"] and gates["kappa_matched"] == pytest.approx(0.9, rel=1e-12)
    # 3 of 4 gspo runs learned (one diverged): 0.75 < 0.8
    diverged = [record("gspo", s, after=0.0 if s == 0 else 0.9) for s in range(4)] + good[4:]
    gates = study_v2.compute_gates(diverged, THRESHOLDS)
    assert not gates["baseline_learns"]["passed"] and gates["baseline_learns"]["share"] == 0.75
    crashed = [record("gspo", s, complete=s != 0) for s in range(4)] + good[4:]  # a failed run did not learn
    assert not study_v2.compute_gates(crashed, THRESHOLDS)["passed"]
    barely = good[:4] + [record("mr_w", s, phi_off=0.99) for s in range(2)]
    gates = study_v2.compute_gates(barely, THRESHOLDS)
    assert gates["baseline_learns"]["passed"] and not gates["transform_moves_weights"]["passed"]
    assert not study_v2.compute_gates(good[:4], THRESHOLDS)["passed"]  # no mr_w run: φ not measured


def test_learned_by_gain_reads_before_and_after() -> None:
    gain = {**THRESHOLDS, "learned_gain": 0.1}
    # before 0.3 in every synthetic record: 0.4 is a gain of 0.1 up to float rounding (counted), 0.39 is not
    runs = [record("gspo", 0, after=0.4), record("gspo", 1, after=0.39), record("gspo", 2, after=0.9),
            record("gspo", 3, after=0.5, complete=False)]
    assert [study_v2.learned(r, (0.8, 0.1)) for r in runs] == [True, False, True, False]
    assert [study_v2.learned(r, (0.8, None)) for r in runs] == [False, False, True, False]
    gates = study_v2.compute_gates([*runs, record("mr_w", 0, phi_off=0.9)], gain)
    assert gates["baseline_learns"]["learned"] == 2 and gates["thresholds"]["learned_gain"] == 0.1


def test_main_stage_refused_without_passed_gates(tmp_path: Path) -> None:
    args = ["--out-dir", str(tmp_path), "--model", "m"]
    with pytest.raises(SystemExit, match="no gates file"):
        study_v2.main(["--stage", "main", *args])
    assert not (tmp_path / "main").exists()  # refused before anything was launched or written
    write_stage(tmp_path / "pilot", [record("gspo", 0, after=0.1), record("mr_w", 0, phi_off=0.9)],
                {"design": {}})
    study_v2.main(["--write-gates", *args])
    gates = json.loads((tmp_path / "gates.json").read_text())
    assert not gates["passed"] and gates["written_at"]
    with pytest.raises(SystemExit, match="gates failed"):
        study_v2.main(["--stage", "main", *args])
    design = {"task": "two_forms", "model": "m"}
    state = study_v2.check_gates(tmp_path / "gates.json", design, force=True)
    assert state["forced"] and not state["passed"]  # --force starts it, and says so
    gates["passed"] = True
    (tmp_path / "gates.json").write_text(json.dumps(gates))
    with pytest.raises(SystemExit, match="differs from the pilot's"):
        study_v2.check_gates(tmp_path / "gates.json", design, force=False)
    write_stage(tmp_path / "main", [record("gspo", 100)])
    with pytest.raises(SystemExit, match="already holds run records"):
        study_v2.main(["--write-gates", *args])  # gates are never rewritten once a main outcome exists


def test_design_selection_waits_for_every_pilot_and_takes_the_first_that_passed(tmp_path: Path) -> None:
    designs = [tmp_path / name for name in ("s16_lr3e-5_n64", "s16_lr1e-4_n64", "s16_lr3e-4_n64")]
    outcomes = {designs[0]: [record("gspo", s, after=0.2) for s in range(4)] + [record("mr_w", 0, phi_off=0.9)],
                designs[1]: [record("gspo", s) for s in range(4)] + [record("mr_w", 0, phi_off=0.9)],
                designs[2]: [record("gspo", s) for s in range(4)] + [record("mr_w", 0, phi_off=0.8)]}
    for folder in designs[:2]:
        write_stage(folder / "pilot", outcomes[folder], {"design": {"learning_rate": folder.name}})
        study_v2.write_gates(folder, THRESHOLDS)
    assert study_v2.select_design(designs, tmp_path) is None  # the third pilot has no gates yet
    assert not (tmp_path / "selected").exists()
    write_stage(designs[2] / "pilot", outcomes[designs[2]], {"design": {}})
    study_v2.write_gates(designs[2], THRESHOLDS)
    selection = study_v2.select_design(designs, tmp_path)
    # the first design failed gate (a); the second is chosen although the third moved the weights more
    assert selection["selected"] == str(designs[1])
    assert (tmp_path / "selected").read_text().strip() == str(designs[1])
    assert not selection["candidates"][str(designs[0])]["passed"]
    assert json.loads((tmp_path / "selection.json").read_text())["order"] == [str(d) for d in designs]
    for folder in designs[1:]:  # none passed: the selection says so and names no folder
        gates = json.loads((folder / "gates.json").read_text())
        (folder / "gates.json").write_text(json.dumps({**gates, "passed": False}))
    assert study_v2.select_design(designs, tmp_path)["selected"] is None
    assert (tmp_path / "selected").read_text().strip() == ""


# ------------------------------------------------------------------------------------------------ aggregate
def test_aggregation_on_synthetic_records(tmp_path: Path) -> None:
    gspo = [record("gspo", 100 + i, start=0.6, end=0.1 + 0.02 * i) for i in range(5)]
    mr_w = [record("mr_w", 100 + i, start=0.6, end=0.3 + 0.03 * i, phi_off=0.85) for i in range(5)]
    mr_w += [record("mr_w", 105, after=0.2), record("mr_w", 106, complete=False)]
    anchor = [record("anchor", 100 + i, start=0.6, end=0.05 * i, spg=1) for i in range(3)]
    gates = {**study_v2.compute_gates(gspo + mr_w, THRESHOLDS), "written_at": "2026-01-01T00:00:00+00:00",
             "design": {}}
    (tmp_path / "gates.json").write_text(json.dumps(gates))
    sha = study_v2.hashlib.sha256((tmp_path / "gates.json").read_bytes()).hexdigest()
    stage = {"stage": "main", "design": {}, "started_at": "2026-01-02T00:00:00+00:00", "kappa": 0.85,
             "gates": {"passed": True, "forced": False, "sha256": sha, "written_at": gates["written_at"]}}
    write_stage(tmp_path / "main", gspo + mr_w + anchor, stage)
    study = study_v2.aggregate(tmp_path / "main", tmp_path / "out.json", tmp_path / "figures")

    assert json.loads((tmp_path / "out.json").read_text())["arms"] == study["arms"]
    assert study["gates_before_stage"] is True and study["learned_threshold"] == 0.8
    auc = {arm: [(0.6 + r["drift"]["curve"][-1]["set_entropy"]) / 2 for r in runs[:5 if arm != "anchor" else 3]]
           for arm, runs in (("gspo", gspo), ("mr_w", mr_w), ("anchor", anchor))}
    arms = study["arms"]
    assert arms["mr_w"]["runs"] == 7 and arms["mr_w"]["learned"] == 5
    assert arms["mr_w"]["not_learned"] == 1 and arms["mr_w"]["failed_or_short"] == 1
    assert arms["mr_w"]["auc_mean"] == pytest.approx(statistics.fmean(auc["mr_w"]), rel=1e-9)
    # diagnostics: every complete run, learned or not (the one that did not learn has φ = 1 off-policy)
    assert arms["mr_w"]["diagnostics"]["phi_offpolicy"] == pytest.approx((5 * 0.85 + 1.0) / 6, rel=1e-9)
    expected = study_v2.welch(auc["mr_w"], auc["gspo"])
    got = study["comparisons"]["mr_w - gspo"]
    assert got["welch"]["difference"] == pytest.approx(expected["difference"], rel=1e-9)
    assert got["welch"]["mde"] == pytest.approx(expected["mde"], rel=1e-9)
    assert "gspo - anchor" in study["comparisons"] and "scale - gspo" not in study["comparisons"]
    assert {Path(f).name for f in study["figures"]} == {"study_v2_anchor.png", "study_v2_gspo.png",
                                                        "study_v2_mr_w.png"}
    row = next(r for r in study["runs"] if r["arm"] == "mr_w" and r["seed"] == 100)
    assert row["card"] == "test card" and row["versions"] and row["gates"]["passed"] and row["diagnostics"]

    check = study_v2.sd_check(tmp_path / "main", effect=0.05, first=3)
    assert check["sd"]["gspo"]["sd"] == pytest.approx(statistics.stdev(auc["gspo"][:3]), rel=1e-9)
    assert check["n_per_arm"]["mr_w - gspo"] == study_v2.n_needed(check["sd"]["mr_w"]["sd"],
                                                                  check["sd"]["gspo"]["sd"], 0.05)
    assert "mean" not in json.dumps(check)  # the SD check shows no outcome


@pytest.mark.slow
def test_smoke_pilot_gates_main_aggregate(tmp_path: Path) -> None:
    """The whole pipeline on the CPU with a tiny random model: every arm runs, the gates are written before the
    main stage, scale gets the pilot's matched φ, the aggregate has every arm and comparison."""
    study = study_v2.main(["--smoke", "--out-dir", str(tmp_path)])
    gates = json.loads((tmp_path / "gates.json").read_text())
    assert study["gates_before_stage"] is True and gates["design"] == study["design"]
    assert set(study["arms"]) == set(study_v2.ARMS)
    assert all(entry["complete"] == entry["runs"] == 2 for entry in study["arms"].values())
    assert study["kappa"] == pytest.approx(gates["kappa_matched"], rel=1e-12)
    assert study["arms"]["scale"]["diagnostics"]["phi_offpolicy"] == pytest.approx(study["kappa"], rel=1e-4)
    assert study["arms"]["mr_w"]["diagnostics"]["phi_offpolicy"] < 1.0
    assert study["arms"]["anchor"]["diagnostics"]["phi_offpolicy"] is None  # on-policy: no off-policy step
    assert all(math.isfinite(r["auc_set_entropy"]) for r in study["runs"])
    assert len(study["comparisons"]) == 4 and len(study["figures"]) == 5
