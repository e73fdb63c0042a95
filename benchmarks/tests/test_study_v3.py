"""dfpo_bench.studies.study_v3: the pre-registration is fixed and checked, each arm's flags parse, the paired
statistics and the seed count match hand computations, the gates read every pre-registered threshold (crashes counted as
crashes), the aggregation, and the CPU path (tiny model, 2 steps) end to end."""

from __future__ import annotations

import json
import math
import pathlib
import statistics

import pytest

from dfpo_bench.studies import study_v3  # noqa: E402

DESIGN = study_v3.PREREGISTERED["designs"][0]


def test_the_committed_preregistration_is_the_scripts() -> None:
    path = study_v3.RESULTS / "preregistered.json"
    stored = json.loads(path.read_text())
    assert stored["sha256"] == study_v3.preregistration_sha()
    assert stored["preregistered"] == json.loads(json.dumps(study_v3.PREREGISTERED))
    study_v3.check_preregistered(path)


@pytest.mark.parametrize("round_", [2, 3])
def test_later_rounds_change_only_the_designs_and_are_committed(round_: int) -> None:
    """Rounds 2 and 3 were registered after the last round's gates failed: same gates, steps, seeds and analysis,
    other designs; each committed file equals the script's registration, and a design's own learning rate reaches
    the run's flags."""
    registration = study_v3.REGISTRATIONS[round_]
    def rest(reg: dict) -> dict:
        return {k: v for k, v in reg.items() if k not in ("designs", "round")}

    assert rest(registration) == rest(study_v3.PREREGISTERED)
    earlier = {d["name"] for r in range(1, round_) for d in study_v3.REGISTRATIONS[r]["designs"]}
    assert not earlier & {d["name"] for d in registration["designs"]}
    study_v3.check_preregistered(study_v3.REGISTRATION_FILES[round_], round_)
    with pytest.raises(SystemExit, match=f"round {round_}"):
        study_v3.check_preregistered(study_v3.REGISTRATION_FILES[1], round_)
    for design in registration["designs"]:
        flags = study_v3.arm_flags("mr_w", design)
        lr = flags[flags.index("--learning_rate") + 1]
        assert float(lr) == design.get("learning_rate", study_v3.PREREGISTERED["learning_rate"])


def test_a_changed_preregistration_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "preregistered.json"
    path.write_text(json.dumps({"sha256": "0" * 64}))
    with pytest.raises(SystemExit, match="fixed before any pilot"):
        study_v3.check_preregistered(path)


def test_arm_flags_parse_and_the_anchor_is_on_policy_with_the_same_rollout(gpu_recipes_parse_here: None) -> None:
    from dfpo_trl.cli import parse_recipe

    configs = {}
    for arm, (task, _, _) in study_v3.ARMS.items():
        script, config, _ = parse_recipe([str(study_v3.common.RECIPE), "--task", study_v3.TASKS[task],
                                        *study_v3.arm_flags(arm, DESIGN)])
        configs[arm] = config
        assert config.scale_rewards == "none" and config.epsilon == pytest.approx(DESIGN["epsilon"], rel=1e-9)
    anchor, stale = configs["anchor"], configs["gspo"]
    rollout = {a: c.per_device_train_batch_size * c.steps_per_generation for a, c in configs.items()}
    assert len(set(rollout.values())) == 1  # the same rollout size in every arm
    assert anchor.gradient_accumulation_steps == anchor.steps_per_generation == DESIGN["rollout_steps"]
    assert stale.gradient_accumulation_steps == 1 and configs["mr_w"].group_transform == "min_replace"


