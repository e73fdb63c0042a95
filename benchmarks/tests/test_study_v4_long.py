"""dfpo_bench.studies.study_v4_long and its task: the two forms have equal token length, the reward ignores the form
and gives a wrong sum 0 in either form; the committed registration is the script's and a stage refuses a tampered or
uncommitted one; the warm-start gate refuses the arms; the seed rule's numbers by hand; the analysis on synthetic
records (AUC by hand, the paired interval, a crash counted as a crash); the SFT loop and the gate on a tiny model."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
from typing import Any

import pytest
import torch

from dfpo_bench import study_v4_tasks
from dfpo_bench.lib import common, record_layers
from dfpo_bench.lib.registration import file_sha256
from dfpo_bench.reports import report_study_v4_long
from dfpo_bench.studies import study_v4_long as v4l


# ------------------------------------------------------------------------------------------------ the task
@pytest.mark.slow
def test_both_forms_have_equal_token_length_under_smollm2_s_tokenizer() -> None:
    """The embedded model's tokenizer (its converted checkpoint, converted here on first use, about 25 s on 2 cores;
    no model load): every sum 0..198 and a few wrong ones. It used to be skipped unless ~/.cache already held the
    conversion when the tests were collected, which a fresh CI machine never does."""
    from dfpo_trl.cli import embedded_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    for s in [*range(199), 1000, -3]:
        lengths = [len(tokenizer(f.format(s=s), add_special_tokens=False)["input_ids"]) for f in study_v4_tasks.FORMS]
        assert lengths[0] == lengths[1], (s, lengths)


def test_the_reward_ignores_the_form_and_a_wrong_sum_gets_zero_in_either_form() -> None:
    task = study_v4_tasks.two_digit()
    reward = task.reward_funcs[0]
    row = task.build_dataset("test", 1)[0]
    right = study_v4_tasks.forms_of(row)
    wrong = [f.format(s=row["answer"] + 1) for f in study_v4_tasks.FORMS]
    texts = [*right, *wrong, f"{row['answer']}", f"So it is {row['answer']}."]
    got = reward(prompts=[row["prompt"]] * len(texts), completions=texts, answer=[row["answer"]] * len(texts))
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    conversational = [[{"role": "assistant", "content": t}] for t in right]
    assert reward(prompts=[row["prompt"]] * 2, completions=conversational, answer=[row["answer"]] * 2) == [1.0, 1.0]
    assert [task.written_form(t) for t in texts] == [0, 1, 0, 1, None, None]
    assert [task.form_of(t, row) for t in texts[:4]] == [0, 1, None, None]


def test_splits_are_two_digit_the_heldout_fixed_and_never_trained_on() -> None:
    task = study_v4_tasks.two_digit()
    held = {(r["a"], r["b"]) for r in task.build_dataset("test")}
    assert len(held) == study_v4_tasks.HELDOUT_SIZE
    train = task.build_dataset("train", 300, seed=3)
    assert all(10 <= r["a"] <= 99 and 10 <= r["b"] <= 99 and r["answer"] == r["a"] + r["b"] for r in train)
    sft = study_v4_tasks.sft_examples(384)
    assert not held & {(r["a"], r["b"]) for r in train} and not held & {(e["a"], e["b"]) for e in sft}
    assert sum(e["form"] == 0 for e in sft) == 192 and [e["form"] for e in sft[:4]] == [0, 1, 0, 1]
    assert all(sft[k]["prompt"] == sft[k + 1]["prompt"] and sft[k]["completion"] != sft[k + 1]["completion"]
               for k in range(0, 384, 2))  # every problem in both forms
    assert train["a"] != task.build_dataset("train", 300, seed=4)["a"]
    with pytest.raises(ValueError, match="even"):
        study_v4_tasks.sft_examples(3)


# ------------------------------------------------------------------------------------------------ registration
def test_the_committed_registration_is_the_script_s() -> None:
    assert v4l.REGISTRATION_FILE.read_text(encoding="utf-8") == v4l.preregistration_text()
    assert file_sha256(v4l.REGISTRATION_FILE) == v4l.REGISTRATION_SHA256


def git(repo: pathlib.Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_every_stage_refuses_a_tampered_or_uncommitted_registration(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    repo, out = tmp_path / "repo", tmp_path / "out"
    path = repo / "preregistered_long.json"
    repo.mkdir()
    path.write_text(v4l.preregistration_text(), encoding="utf-8")
    monkeypatch.setattr(v4l, "REGISTRATION_FILE", path)
    monkeypatch.setattr(v4l, "ROOT", repo)
    monkeypatch.setattr(v4l, "REGISTRATION_SHA256", file_sha256(path))
    started: list[Any] = []
    monkeypatch.setattr(v4l, "warmstart_one", lambda *a: started.append(a))
    monkeypatch.setattr(common, "launch", lambda *a, **k: started.append(a))
    git(repo, "init", "-q")
    stages = [["--stage", "warmstart", "--model", "m"], ["--stage", "pilot"], ["--stage", "main"], ["--plan", str(out)]]
    for stage in stages:  # untracked
        with pytest.raises(SystemExit, match="not tracked"):
            v4l.main([*stage, "--out-dir", str(out)])
    git(repo, "add", ".")
    for stage in stages:  # staged, not committed
        with pytest.raises(SystemExit, match="uncommitted"):
            v4l.main([*stage, "--out-dir", str(out)])
    git(repo, "commit", "-qm", "r")
    path.write_text(v4l.preregistration_text().replace('"mde": 0.05', '"mde": 0.5'), encoding="utf-8")
    git(repo, "commit", "-qam", "t")
    for stage in stages:  # committed, not the registered content
        with pytest.raises(SystemExit, match="content SHA-256"):
            v4l.main([*stage, "--out-dir", str(out)])
    assert not started and not out.exists()


# ------------------------------------------------------------------------------------------------ the gate
def test_the_gate_s_thresholds_and_the_arms_refused_without_a_passed_gate(tmp_path: pathlib.Path) -> None:
    assert v4l.gate_result(0.95, 0.5)["passed"] and not v4l.gate_result(0.949, 0.9)["passed"]
    assert not v4l.gate_result(0.99, 0.49)["passed"]
    with pytest.raises(SystemExit, match="warmstart first"):
        v4l.require_gate(tmp_path, force=False)
    (tmp_path / "warmstart").mkdir()
    chosen = {"registration_sha256": v4l.REGISTRATION_SHA256, "passed": False, "model": None}
    (tmp_path / "warmstart" / "chosen.json").write_text(json.dumps(chosen))
    with pytest.raises(SystemExit, match="gate did not pass"):
        v4l.require_gate(tmp_path, force=False)
    forced = v4l.require_gate(tmp_path, force=True)
    assert forced["forced"] and "did not pass" in forced["refusal"]
    (tmp_path / "warmstart" / "chosen.json").write_text(json.dumps({**chosen, "registration_sha256": "other"}))
    with pytest.raises(SystemExit, match="another registration"):
        v4l.require_gate(tmp_path, force=False)
    (tmp_path / "warmstart" / "chosen.json").write_text(json.dumps({**chosen, "passed": True, "model": "m"}))
    assert not v4l.require_gate(tmp_path, force=False)["forced"]


def test_the_warm_start_takes_the_first_passing_schedule_entry_and_records_crashes(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(v4l, "admitted", lambda: {"sha256": "x"})
    calls: list[int] = []  # the schedule 1, 2, 4, 8: 1 crashes, 2 passes, 4 and 8 are never tried

    def fake(args: Any, epochs: int, state: Any) -> dict[str, Any]:
        calls.append(epochs)
        if epochs == 1:
            return {"complete": False, "gate": None, "crash": "RuntimeError"}
        return {"complete": True, "gate": v4l.gate_result(0.97 if epochs == 2 else 0.5, 0.8)}

    monkeypatch.setattr(v4l, "warmstart_one", fake)
    result = v4l.main(["--stage", "warmstart", "--model", "m", "--out-dir", str(tmp_path)])
    assert calls == [1, 2] and result["passed"] and result["model"].endswith("e2/model")
    assert [t["complete"] for t in result["tried"]] == [False, True]


def test_the_sft_loop_and_the_gate_run_on_a_tiny_model(tmp_path: pathlib.Path) -> None:
    """The tiny model's word-level vocabulary lacks most of the forms' words (they read as padding): this checks the
    loop, the masking and the gate's plumbing, not the numbers."""
    from dfpo_trl.testing import save_tiny_chat_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_chat_model(tmp_path / "tiny")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tokenizer.eos_token = "<eos>"
    examples = study_v4_tasks.sft_examples(8)
    batches = v4l.sft_batches(tokenizer, examples)
    assert all(ids[-1] == tokenizer.eos_token_id and 0 < cut < len(ids) for ids, cut in batches)
    losses = v4l.sft(model, tokenizer, examples, epochs=3, batch_size=4, lr=1e-2, seed=0, device="cpu")
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert not torch.are_deterministic_algorithms_enabled()  # the SFT's deterministic kernels end with it
    replay = AutoModelForCausalLM.from_pretrained(path)
    assert v4l.sft(replay, tokenizer, examples, epochs=3, batch_size=4, lr=1e-2, seed=0, device="cpu") == losses
    assert v4l.weights_sha256(replay) == v4l.weights_sha256(model)  # laid again, the same start
    gate = v4l.measure_gate(model, tokenizer, "cpu", prompts=6, samples=3)  # the registered 64 x 8 on the GPU
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert v4l.weights_sha256(again) == v4l.weights_sha256(model)  # the start's identity survives a save and load
    with torch.no_grad():
        next(again.parameters()).view(-1)[0] += 1e-6  # one weight, one step of float32 at this size
    assert v4l.weights_sha256(again) != v4l.weights_sha256(model)
    assert 0 <= gate["set_entropy_normalised"] <= 1 + 1e-9 and gate["samples"] == 18 and gate["prompts"] == 6
    assert gate["passed"] == v4l.gate_result(gate["set_entropy_normalised"], gate["format_mass"])["passed"]


