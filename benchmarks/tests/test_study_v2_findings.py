"""dfpo_bench.studies.study_v2_findings: the numbers RESULTS §11 and the README quote about study v2, computed from
records (hand-built ones here) and, for the committed data, equal to the committed findings file."""

from __future__ import annotations

import json
import math

import pytest

from dfpo_bench.studies import study_v2_findings as f  # noqa: E402


def record(logp0: float, logp_end: float, after: float, entropy: float, clip: list[float] | None = None,
           complete: bool = True, tail: str = "") -> dict:
    clip = clip or [0.0] * 8
    return {"method": "gspo", "seed": 0, "complete": complete, "log_tail": tail,
            "heldout": {"before": 0.3, "after": after},
            "drift": {"curve": [{"step": 0, "set_logp_mean": logp0}, {"step": 8, "set_logp_mean": logp_end}]},
            "series": {"entropy": [[8, entropy]],
                       "diagnostics/clip_fraction_signal": [[k + 1, v] for k, v in enumerate(clip)],
                       "cancellation/one_sided_groups": [[k + 1, v / 2] for k, v in enumerate(clip)]}}


def test_mass_and_credit_reads_the_last_measurement() -> None:
    rows = [record(-4.8, math.log(0.6), 0.9, 1.0), record(-4.8, -30.0, 0.55, 0.05), record(-4.8, -3.0, 0.5, 0.8)]
    out = f.mass_and_credit(rows, 8)
    assert out["set_mass_median"] == pytest.approx(math.exp(-3.0), rel=1e-12)
    assert out["set_mass_above_half"] == 1 and out["heldout_below_0_6"] == 2
    assert out["set_logp_below_step0"] == 1 and out["set_logp_final_median"] == pytest.approx(-3.0, rel=1e-12)
    assert out["token_entropy_final_median"] == pytest.approx(0.8, rel=1e-12)


def test_off_policy_signal_leaves_out_each_rollouts_first_step() -> None:
    # rollouts of 4 steps: steps 1 and 5 are on-policy (clip 0 there), the others clip 0.6
    clip = [0.0, 0.6, 0.6, 0.6, 0.0, 0.6, 0.6, 0.6]
    out = f.off_policy_signal([record(-4.8, -3.0, 0.9, 1.0, clip)], 4)
    assert out["clipped_share_signal_rows"] == pytest.approx(0.6, rel=1e-9)
    assert out["one_sided_share_signal_groups"] == pytest.approx(0.3, rel=1e-9)


def test_crashes_name_memory_failures() -> None:
    rows = [{**record(-4.8, -3.0, 0.9, 1.0, complete=False, tail="torch.OutOfMemoryError: CUDA out of memory"),
             "_design": "d"},
            {**record(-4.8, -3.0, 0.9, 1.0, complete=False, tail="CUBLAS_STATUS_ALLOC_FAILED"), "_design": "d"},
            {**record(-4.8, -3.0, 0.9, 1.0, complete=False, tail="ValueError: bad flag"), "_design": "d"},
            {**record(-4.8, -3.0, 0.9, 1.0), "_design": "d"}]
    out = f.crashes(rows)
    assert (out["runs"], out["failed"], out["memory"], out["out_of_memory"], out["cublas_alloc"]) == (4, 3, 2, 1, 1)


def test_the_committed_findings_are_what_the_records_give() -> None:
    results = f.RESULTS
    if not (results / "study_v2").exists():
        pytest.skip("study v2's records are not in this checkout")
    committed = json.loads((results / "study_v2_findings.json").read_text())
    assert f.findings(results) == json.loads(json.dumps(committed))


def test_metrics_doc_quotes_the_findings() -> None:
    """docs/source/concepts/metrics.md types study v2's numbers by hand; each must be what the findings file says (the
    README, a user's page, no longer reports studies)."""
    results = f.RESULTS
    found = json.loads((results / "study_v2_findings.json").read_text())
    mass, signal = found["mass_and_credit"], found["off_policy_signal"]
    g, w, a = mass["gspo"], mass["mr_w"], mass["anchor"]
    clipped = {round(100 * signal[k]["clipped_share_signal_rows"]) for k in ("gspo", "mr_w")}
    one_sided = sorted(round(100 * signal[k]["one_sided_share_signal_groups"]) for k in ("gspo", "mr_w"))
    quotes = [f"{100 * g['set_mass_median']:.1f}%", f"{100 * w['set_mass_median']:.1f}%",
              f"{g['heldout_below_0_6']} of {g['runs']}", f"{w['heldout_below_0_6']} of {w['runs']}",
              f"{clipped.pop()}% of the rows with a signal" if len(clipped) == 1 else "clipped shares differ",
              f"{one_sided[0]}–{one_sided[1]}%", f"{a['set_logp_below_step0']} of",
              f"−{abs(a['set_logp_final_median']):.1f}", f"−{abs(g['set_logp_final_median']):.1f}",
              f"{found['mde_welch_t']['gspo - anchor']['t']:.3f}",
              f"{found['rollouts']['anchor']['count']} rollouts of {found['rollouts']['anchor']['size']} against "
              f"{found['rollouts']['gspo']['count']} of {found['rollouts']['gspo']['size']}",
              f"{found['round2_pilot_crashes']['failed']} of"]
    for name in ("docs/source/concepts/metrics.md",):
        text = " ".join((f.ROOT / name).read_text().split())
        missing = [q for q in quotes
                   if q not in text and not (name == "docs/source/concepts/metrics.md" and q.endswith(" of"))]
        assert not missing, f"{name} does not quote {missing}"