def test_paired_interval_and_mde_by_hand() -> None:
    stats = pytest.importorskip("scipy.stats")
    a = {0: 0.50, 1: 0.42, 2: 0.61, 3: 0.48, 4: 0.55}
    b = {0: 0.45, 1: 0.40, 2: 0.52, 3: 0.47, 4: 0.50, 9: 0.1}  # seed 9 has no pair: left out
    d = [a[s] - b[s] for s in range(5)]
    result = study_v3.paired(a, b)
    se = statistics.stdev(d) / math.sqrt(5)
    assert result["n"] == 5 and result["difference"] == pytest.approx(statistics.fmean(d), rel=1e-12)
    assert result["high"] - result["difference"] == pytest.approx(stats.t.ppf(0.975, 4) * se, rel=1e-9)
    assert result["mde"] == pytest.approx((stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * se, rel=1e-9)
    n = study_v3.seeds_needed(0.139, 0.05)  # study v2's paired-scale SD: about 61 pairs by z, a few more by t
    assert study_v3.mde_t(0.139 / math.sqrt(n), n - 1) <= 0.05 < study_v3.mde_t(0.139 / math.sqrt(n - 1), n - 2)
    assert 61 <= n <= 65
    assert study_v3.paired({0: 1.0}, {0: 0.5}) is None


def row(arm: str, seed: int, mass: float = 0.7, one_sided: float = 0.2, clipped: float = 0.2, learned: bool = True,
        complete: bool = True) -> dict:
    if not complete:
        return {"arm": arm, "seed": seed, "complete": False, "crash": "OutOfMemoryError"}
    return {"arm": arm, "seed": seed, "complete": True, "learned": learned, "primary": 0.3,
            "diagnostics": {"set_mass_final": mass, "one_sided_share": one_sided, "clipped_share": clipped}}


def test_gates_pass_only_when_every_threshold_holds_on_enough_completed_runs() -> None:
    good = [row(a, s) for a in study_v3.ARMS for s in range(4)]
    assert study_v3.gates(good)["passed"]
    low_mass = [row(a, s, mass=0.3 if a == "gspo" else 0.7) for a in study_v3.ARMS for s in range(4)]
    assert not study_v3.gates(low_mass)["baseline_set_mass"]["passed"]
    one_sided = [row(a, s, one_sided=0.45) for a in study_v3.ARMS for s in range(4)]
    assert not study_v3.gates(one_sided)["one_sided_share"]["passed"]
    clipped = [row(a, s, clipped=0.6) for a in study_v3.ARMS for s in range(4)]
    assert not study_v3.gates(clipped)["clipped_share"]["passed"]
    anchor_off = [row(a, s, mass=0.01 if a == "anchor" else 0.7) for a in study_v3.ARMS for s in range(4)]
    assert not study_v3.gates(anchor_off)["anchor_on_set"]["passed"]
    # two crashed gspo runs: counted as crashes, not as "not learned", and 2 completed runs are too few to read
    crashed = [row(a, s, complete=not (a == "gspo" and s < 2)) for a in study_v3.ARMS for s in range(4)]
    result = study_v3.gates(crashed)
    assert result["crashes"]["gspo"] == 2 and not result["baseline_learns"]["passed"]
    assert result["baseline_learns"]["value"] == 1.0 and result["baseline_learns"]["completed"] == {"gspo": 2}


@pytest.mark.slow  # about 25 s on the 2-core CPU machine: one dfpo-train process
def test_cpu_path_tiny_model_two_steps(tmp_path: pathlib.Path) -> None:
    result = study_v3.main(["--smoke", "--out-dir", str(tmp_path), "--arms", "gspo_eq"])
    design = study_v3.PREREGISTERED["designs"][-1]
    rows = study_v3.stage_rows(tmp_path / "pilot" / design["name"], design)
    assert [(r["arm"], r["seed"], r["complete"]) for r in rows] == [("gspo_eq", 0, True)]
    r = rows[0]
    assert r["checkout"]["source_sha256"] and r["versions"]["trl"] and r["card"] == "cpu"
    assert 0 < r["diagnostics"]["set_mass_final"] <= 1 and r["primary"] is not None
    gates = result["designs"][design["name"]]["gates"]
    assert gates["passed"] is False and result["chosen"] is None  # a tiny random model passes no gate: recorded
    assert json.loads((tmp_path / "pilot_gates.json").read_text())["preregistration_sha256"] == \
        study_v3.preregistration_sha()
    with pytest.raises(SystemExit, match="no pilot design passed"):
        study_v3.main(["--stage", "main", "--out-dir", str(tmp_path)])


def synthetic_record(arm: str, seed: int, entropy: float, after: float = 0.9, complete: bool = True) -> dict:
    if not complete:
        return {"method": arm, "seed": seed, "complete": False, "log_tail": "torch.OutOfMemoryError", "exit_code": 1}
    curve = [{"step": s, "set_entropy": entropy, "set_logp_mean": math.log(0.8), "log_odds_abs_mean": 1.0,
              "log_odds_mean": 0.1 * s} for s in (0, 4, 8)]
    return {"method": arm, "seed": seed, "complete": True, "card": "H100", "versions": {"trl": "1.16.0"},
            "checkout": {"commit": "abc", "dirty": False}, "heldout": {"before": 0.1, "after": after},
            "drift": {"curve": curve},
            "series": {"cancellation/one_sided_groups": [[2, 0.2]], "diagnostics/clip_fraction_signal": [[2, 0.1]],
                       "transform/phi_mean": [[2, 0.9]], "drift/form_share/sum": [[1, 0.5], [5, 0.7]]}}


def test_aggregate_pairs_by_seed_and_counts_crashes(tmp_path: pathlib.Path) -> None:
    runs = tmp_path / "main" / "runs"
    runs.mkdir(parents=True)
    for seed in range(6):
        for arm in study_v3.ARMS:
            entropy = 0.5 + 0.01 * seed + (0.05 if arm == "mr_w" else 0.0) + 0.002 * (seed % 2) * (arm == "mr_w")
            record = synthetic_record(arm, seed, entropy, after=0.5 if (arm, seed) == ("gspo", 5) else 0.9,
                                      complete=(arm, seed) != ("mr_w_eq", 0))
            (runs / f"v3__{arm}__s{seed}.json").write_text(json.dumps(record))
    (tmp_path / "pilot_gates.json").write_text(json.dumps({"chosen": DESIGN["name"], "written_at": "2026-01-01",
                                                          "designs": {DESIGN["name"]: {"design": DESIGN,
                                                                                       "gates": {"passed": True}}}}))
    gates_bytes = (tmp_path / "pilot_gates.json").read_bytes()
    (tmp_path / "main" / "stage.json").write_text(json.dumps({
        "pilot_gates_sha256": study_v3.hashlib.sha256(gates_bytes).hexdigest(), "started_at": "2026-01-02"}))
    study = study_v3.aggregate(tmp_path, tmp_path / "study_v3.json", None)
    assert study["gates_before_main_unchanged"] is True
    primary = study["comparisons"]["mr_w - gspo"]["primary"]
    # the mass-weighted entropy is 0.8 × entropy at every step: mr_w − gspo = 0.8 × (0.05 + 0.002 on odd seeds)
    assert primary["all_pairs"]["n"] == 6 and primary["learned_pairs"]["n"] == 5  # gspo s5 did not learn
    assert primary["all_pairs"]["difference"] == pytest.approx(0.8 * 0.051, rel=1e-6)
    assert primary["all_pairs"]["low"] < primary["all_pairs"]["difference"] < primary["all_pairs"]["high"]
    assert study["arms"]["mr_w_eq"] == {**study["arms"]["mr_w_eq"], "runs": 6, "complete": 5, "crashed": 1}
    assert study["arms"]["gspo"]["learned"] == 5 and study["arms"]["gspo"]["set_mass_final_median"] == \
        pytest.approx(0.8, rel=1e-9)
    row = next(r for r in study["runs"] if r["arm"] == "mr_w_eq" and r["seed"] == 0)
    assert row["complete"] is False and "OutOfMemoryError" in row["crash"] and row["gates"] == {"passed": True}


def test_the_report_reads_its_numbers_from_the_results() -> None:
    """RESULTS §13 (reports/report_study_v3.py) states the primary comparison and its MDE as study_v3.json has them,
    and counts an equalised run as inert only when its drift curve is its strict twin's exactly."""
    from dfpo_bench.reports import report_study_v3

    results = study_v3.ROOT / "benchmarks" / "results"
    study = json.loads((results / "study_v3.json").read_text())
    primary = study["comparisons"]["mr_w - gspo"]["primary"]["all_pairs"]
    text = "\n".join(report_study_v3.study_v3_section(results, pathlib.Path("/tmp/dfpo-v3-figures"),
                                                     results.parent / "RESULTS.md", 13))
    assert report_study_v3.interval(primary) in text and f"{primary['mde']:.4f}" in text
    curve = [{"step": 0, "set_entropy_normalised": 0.9}, {"step": 2, "set_entropy_normalised": 0.5}]
    moved = [curve[0], {"step": 2, "set_entropy_normalised": 0.5000001}]
    runs = {("gspo", 1): {"drift": {"curve": curve}}, ("gspo_eq", 1): {"drift": {"curve": list(curve)}},
            ("gspo", 2): {"drift": {"curve": curve}}, ("gspo_eq", 2): {"drift": {"curve": moved}}}
    assert report_study_v3.control_inert(runs, "gspo", "gspo_eq") == (1, 2)
