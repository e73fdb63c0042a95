"""dfpo_bench.studies.study_v4: the committed registration is the script's (whole content hash), a stage refuses a
tampered registration before it loads anything, and the registered analysis and sample-size rule read planted values
back from trajectory files."""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import subprocess
import tarfile
from typing import Any

import pytest

from dfpo_bench.lib import record_layers  # noqa: E402
from dfpo_bench.lib.registration import file_sha256  # noqa: E402
from dfpo_bench.studies import branch_test, study_v4  # noqa: E402


def test_the_committed_registration_is_the_script_s() -> None:
    """Changing PREREGISTRATION without writing, hashing and committing the file again fails here (and the stage)."""
    assert study_v4.REGISTRATION_FILE.read_text(encoding="utf-8") == study_v4.preregistration_text()
    assert file_sha256(study_v4.REGISTRATION_FILE) == study_v4.REGISTRATION_SHA256
    assert json.loads(study_v4.REGISTRATION_FILE.read_text(encoding="utf-8")) == study_v4.PREREGISTRATION


def test_settings_are_the_registered_ones() -> None:
    main, control = study_v4.setting("main"), study_v4.setting("control")
    assert (main.staleness, control.staleness) == (4, 16)
    assert control.learning_rate > main.learning_rate and control.epsilon > main.epsilon
    config = control.config("min_replace", "/tmp/x", 0, use_cpu=True)
    assert config.steps_per_generation == 17 and config.gradient_accumulation_steps == 1
    assert config.group_transform == "min_replace" and config.lr_scheduler_type == "constant"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_stage_refuses_a_tampered_registration_before_loading_anything(tmp_path: pathlib.Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    path = repo / "preregistered.json"
    repo.mkdir()
    path.write_text(study_v4.preregistration_text(), encoding="utf-8")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "r"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    monkeypatch.setattr(study_v4, "REGISTRATION_FILE", path)
    monkeypatch.setattr(study_v4, "ROOT", repo)
    monkeypatch.setattr(study_v4, "REGISTRATION_SHA256", file_sha256(path))
    loaded: list[str] = []
    monkeypatch.setattr(study_v4, "load_model", lambda p: loaded.append(p))
    text = study_v4.preregistration_text().replace('"relative_effect": 0.02', '"relative_effect": 0.2')
    assert text != study_v4.preregistration_text()
    path.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="content SHA-256"):
        study_v4.main(["--stage", "pilot", "--model", "m", "--out-dir", str(out)])
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "t"],
                   check=True)
    with pytest.raises(SystemExit, match="content SHA-256"):  # committed, still not the registered content
        study_v4.main(["--stage", "pilot", "--model", "m", "--out-dir", str(out)])
    assert not loaded and not out.exists()


def point(imbalance: float, move: float, relative: float, staleness: int, probes: int = 3) -> dict[str, Any]:
    """A branch record whose oriented paired effect is ``relative`` × ``move`` (the policy moved towards form 0
    since the rollout; GSPO moves the odds by ``move``, Min-Replace by ``move`` less the effect)."""
    effect = relative * move
    return {"staleness": staleness, "identical_start": True,
            "terms": {"imbalance": imbalance, "removed_share": 2 * imbalance, "clipped_share": 0.1,
                      "advantage_mass": 1.0 if move else 0.0},
            "generation": {"log_odds": [0.5] * probes, "set_logp": [-1.0] * probes},
            "before": {"log_odds": [1.0] * probes, "set_logp": [-1.0] * probes},
            "arms": [{"transform": "none", "residual": 0.3, "grad_norm": 1.0,
                      "after": {"log_odds": [1.0 + move] * probes, "set_logp": [-0.9] * probes}},
                     {"transform": "min_replace", "residual": 0.0, "grad_norm": 0.9,
                      "after": {"log_odds": [1.0 + move - effect] * probes, "set_logp": [-0.95] * probes}}]}


def write(folder: pathlib.Path, name: str, seed: int, points: list[dict[str, Any]], complete: bool = True) -> None:
    path = folder / name / f"s{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"header": {"seed": seed}}, *points] + ([{"complete": True, "wall_s": 1.0}] if complete else [])
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_effects_read_the_oriented_paired_change() -> None:
    e = branch_test.effects(point(0.2, 0.1, 0.3, 4))
    assert e["oriented"] == pytest.approx(0.03, rel=1e-9) and e["gspo_move"] == pytest.approx(0.1, rel=1e-9)
    assert e["relative"] == pytest.approx(0.3, rel=1e-9) and e["set_logp"] == pytest.approx(0.05, rel=1e-9)
    flipped = point(0.2, 0.1, 0.3, 4)
    flipped["generation"]["log_odds"] = [1.5] * 3  # the policy moved towards form 1 since the rollout: sign flips
    assert branch_test.effects(flipped)["oriented"] == pytest.approx(-0.03, rel=1e-9)


