"""The statistics of ``dfpo_bench.launch.layouts`` (the layouts' step-time claim rests on them): which steps count,
how rounds of separate runs are pooled, that runs of another design are refused, and the collector's clock."""

from __future__ import annotations

import gc
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from dfpo_bench.launch import layouts, layouts_timing


def steps_of(seconds_by_round: list[list[float]], per_rollout: int = 4) -> list[dict[str, Any]]:
    """Step records as the timing phase writes them: one turn of consecutive steps per round."""
    flat = [(r, s) for r, seconds in enumerate(seconds_by_round) for s in seconds]
    return [{"round": r, "step": i, "step_in_rollout": i % per_rollout, "seconds": s} for i, (r, s) in enumerate(flat)]


def test_per_round_keeps_off_policy_steps_apart_from_the_first_of_each_rollout() -> None:
    records = [{"round": -1, "step_in_rollout": 1, "seconds": 99.0}]  # warm-up: never counted
    records += steps_of([[5.0], [1.0], [2.0], [4.0], [7.0], [3.0]])
    assert layouts.per_round(records, off_policy=True) == {1: 1.0, 2: 2.0, 3: 4.0, 5: 3.0}
    assert layouts.per_round(records, off_policy=False) == {0: 5.0, 4: 7.0}
    # a turn of several steps: the round's median of its off-policy steps
    assert layouts.per_round(steps_of([[9.0, 1.0, 2.0, 6.0]]), off_policy=True) == {0: 2.0}


def run_report(tmp_path: Path, name: str, rounds: dict[str, list[float]], **overrides: Any) -> str:
    """A timing run's layouts.json with given per-round medians (ratios taken to gspo's)."""
    report: dict[str, Any] = {
        "device": "GPU", "gpus": 4, "model": "random-qwen3-1.7b", "per_device_train_batch_size": 1,
        "num_generations": 4, "steps_per_generation": 16, "gradient_accumulation_steps": 4,
        "completion_length_range": [256, 384], "steps_per_turn": 1, "gc": "between-turns", "zero_stage": 3,
        "rounds": len(rounds["gspo"]), **overrides,
    }
    for method, values in rounds.items():
        report[method] = {**layouts.method_entry(values, rounds["gspo"]), "gc_s_in_timed_steps": 0.25,
                          "first_step_median_s": 5.0, "steps": [{"seconds": 1.0}]}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_merge_pools_the_rounds_and_takes_ratios_within_each_round(tmp_path: Path) -> None:
    first = {"gspo": [4.0, 2.0, 5.0], "pre_pass": [5.0, 2.6, 6.0], "redistributed": [4.4, 2.0, 4.5]}
    second = {"gspo": [3.0, 6.0], "pre_pass": [3.3, 7.8], "redistributed": [3.3, 6.0]}
    layouts.main(["--merge", run_report(tmp_path, "a", first), run_report(tmp_path, "b", second),
                  "--out-dir", str(tmp_path / "out"), "--plot", str(tmp_path / "ratios.png")])
    merged = json.loads((tmp_path / "out" / "layouts.json").read_text())
    assert merged["rounds"] == 5 and (tmp_path / "ratios.png").stat().st_size > 0
    ratios = [1.1, 1.0, 0.9, 1.1, 1.0]  # redistributed / gspo, round by round
    entry = merged["redistributed"]
    assert entry["round_ratio_to_gspo"] == pytest.approx(ratios)
    assert entry["ratio_to_gspo"] == pytest.approx(statistics.median(ratios))
    # a ratio of pooled medians would be 4.4 / 4.0 = 1.1: the pooled ratio is not that
    assert entry["ratio_to_gspo"] == pytest.approx(1.0)
    low, high = entry["ratio_interval_95"]
    assert min(ratios) <= low <= 1.0 <= high <= max(ratios)
    assert [run["rounds"] for run in entry["runs"]] == [3, 2] and entry["first_step_median_s_per_run"] == [5.0, 5.0]
    assert entry["gc_s_in_timed_steps"] == pytest.approx(0.5)
    assert "steps" not in entry and "first_step_median_s" not in entry  # per run only; the runs' files keep them


@pytest.mark.parametrize(("field", "value"), [("steps_per_turn", 4), ("gc", "as-is"), ("device", "other GPU"),
                                              ("num_generations", 8)])
def test_merge_refuses_runs_of_another_design_or_machine(tmp_path: Path, field: str, value: Any) -> None:
    rounds = {"gspo": [4.0, 2.0], "pre_pass": [5.0, 2.6], "redistributed": [4.4, 2.0]}
    args = layouts.parse_args(["--merge", run_report(tmp_path, "a", rounds),
                               run_report(tmp_path, "b", rounds, **{field: value}), "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="differ in device, shape or turn design"):
        layouts.merge_reports(args)


def test_gc_clock_counts_the_collections_of_its_process() -> None:
    clock = layouts_timing.GCClock()
    try:
        before = clock.total
        garbage = [[] for _ in range(1000)]
        for a, b in zip(garbage, garbage[1:], strict=False):
            a.append(b)
            b.append(a)  # cycles: only the collector frees them
        del garbage, a, b
        assert gc.collect() > 0
        assert clock.total > before
    finally:
        gc.callbacks.remove(clock._callback)
