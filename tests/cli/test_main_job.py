"""The main job: its recipe measures the held-out accuracy along the run, the summary prints that curve, and the
CPU recipe runs end to end on the embedded SmolLM2 model, shortened to a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dfpo_trl.cli.outputs import format_summary

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2_cpu.yaml"


def test_recipe_measures_heldout_accuracy_along_the_run() -> None:
    """eval_every is set and divides max_steps into at least three measurements besides the one before training,
    so the summary's curve shows how the accuracy moves over the steps, not only before and after."""
    recipe = yaml.safe_load(RECIPE.read_text())
    every, steps = recipe.get("eval_every", 0), recipe["max_steps"]
    assert isinstance(every, int) and every >= 1
    assert steps % every == 0 and steps // every >= 3


def summary_with(curve: list[list[float]]) -> dict:
    return {
        "method": "DFPO min_replace", "task": "arithmetic", "model": "m", "steps": 12, "num_generations": 8,
        "heldout": {"n": 50, "before": curve[0][1], "after": curve[-1][1], "curve": curve},
        "reward_curve": "step_reward", "reward_ema_alpha": 0.3, "reward_ema_first": 0.2, "reward_ema_last": 0.5,
        "reward_ema_peak": 0.5, "reward_threshold": 0.6, "steps_to_threshold": None, "reward_jitter2": 0.01,
        "time_split": {"model_conversion": 0, "setup": 1, "eval_before": 2, "training": 3, "eval_during": 4,
                       "eval_after": 5, "save_and_plot": 6, "total": 21},
        "plot": None, "output_dir": "out",
    }  # fmt: skip


def test_summary_prints_the_heldout_curve_and_its_time() -> None:
    text = format_summary(summary_with([[0, 0.42], [4, 0.5], [8, 0.625], [12, 0.7]]))
    assert "held-out greedy accuracy   0.420 -> 0.700  (+0.280, 50 fixed problems)" in text
    assert "held-out curve (step: acc) 0: 0.42, 4: 0.50, 8: 0.62, 12: 0.70" in text
    assert "eval before 2, training 3, eval during 4, eval after 5" in text
    # before and after only (no eval_every): no curve line, no "eval during"
    summary = summary_with([[0, 0.42], [12, 0.7]])
    summary["time_split"]["eval_during"] = 0
    text = format_summary(summary)
    assert "held-out curve" not in text and "eval during" not in text


@pytest.mark.slow
def test_cpu_recipe_runs_on_the_embedded_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], embedded_gguf: None
) -> None:
    pytest.importorskip("matplotlib")
    from dfpo_trl.cli.main import main

    out = tmp_path / "out"
    code = main(
        [
            str(RECIPE),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--eval_every",
            "1",
            "--eval_size",
            "8",
            "--save_model",
            "false",
        ]
    )
    assert code == 0
    summary = json.loads((out / "dfpo_summary.json").read_text())
    assert summary["steps"] == 2 and summary["model"].startswith("embedded SmolLM2-135M-Instruct")
    assert summary["method"] == "DFPO min_replace" and summary["heldout"]["n"] == 8
    held = summary["heldout"]
    assert held["before"] is not None and held["after"] is not None
    # measured before training, after step 1 and after the last step: the curve the summary prints
    assert [step for step, _ in held["curve"]] == [0, 1, 2]
    assert held["curve"][0][1] == held["before"] and held["curve"][-1][1] == held["after"]
    assert summary["time_split"]["eval_during"] == held["periodic_seconds"] > 0
    logged = [row for row in summary["log_history"] if "heldout/accuracy" in row]
    assert [row["step"] for row in logged] == [1]  # the last step's is the summary's "after"
    assert logged[0]["heldout/accuracy"] == pytest.approx(held["curve"][1][1], rel=1e-6)  # through the metric store
    assert (out / "dfpo_metrics.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "held-out greedy accuracy" in printed and "held-out curve (step: acc) 0: " in printed
