"""dfpo_bench.cost.users_size end to end on the CPU (tiny random Qwen3, no vLLM): a round of the pre-pass variants
writes every field the report reads, and the pre-pass with DFPO's group order forwards half the rows it forwards with
TRL's per-sample order (rollout 32 rows = 4 groups of 8; an optimizer step trains 16 = 2 whole groups)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from dfpo_bench.cost import users_size  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_users_size_pre_pass_rounds(tmp_path: Path) -> None:
    out = tmp_path / "u.json"
    users_size.main(["--shape", "tiny", "--no-vllm", "--methods", "min_replace_b4", "min_replace_b4_per_sample",
                     "--rounds", "1", "--completion-length", "2", "--budget-s", "1e9", "--model-dir",
                     str(tmp_path / "model"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert {"card", "versions", "commit", "dirty", "command", "model", "config", "engine", "summary"} <= set(result)
    runs = result["rounds"][0]["runs"]
    assert set(runs) == {"trl_b4", "min_replace_b4", "min_replace_b4_per_sample"}
    assert not any(r["crash"] for r in runs.values())
    assert runs["min_replace_b4"]["layout"] == runs["min_replace_b4_per_sample"]["layout"] == "pre_pass"
    assert runs["min_replace_b4"]["pre_pass_rows"] == 16 and runs["min_replace_b4_per_sample"]["pre_pass_rows"] == 32
    for record in runs.values():
        assert len(record["steps"]) == 2  # one rollout: two optimizer steps
        assert abs(sum(s["total_s"] for s in record["steps"]) - record["total_s"]) < 1e-9
        assert all(0 <= s["rollout_s"] <= s["total_s"] for s in record["steps"][:1])
        # transformers' generation is timed inside the rollout, in its first step only
        assert 0 < record["steps"][0]["generation_s"] <= record["steps"][0]["rollout_s"]
        assert "generation_s" not in record["steps"][1]
    summary = result["summary"]["min_replace_b4"]
    assert summary["baseline"] == "trl_b4" and summary["rounds"] == 1
    assert summary["loss_steps_s_ratio"]["median"] > 0
    generation = [sum(s.get("generation_s", 0.0) for s in runs[m]["steps"]) for m in ("min_replace_b4", "trl_b4")]
    assert summary["generation_s_ratio"]["values"] == [generation[0] / generation[1]]