def test_analysis_reads_back_a_planted_slope_the_gate_and_a_crash(tmp_path: pathlib.Path) -> None:
    """Effect = 0.8 × I (relative units), no intercept: the slope is 0.8 and its interval holds it; the control's
    imbalance at j = S is the gate value; a trajectory without its complete line is a crash, not data."""
    rng = random.Random(0)
    main = tmp_path / "main"
    for seed in range(4):
        # GSPO's own movement varies by point: the slope is on each point's own relative effect (as registered)
        write(main, "main", seed, [point(i := rng.uniform(0, 0.1), rng.uniform(0.02, 0.08), 0.8 * i, 1 + k % 4)
                                   for k in range(12)])
        write(main, "control", seed, [point(i := rng.uniform(0.05, 0.3), rng.uniform(0.02, 0.08), 0.8 * i,
                                            1 + k % 16) for k in range(16)])
        write(main, "main", 50 + seed, [point(0.0, 0.0, 0.0, 1)])  # no signal: counted, not analysed
    write(main, "main", 99, [point(0.5, 0.05, 0.0, 1)], complete=False)
    plan = {"settings": {"main": {"seeds": [*range(4), *range(50, 54), 99, 120]}, "control": {"seeds": [0, 1]}}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = study_v4.analyse(tmp_path)
    assert result["crashes"] == ["main/main/s99.jsonl"]  # relative: the analysis does not depend on where it ran
    assert result["coverage"] == {"main": {"planned": 10, "complete": 8, "crashed": 1, "not_started": 1},
                                  "control": {"planned": 2, "complete": 4, "crashed": 0, "not_started": 0}}
    assert result["provenance"] == [{"checkout": None, "registration": None, "card": None, "versions": None,
                                     "trajectories": 13}]
    columns = result["settings"]["main"]["point_columns"]
    assert len(columns["relative"]) == len(columns["imbalance"]) == len(columns["trajectory"]) == 48
    assert columns["relative"] == pytest.approx([0.8 * i for i in columns["imbalance"]], rel=1e-9)
    assert result["settings"]["main"]["aa_points"] == 0
    assert set(columns["residual_none"]) == {0.3} and set(columns["residual_min_replace"]) == {0.0}
    crashed = result["sensitivity_with_crashed_points"]  # the crash's one point (effect 0) joins only here
    assert crashed["items"] == result["settings"]["main"]["points"] + 1
    assert crashed["value"] < result["settings"]["main"]["primary_relative"]["value"]
    assert result["settings"]["main"]["points"] == 48 and result["settings"]["main"]["no_signal_points"] == 4
    assert result["slope"]["value"] == pytest.approx(0.8, rel=1e-9)
    assert result["slope"]["low"] == pytest.approx(0.8, rel=1e-6) and result["intercept"]["value"] == pytest.approx(
        0.0, abs=1e-9)
    gate = result["settings"]["control"]["gate"]
    assert gate["min"] == 0.10 and gate["value"] is not None and gate["passed"] == (gate["value"] >= 0.10)
    assert result["settings"]["main"]["residual"] == {"none": 0.3, "min_replace": 0.0}
    assert result["settings"]["main"]["grad_norm_ratio"] == pytest.approx(0.9, rel=1e-9)
    primary = result["settings"]["main"]["primary_relative"]
    assert primary["low"] <= primary["value"] <= primary["high"] and primary["value"] > 0


def test_the_sample_size_rule_asks_for_more_points_when_the_pilot_is_noisier(tmp_path: pathlib.Path) -> None:
    def pilot(noise: float, folder: pathlib.Path) -> dict[str, Any]:
        rng = random.Random(1)
        for seed in range(3):
            write(folder / "pilot", "main", seed, [point(0.05, 0.05, rng.gauss(0.0, noise), 1) for _ in range(20)])
        return study_v4.plan(folder)["settings"]["main"]

    quiet, noisy = pilot(0.05, tmp_path / "a"), pilot(0.5, tmp_path / "b")
    assert 200 <= quiet["points"] < noisy["points"] <= 1000
    assert quiet["deff"] >= 2 and quiet["trajectories"] == -(-quiet["points"] // 20)
    assert quiet["seeds"][0] == 100


def test_main_needs_the_pilot_s_plan_and_cpu_pilot_its_own_seeds(tmp_path: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(study_v4, "admitted", lambda: {"clean": True})
    ran: list[tuple[str, str, int]] = []
    monkeypatch.setattr(study_v4, "run_one", lambda args, stage, name, seed, state: ran.append((stage, name, seed)))
    with pytest.raises(SystemExit, match="run --stage pilot first"):
        study_v4.main(["--stage", "main", "--model", "m", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs --cpu and --seeds"):
        study_v4.main(["--stage", "cpu-pilot", "--model", "m", "--out-dir", str(tmp_path)])
    (tmp_path / "plan.json").write_text(json.dumps({"registration_sha256": study_v4.REGISTRATION_SHA256, "settings": {
        "main": {"seeds": [100, 101]}, "control": {"error": "fewer than 3 pilot branch points"}}}))
    study_v4.main(["--stage", "main", "--model", "m", "--out-dir", str(tmp_path)])
    assert ran == [("main", "main", 100), ("main", "main", 101)]


def test_a_trajectory_is_claimed_by_one_process_only(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "main" / "main" / "s100.jsonl"
    assert study_v4.claim(path) and not study_v4.claim(path)
    monkeypatch.setattr(study_v4, "admitted", lambda: {"clean": True})
    ran: list[int] = []
    monkeypatch.setattr(study_v4, "run_one", lambda args, stage, name, seed, state: ran.append(seed))
    (tmp_path / "plan.json").write_text(json.dumps({"registration_sha256": study_v4.REGISTRATION_SHA256, "settings": {
        "main": {"seeds": [100, 101]}}}))
    study_v4.main(["--stage", "main", "--model", "m", "--out-dir", str(tmp_path)])
    assert ran == [101]  # 100 was claimed (by "another process")


def test_the_pilot_plans_only_once_every_trajectory_has_finished(tmp_path: pathlib.Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(study_v4, "admitted", lambda: {"clean": True})
    monkeypatch.setattr(study_v4, "run_one", lambda args, stage, name, seed, state: None)
    planned: list[pathlib.Path] = []
    monkeypatch.setattr(study_v4, "plan", lambda out: planned.append(out))
    for name in study_v4.PREREGISTRATION["settings"]:
        for seed in study_v4.PREREGISTRATION["pilot_seeds"]:
            write(tmp_path / "pilot", name, seed, [], complete=not (name == "control" and seed == 2))
    study_v4.main(["--stage", "pilot", "--model", "m", "--out-dir", str(tmp_path)])
    assert not planned  # control s2 still running (or cut off): no plan yet
    with (tmp_path / "pilot" / "control" / "s2.jsonl").open("a") as out:
        out.write(json.dumps({"crash": "RuntimeError: CUDA out of memory"}) + "\n")
    study_v4.main(["--stage", "pilot", "--model", "m", "--out-dir", str(tmp_path)])
    assert planned == [tmp_path]


RECORDS = study_v4.RESULTS / "gpu_2026-11-29"  # records.tgz, then a records_N.tgz layer per later session
ANALYSIS = study_v4.ROOT / "benchmarks" / "results" / "study_v4.json"


def assert_numbers_close(got: Any, want: Any, path: str = "") -> None:
    """Equal structure and strings; floats to 1e-9 relative (1e-12 absolute near 0). The sums run over at most 1000
    points of size about 1 in another order on another machine (the last bits differ), far inside either bound."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_numbers_close(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_numbers_close(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), path
    else:
        assert got == want, path


def device_numbers_agree(device: dict[str, Any], here: dict[str, Any]) -> None:
    """Every number an analysis written on the GPU machine holds equals the one ``here`` (an older device analysis
    lacks columns added since, so only its own keys are compared)."""
    assert_numbers_close(device, {k: v for k, v in here.items() if k in device} | {"settings": {
        name: {k: v for k, v in entry.items() if k in device["settings"][name]}
        for name, entry in here["settings"].items()}})


@pytest.mark.slow
def test_the_committed_analysis_is_the_gpu_records_analysed(tmp_path: pathlib.Path) -> None:
    """results/study_v4.json is ``--analyse`` of the GPU run's trajectory files as committed (every layer unpacked in
    order), and it equals the analysis the GPU machine wrote at the end of the last session (study_v4.json in the
    records). Each earlier session's records, its layer and those before it, analysed here equal the analysis the
    machine wrote then on every number it holds (the first session's study_v4_device.json, written before the
    coverage, provenance and point columns were added; each later session's study_v4.json)."""
    layers = record_layers.layers(RECORDS)
    assert [p.name for p in layers] == ["records.tgz", "records_2.tgz", "records_3.tgz", "records_4.tgz"]
    sessions = tmp_path / "sessions"  # the layers extracted one by one, each session's records in turn
    for k, layer in enumerate(layers):
        with tarfile.open(layer) as tar:
            tar.extractall(sessions, filter="data")
        here = study_v4.analyse(sessions)
        device_numbers_agree(json.loads((sessions / ("study_v4_device.json" if k == 0 else "study_v4.json"))
                                        .read_text()), here)
    record_layers.unpack(RECORDS, tmp_path / "all")  # the tool gives the same folder: ``here`` is its analysis
    files = sorted(p.relative_to(tmp_path / "all") for p in (tmp_path / "all").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(sessions) for p in sessions.rglob("*") if p.is_file())
    assert all((tmp_path / "all" / f).read_bytes() == (sessions / f).read_bytes() for f in files)
    committed = json.loads(ANALYSIS.read_text())
    assert_numbers_close(here, committed)
    assert_numbers_close(json.loads((sessions / "study_v4.json").read_text()), committed)
    assert committed["crashes"] == [] and all(c["crashed"] == 0 == c["not_started"] and c["complete"] == c["planned"]
                                              for c in committed["coverage"].values())
    assert committed["coverage"]["main"]["complete"] == 35 == sum(r["trajectories"] for r in committed["provenance"]
                                                                  ) - committed["coverage"]["control"]["complete"]
