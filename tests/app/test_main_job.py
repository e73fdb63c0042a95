"""The main job end to end: the CPU recipe on the embedded SmolLM2 model, shortened to a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_recipe_runs_on_the_embedded_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], embedded_gguf: None
) -> None:
    pytest.importorskip("matplotlib")
    from dfpo_trl.app.main import main

    out = tmp_path / "out"
    code = main(
        [
            str(ROOT / "recipes" / "smollm2_cpu.yaml"),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--eval_size",
            "8",
            "--eval_max_new_tokens",
            "16",
            "--save_model",
            "false",
        ]
    )
    assert code == 0
    summary = json.loads((out / "dfpo_summary.json").read_text())
    assert summary["steps"] == 2 and summary["model"].startswith("embedded SmolLM2-135M-Instruct")
    assert summary["method"] == "DFPO min_replace" and summary["heldout"]["n"] == 8
    assert summary["heldout"]["before"] is not None and summary["heldout"]["after"] is not None
    assert (out / "dfpo_metrics.png").stat().st_size > 10_000
    assert "held-out greedy accuracy" in capsys.readouterr().out
