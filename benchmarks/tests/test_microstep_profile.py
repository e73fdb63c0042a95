"""dfpo_bench.cost.microstep_profile end to end on the CPU (tiny random model, TRL and Min-Replace): the JSON a GPU
run writes has every field, the labelled DFPO time fits inside the micro-step, and DFPO reads nothing on the host in the
loss path, only in ``log`` at logging steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from dfpo_trl.testing.measures import PROFILE_LABELS  # noqa: E402

from dfpo_bench.cost import microstep_profile  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_microstep_profile_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    microstep_profile.main(["--random-config", "tiny", "--device", "cpu", "--methods", "trl", "min_replace",
                            "--rounds", "2", "--warmup", "0", "--tag", "t", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "microstep_profile_t.json").read_text())
    assert {"card", "versions", "commit", "dirty", "command", "shape", "timing", "profile", "host_syncs"} <= set(result)
    assert result["methods"] == ["trl", "min_replace"]
    timing = result["timing"]["methods"]
    assert timing["trl"]["training_step"]["median_ms"] > 0
    ratio = timing["min_replace"]["training_step"]
    assert len(ratio["round_medians_ms"]) == result["timing"]["rounds_done"] == 2
    low, high = ratio["ratio_interval_95"]
    assert low <= ratio["ratio_to_trl"] <= high

    trl, dfpo = result["profile"]["trl"], result["profile"]["min_replace"]
    assert trl["dfpo_self_cpu_ms"] == 0 and not any(v["dfpo"] for v in trl["labels"].values())
    # every non-generating micro-step (CPU shape: steps_per_generation 2) runs DFPO's objective once, and TRL's loss
    assert dfpo["labels"]["dfpo/micro_step_objective"]["calls"] == 1
    assert dfpo["labels"]["trl._compute_loss"]["calls"] == 1
    assert dfpo["labels"]["dfpo/watch_token_coefficients.backward_hook"]["calls"] == 1
    assert {label for label, v in dfpo["labels"].items() if v["dfpo"]} <= set(PROFILE_LABELS)
    assert 0 < dfpo["dfpo_self_cpu_ms"] <= dfpo["wall_ms"]
    assert 0 < dfpo["trl_compute_loss_minus_dfpo_cpu_ms"] <= dfpo["labels"]["trl._compute_loss"]["cpu_ms"]

    syncs = result["host_syncs"]["min_replace"]
    assert syncs["logging_steps"]["training_step_per_step"] == 0
    assert syncs["non_logging_steps"]["training_step_per_step"] == 0
    assert syncs["logging_steps"]["log_per_step"] > 0  # the metrics are read once, at the logging step
    assert syncs["non_logging_steps"]["log_per_step"] == 0
    assert all(site.startswith("dfpo_trl/metrics/store.py") for site in syncs["logging_steps"]["log_sites"])
    assert "min_replace" in capsys.readouterr().out.splitlines()[-1]


def test_a_trl_label_whose_method_is_gone_fails_loudly() -> None:
    """Every TRL method wrapped for the profile is where the profile looks for it; one renamed away raises, naming
    it, instead of dropping out of the profile (DFPO's own labels are the library's: tests/test_profiling.py)."""
    from types import SimpleNamespace

    from dfpo_bench.cost.microstep_parts import Label, checked, profile_labels

    assert len(profile_labels()) == 5
    with pytest.raises(LookupError, match=r"\['gone_label'\]"):
        checked([Label(SimpleNamespace, "__init__", "kept"), Label(SimpleNamespace, "gone", "gone_label")])