def test_the_gate_reads_the_checkpoint_reloaded_from_disk_as_the_arms_load_it(tmp_path: pathlib.Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Revision 2: the warm start loads the base model, trains, saves, then loads the saved checkpoint afresh (float32,
    the arms' precision) and reads the gate on that model, not on the one it trained in memory."""
    import argparse

    from dfpo_trl.testing import save_tiny_chat_model

    from dfpo_bench.studies import study_v4

    base = save_tiny_chat_model(tmp_path / "tiny")
    loaded: list[tuple[str, Any]] = []
    real_load = study_v4.load_model

    def load(path: str) -> tuple[Any, Any]:
        model, tokenizer = real_load(path)
        loaded.append((str(path), model))
        return model, tokenizer

    measured: list[Any] = []

    def gate(model: Any, tokenizer: Any, device: str) -> dict[str, Any]:
        measured.append(model)
        return {**v4l.gate_result(0.97, 0.9), "set_logp_mean": -0.3}

    def train(model: Any, *args: Any) -> list[float]:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1.0  # the SFT's change, which the reload must carry
        return [1.0]

    monkeypatch.setattr(study_v4, "load_model", load)
    monkeypatch.setattr(v4l, "measure_gate", gate)
    monkeypatch.setattr(v4l, "sft", train)
    args = argparse.Namespace(model=str(base), out_dir=str(tmp_path / "out"), cpu=True)
    record = v4l.warmstart_one(args, 1, {"sha256": "x"})
    assert record["complete"] and record["gate"]["passed"]
    assert [p for p, _ in loaded] == [str(base), str(tmp_path / "out" / "warmstart" / "e1" / "model")]
    trained, reloaded = loaded[0][1], loaded[1][1]
    assert measured == [reloaded] and reloaded is not trained
    assert next(reloaded.parameters()).dtype == torch.float32
    assert record["weights_sha256"] == v4l.weights_sha256(reloaded) == v4l.weights_sha256(trained)


def test_the_pilot_gate_stops_when_a_run_s_own_step_0_reading_is_below_the_start_threshold(
        tmp_path: pathlib.Path) -> None:
    pilot = tmp_path / "pilot"
    for s in range(6):
        for arm in v4l.ARMS:
            write(pilot, record(arm, s, [(0, 0.876 if (s, arm) == (3, "gspo") else 0.97), (300, 0.3 + 0.01 * s)]))
    plan = v4l.plan(tmp_path)
    assert not plan["go"] and "step-0 normalised set entropy (0.876" in plan["reason"]
    write(pilot, record("gspo", 3, [(0, 0.96), (300, 0.33)]))
    assert v4l.plan(tmp_path)["go"]


# ------------------------------------------------------------------------------------------------ the plan rule
def test_a_stage_refuses_a_warm_start_other_than_the_one_its_earlier_runs_started_from(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later session lays the warm start again: if its weights' hash differs from the one the pilot's runs
    recorded, neither the pilot nor the main stage launches anything (runs from two starts are never paired)."""
    monkeypatch.setattr(v4l, "admitted", lambda: {"sha256": "x"})
    monkeypatch.setattr(v4l, "run_provenance", lambda *a: {})
    launched: list[Any] = []
    monkeypatch.setattr(v4l.common, "launch", lambda *a, **k: launched.append(a))
    (tmp_path / "warmstart").mkdir()
    chosen = {"registration_sha256": v4l.REGISTRATION_SHA256, "passed": True, "model": "m", "weights_sha256": "a" * 64}
    (tmp_path / "warmstart" / "chosen.json").write_text(json.dumps(chosen))
    v4l.main(["--stage", "pilot", "--out-dir", str(tmp_path)])  # the first launch records the start
    assert len(launched) == 1
    stage = json.loads((tmp_path / "pilot" / "stage.json").read_text())
    assert stage["warmstart"]["weights_sha256"] == "a" * 64
    (tmp_path / "warmstart" / "chosen.json").write_text(json.dumps({**chosen, "weights_sha256": "b" * 64}))
    with pytest.raises(SystemExit, match="started from warm-start weights aaaaaaaaaaaa"):
        v4l.main(["--stage", "pilot", "--out-dir", str(tmp_path)])
    assert len(launched) == 1 and json.loads((tmp_path / "pilot" / "stage.json").read_text()) == stage


def test_the_seed_rule_by_hand() -> None:
    """MDE_t(n) = (t_.975,n−1 + t_.8,n−1) σ / √n with σ = 3.3 × the pilot SD. Tables: df 18: 2.101 + 0.862 = 2.963,
    df 19: 2.093 + 0.861 = 2.954. σ = 0.0746: n = 19 gives 2.963 × 0.0746 / √19 = 0.0507 > 0.05, n = 20 gives
    2.954 × 0.0746 / √20 = 0.0493 ≤ 0.05, so 20 seeds. A tiny SD gives the floor 10; a large one the cap 48."""
    rule = v4l.seeds_for(0.0746 / 3.3)
    assert rule["n"] == 20 and rule["planning_sd"] == pytest.approx(0.0746)
    assert rule["mde_at_n"] == pytest.approx(2.954 * 0.0746 / math.sqrt(20), abs=2e-4) and not rule["capped"]
    assert v4l.seeds_for(0.001)["n"] == 10
    big = v4l.seeds_for(0.1)
    assert big["n"] == 48 and big["capped"] and big["mde_at_n"] > 0.05


# ------------------------------------------------------------------------------------------------ analysis
def record(arm: str, seed: int, entropy: list[tuple[int, float]], complete: bool = True,
           reward: float = 0.5) -> dict[str, Any]:
    if not complete:
        return {"task": v4l.TASK, "method": arm, "seed": seed, "complete": False, "exit_code": 1, "log_tail": "OOM"}
    drift = [{"step": s, "set_entropy_normalised": v, "set_logp_mean": math.log(0.5)} for s, v in entropy]
    return {"task": v4l.TASK, "method": arm, "seed": seed, "complete": True, "steps": 300, "drift": {"curve": drift},
            "heldout": {"after": 0.5}, "series": {"step_reward": [[s, reward] for s in range(1, 31)]}}


def test_the_checkouts_are_listed_in_the_order_the_sessions_ran() -> None:
    """The card line says one checkout per session, so they come in session order (the pilot's first, then the
    main stage's by the lowest seed each ran), not in the order of their commit hashes; a repeat is listed once."""
    def row(seed: int, commit: str) -> dict[str, Any]:
        return {"seed": seed, "card": "H200", "checkout": {"commit": commit}}
    pilot = [row(1, "f0"), row(0, "f0")]
    main = [row(120, "a2"), row(101, "c1"), row(100, "f0"), row(129, "0b"), row(121, "a2")]
    order = [json.loads(k)["checkout"]["commit"] for k in v4l.checkouts_in_order(pilot, main)]
    assert order == ["f0", "c1", "a2", "0b"]


def write(folder: pathlib.Path, rec: dict[str, Any]) -> None:
    path = folder / "runs" / f"v4l__{rec['method']}__s{rec['seed']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))


def test_the_area_by_hand() -> None:
    # steps 0, 10, 30 with 1.0, 0.8, 0.2: (10 × 0.9 + 20 × 0.5) / 30 = 19 / 30
    assert v4l.area([(0, 1.0), (10, 0.8), (30, 0.2)]) == pytest.approx(19 / 30)
    assert v4l.area([(0, 1.0)]) is None


def test_the_analysis_reads_planted_areas_pairs_them_and_counts_a_crash(tmp_path: pathlib.Path) -> None:
    """Per seed s: gspo's entropy falls 1 → e_s linearly (area (1 + e_s) / 2), mr_w's 1 → e_s + δ_s; the primary is
    mean δ_s with the paired t interval; one mr_w seed crashed (counted, its pair left out)."""
    main = tmp_path / "main"
    finals = {100: 0.2, 101: 0.4, 102: 0.3, 103: 0.5}
    gaps = {100: 0.10, 101: 0.04, 102: 0.08, 103: 0.02}
    for s, e in finals.items():
        write(main, record("gspo", s, [(0, 1.0), (150, (1 + e) / 2), (300, e)]))
        write(main, record("anchor", s, [(0, 1.0), (300, e + 0.2)]))
        write(main, record("mr_w", s, [(0, 1.0), (300, e + gaps[s])], complete=s != 103))
    out = v4l.analyse(tmp_path)
    assert out["arms"]["mr_w"] == {"runs": 4, "complete": 3, "crashed": [103]}
    prim = out["primary"]
    d = [gaps[s] / 2 for s in (100, 101, 102)]  # the area of a line is its mean: a gap δ at the end adds δ / 2
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = 4.303 * sd / math.sqrt(3)  # t_.975 at 2 df
    assert prim["n"] == 3 and prim["difference"] == pytest.approx(mean)
    assert (prim["low"], prim["high"]) == (pytest.approx(mean - half, abs=1e-4), pytest.approx(mean + half, abs=1e-4))
    anchor = out["comparisons"]["primary"]["anchor - gspo"]
    assert anchor["difference"] == pytest.approx(0.1) and anchor["n"] == 4
    assert prim["low"] < 0 < prim["high"] and out["primary_wording"] == "not detected above the MDE reached"
    crash = next(r for r in out["runs"] if r["arm"] == "mr_w" and r["seed"] == 103)
    assert not crash["complete"] and "primary" not in crash


def test_the_start_check_sets_the_runs_step_0_beside_the_gate_and_rereads_the_threshold(tmp_path: pathlib.Path
                                                                                        ) -> None:
    """The gate read 0.97 in the warm-start process; the pilot's runs read 0.97 at step 0 (the threshold holds), the
    main stage's 0.87 (it does not, and the gap is their mean less the gate's)."""
    for s in (100, 101):
        for arm in v4l.ARMS:
            write(tmp_path / "pilot", record(arm, s - 100, [(0, 0.97), (300, 0.5)]))
            write(tmp_path / "main", record(arm, s, [(0, 0.87), (300, 0.5)]))
    gate = {"set_entropy_normalised": 0.97, "set_logp_mean": -0.3, "log_odds_mean": 0.0, "sampled_reward_mean": 0.8,
            "passed": True}
    stage = {"registration_sha256": v4l.REGISTRATION_SHA256, "warmstart": {"tried": [
        {"epochs": 1, "complete": True, "gate": {**gate, "set_entropy_normalised": 0.9, "passed": False}},
        {"epochs": 2, "complete": True, "gate": gate}]}}
    (tmp_path / "main" / "stage.json").write_text(json.dumps(stage))
    (tmp_path / "plan.json").write_text(json.dumps({"seeds": [100, 101, 102]}))
    out = v4l.analyse(tmp_path)
    check = out["start_check"]
    assert check["gate"]["set_entropy_normalised"] == 0.97 and check["threshold"] == 0.95
    assert check["stages"]["pilot"]["threshold_reread_passed"]
    main = check["stages"]["main"]
    assert not main["threshold_reread_passed"] and main["runs"] == 6 and main["distinct_step0_entropy"] == 1
    assert main["entropy_gap_to_gate"] == pytest.approx(-0.10)
    assert main["step0_set_logp_min"] == pytest.approx(math.log(0.5))
    assert out["coverage"] == {"planned": 9, "complete": 6, "crashed": 0, "not_started": 3,
                               "complete_pairs_primary": 2}
    assert out["registration_sha256"] == v4l.REGISTRATION_SHA256 and out["registration_is_current"]
    assert out["preregistered"] == json.loads(v4l.REGISTRATION_FILE.read_text(encoding="utf-8"))
    assert [p["step"] for p in out["curves"]["gspo"]] == [0, 300] and out["curves"]["gspo"][0]["n"] == 2


def test_the_residual_is_split_by_whether_a_row_of_the_step_was_clipped(tmp_path: pathlib.Path) -> None:
    rec = record("mr_w", 100, [(0, 1.0), (300, 0.5)])
    rec["series"].update({"cancellation/shared_prefix_residual": [[1, 0.0], [2, 0.4], [3, 1e-8], [4, 0.6]],
                          "clip_ratio/region_mean": [[1, 0.0], [2, 0.25], [3, 0.0], [4, 0.5]]})
    write(tmp_path / "main", rec)
    split = v4l.analyse(tmp_path)["residual_by_clipping"]["mr_w"]
    assert split["unclipped"] == {"steps": 2, "mean": pytest.approx(5e-9), "max": 1e-8}
    assert split["clipped"] == {"steps": 2, "mean": pytest.approx(0.5), "max": 0.6}


def test_the_analysis_names_the_registration_its_records_admitted(tmp_path: pathlib.Path) -> None:
    """A record folder that admitted some other registration gets no design read from the current one."""
    write(tmp_path / "main", record("gspo", 100, [(0, 1.0), (300, 0.5)]))
    (tmp_path / "main" / "stage.json").write_text(json.dumps({"registration_sha256": "0" * 64}))
    out = v4l.analyse(tmp_path)
    assert out["registration_sha256"] == "0" * 64 and not out["registration_is_current"]
    assert out["preregistered"] is None


RESULTS = v4l.ROOT / "benchmarks" / "results"
RUNS = {folder: analysis for analysis, folder, _ in report_study_v4_long.RUNS}  # the report's: run folder -> analysis
CURRENT = report_study_v4_long.RUNS[0][0]  # the current registration's analysis comes first


@pytest.mark.slow  # 1-3 s each here (2 cores): unpacks up to 27 MB of layers and reads up to 162 run records
@pytest.mark.parametrize("run", sorted(RUNS))
def test_the_committed_analysis_is_the_gpu_records_analysed(tmp_path: pathlib.Path, run: str) -> None:
    """Each committed analysis is ``--analyse`` of the run folder committed in its records (records.tgz and any later
    layers, unpacked in order), to 1e-9 relative (sums over at most 300 steps of values about 1, in another order on
    another machine)."""
    from test_study_v4 import assert_numbers_close

    record_layers.unpack(RESULTS / run, tmp_path)
    folder = tmp_path / "tmp" / "v4long"
    committed = json.loads((RESULTS / RUNS[run]).read_text())
    assert_numbers_close(json.loads(json.dumps(v4l.analyse(folder))), committed)
    assert committed["coverage"]["crashed"] == 0
    assert committed["registration_is_current"] is (RUNS[run] == CURRENT)


def test_runs_at_a_time_reads_each_launch_of_a_stage_log(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "main.log"
    assert v4l.runs_at_a_time(log) == []
    log.write_text("18 runs to do (0 already done), 9 at a time on each of GPUs [0] (NVIDIA H200)\n"
                   "[     0s] start v4l__anchor__s0 on GPU 0 (attempt 1)\n"
                   "6 runs to do (12 already done), 3 at a time on each of GPUs [0] (NVIDIA H200)\n"
                   "33 runs to do (111 already done), 9 at a time on each of GPUs [0, 1] (NVIDIA H200)\n")
    assert v4l.runs_at_a_time(log) == ["9", "3", "18 (9 on each of 2 GPUs)"]


def test_the_plan_stops_on_a_failed_pilot_gate_and_main_refuses(tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pilot = tmp_path / "pilot"
    for s in range(6):
        for arm in v4l.ARMS:
            write(pilot, record(arm, s, [(0, 1.0), (300, 0.3 + 0.01 * s * (arm == "mr_w"))], reward=0.95))
    plan = v4l.plan(tmp_path)
    assert not plan["go"] and "outside" in plan["reason"] and plan["complete"] == {a: 6 for a in v4l.ARMS}
    monkeypatch.setattr(v4l, "admitted", lambda: {"sha256": "x"})
    (tmp_path / "warmstart").mkdir()
    (tmp_path / "warmstart" / "chosen.json").write_text(json.dumps(
        {"registration_sha256": v4l.REGISTRATION_SHA256, "passed": True, "model": "m"}))
    with pytest.raises(SystemExit, match="plan says stop"):
        v4l.main(["--stage", "main", "--out-dir", str(tmp_path)])
    for s in range(6):  # a half-solved pilot: the plan goes, the seeds from the paired SD
        for arm in v4l.ARMS:
            write(pilot, record(arm, s, [(0, 1.0), (300, 0.3 + 0.01 * s * (arm == "mr_w"))], reward=0.5))
    plan = v4l.plan(tmp_path)
    assert plan["go"] and plan["seeds"][0] == 100 and len(plan["seeds"]) == plan["rule"]["n"]
    assert plan["rule"]["pilot_sd"] == pytest.approx(plan["pilot_primary_pair"]["sd"])


def test_arm_flags_give_the_anchor_the_stale_arms_completions_per_step() -> None:
    def flag(arm: str, name: str) -> str:
        flags = v4l.arm_flags(arm)
        return flags[flags.index(name) + 1]

    for arm in v4l.ARMS:
        assert flag(arm, "--per_device_train_batch_size") == "32" and flag(arm, "--gradient_accumulation_steps") == "1"
        assert flag(arm, "--loss_type") == "dr_grpo"
        assert flag(arm, "--bf16") == "false"  # revision 2: the arms train the float32 policy the gate read
    assert [flag(a, "--steps_per_generation") for a in v4l.ARMS] == ["1", "4", "4"]
    assert [flag(a, "--group_transform") for a in v4l.ARMS] == ["none", "none", "min_replace"]


@pytest.mark.slow  # about 22 s on the 2-core CPU machine: three dfpo-train runs of 2 steps in this process
def test_every_arm_trains_through_dfpo_train_on_a_tiny_model(tmp_path: pathlib.Path) -> None:
    """The arms' flags, the task's import path and dr_grpo with the sequence ratio and Min-Replace are accepted by
    dfpo-train: 2 steps each on the tiny model (the smoke flags shrink the batch)."""
    model = common.smoke_model(tmp_path)
    for arm in v4l.ARMS:
        argv = [str(common.RECIPE), "--task", v4l.TASK, "--seed", "0", "--output_dir", str(tmp_path / arm),
                "--max_steps", "2", "--save_model", "false", "--plot", "false", "--disable_tqdm", "true",
                *v4l.arm_flags(arm), "--model_name_or_path", model, *common.SMOKE_FLAGS, "--drift_every", "1",
                "--eval_every", "0", "--drift_size", "2"]
        summary = common.train_in_process(argv, tmp_path / arm)
        assert summary["steps"] == 2 and [d["step"] for d in summary["drift"]["curve"]] == [0, 1, 2]
        row = v4l.run_row({**common.compact_record(summary, {"seed": 0}), "complete": True}, arm)
        assert row["primary"] is not None and row["step0_entropy"] is not None


def test_the_replayed_warm_start_is_compared_entry_by_entry(tmp_path: pathlib.Path) -> None:
    assert v4l.warmstart_replay(tmp_path) is None  # no replay ran
    for folder, entry, sha in (("warmstart", "e1", "aa"), ("warmstart", "e2", "bb"),
                               ("replay/warmstart", "e1", "aa"), ("replay/warmstart", "e2", "bc")):
        path = tmp_path / folder / entry / "warmstart.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"header": {}}) + "\n" + json.dumps({"weights_sha256": sha}) + "\n")
    replay = v4l.warmstart_replay(tmp_path)
    assert replay["entries"]["e1"]["identical"] and not replay["entries"]["e2"]["identical"]
    assert replay["all_identical"] is False
    (tmp_path / "replay/warmstart/e2/warmstart.jsonl").write_text(json.dumps({"weights_sha256": "bb"}) + "\n")
    assert v4l.warmstart_replay(tmp_path)["all_identical"] is True


def test_every_laying_of_the_warm_start_is_compared_across_sessions(tmp_path: pathlib.Path) -> None:
    """This session's laying, its replay and an earlier session's (moved aside to laid_before/ by the GPU job):
    identical only when every epoch count hashes the same in every laying; one laying compares nothing."""
    assert v4l.warmstart_layings(tmp_path) is None

    def lay(folder: str, hashes: dict[str, str], started: str) -> None:
        for entry, sha in hashes.items():
            path = tmp_path / folder / entry / "warmstart.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            header = {"started_at": started, "card": "card", "checkout": {"source_sha256": "src"}}
            path.write_text(json.dumps({"header": header}) + "\n" + json.dumps({"weights_sha256": sha}) + "\n")

    lay("warmstart", {"e1": "aa", "e2": "bb"}, "later")
    assert v4l.warmstart_layings(tmp_path)["all_identical"] is None
    lay(f"{v4l.LAID_BEFORE}/earlier/warmstart", {"e1": "aa", "e2": "bb"}, "earlier")
    layings = v4l.warmstart_layings(tmp_path)
    assert layings["all_identical"] is True
    assert [x["folder"] for x in layings["layings"]] == ["warmstart", "laid_before/earlier/warmstart"]
    assert layings["layings"][1] == {"folder": "laid_before/earlier/warmstart", "started_at": "earlier",
                                     "card": "card", "source_sha256": "src",
                                     "weights_sha256": {"e1": "aa", "e2": "bb"}}
    lay("replay/warmstart", {"e1": "aa"}, "replay")  # stopped after one epoch count: e2 is missing there
    assert v4l.warmstart_layings(tmp_path)["all_identical"] is False
    lay("replay/warmstart", {"e2": "bb"}, "replay")
    assert v4l.warmstart_layings(tmp_path)["all_identical"] is True
    lay(f"{v4l.LAID_BEFORE}/earlier/warmstart", {"e2": "bc"}, "earlier")  # another session, other weights
    assert v4l.warmstart_layings(tmp_path)["all_identical"] is False
