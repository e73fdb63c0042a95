"""The trained-weights kit's meters (dfpo_bench.trained): the rebuilt vLLM support whose mass K explains TRL's
importance-sampling ratio under truncated sampling, the per-mode row factors."""

from __future__ import annotations

import json
import math

import torch

from dfpo_bench.trained import is_ratio
from dfpo_bench.trained.is_ratio import analyse, length_bins, rebuild_support_log_mass, row_factors, slope_per_token


def brute_force_kept_mass(probs: list[float], top_p: float, top_k: int, min_p: float = 0.0) -> float:
    """vLLM's order written out element by element: min-p (p ≥ min_p · max p); the top k tokens, renormalised; then,
    ascending, drop tokens while the running mass stays at or below 1 − top_p (the largest always kept); the kept
    tokens' original mass."""
    ranked = [i for i in sorted(range(len(probs)), key=lambda i: -probs[i]) if probs[i] >= min_p * max(probs)]
    kept = ranked[:top_k] if top_k > 0 else ranked
    total = sum(probs[i] for i in kept)
    running, dropped = 0.0, set()
    for i in reversed(kept[1:]):  # ascending, the largest excluded
        running += probs[i] / total
        if running <= 1.0 - top_p:
            dropped.add(i)
        else:
            break
    return sum(probs[i] for i in kept if i not in dropped)


def test_support_mass_matches_hand_numbers():
    """p = (0.5, 0.3, 0.15, 0.05): top-p 0.75 drops 0.05 and 0.15 (running 0.05, 0.2 ≤ 0.25), K = 0.8; top-k 3 then
    top-p 0.9 keeps all three (0.15 / 0.95 > 0.1), K = 0.95; min-p 0.4 keeps p ≥ 0.2, K = 0.8; untruncated K = 1."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert math.isclose(float(rebuild_support_log_mass(logits, 1.0, 0.75, 0).exp()), 0.8, rel_tol=1e-6)
    assert math.isclose(float(rebuild_support_log_mass(logits, 1.0, 0.9, 3).exp()), 0.95, rel_tol=1e-6)
    assert math.isclose(float(rebuild_support_log_mass(logits, 1.0, 1.0, 0, 0.4).exp()), 0.8, rel_tol=1e-6)
    assert float(rebuild_support_log_mass(logits, 1.0, 1.0, 0)) == 0.0


def test_support_mass_matches_the_element_by_element_rule_at_a_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    for temperature, top_p, top_k, min_p in ((0.7, 0.8, 20, 0.0), (0.6, 0.95, 20, 0.0), (1.0, 0.5, 0, 0.0),
                                             (0.9, 1.0, 5, 0.0), (0.8, 0.9, 8, 0.05)):
        got = rebuild_support_log_mass(logits, temperature, top_p, top_k, min_p).exp()
        probs = torch.softmax(logits / temperature, dim=-1)
        want = torch.tensor([brute_force_kept_mass(row.tolist(), top_p, top_k, min_p) for row in probs])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_row_factors_are_trls_formulas():
    """Sequence log ratios −0.3 and 2.0: sequence_mask drops the second (above C_max 3), sequence_truncate caps it."""
    factors = row_factors([-0.3, 2.0])
    assert math.isclose(factors["sequence_mask"][0], math.exp(-0.3), rel_tol=1e-12)
    assert factors["sequence_mask"][1] == 0.0 and factors["sequence_truncate"][1] == 3.0


def test_slope_recovers_an_exponential_in_length():
    lengths = [10.0, 100.0, 1000.0]
    assert math.isclose(slope_per_token(lengths, [math.exp(-0.02 * x) for x in lengths]), -0.02, rel_tol=1e-9)
    assert slope_per_token(lengths, [1.0, 1.0, 1.0]) == 0.0


def synthetic_record(per_token_trl: float, per_token_ours: float, groups: int = 8, per_group: int = 8) -> dict:
    """Rows of lengths 10 … 2600 whose log ratios are exactly linear in length, as :func:`analyse` reads them."""
    lengths = [float(10 + (g * per_group + i) * 40) for g in range(groups) for i in range(per_group)]
    return {"rows": {
        "length": lengths, "group": [g for g in range(groups) for _ in range(per_group)],
        "log_ratio": {"trl": [per_token_trl * x for x in lengths],
                      "truncated_support": [per_token_ours * x for x in lengths], "off": [0.0] * len(lengths)},
        "token_mask_dropped": {"trl": [0] * len(lengths), "truncated_support": [0] * len(lengths)},
    }}


def test_analysis_reads_slopes_bins_drops_and_the_targets():
    summary = analyse(synthetic_record(-0.017, -3e-5))
    assert math.isclose(summary["slope_per_token"]["trl"], -0.017, rel_tol=1e-9)
    assert math.isclose(summary["slope_per_token"]["truncated_support"], -3e-5, rel_tol=1e-6)
    assert summary["slope_per_token"]["off"] == 0.0
    low, high = summary["slope_interval_95"]["trl"]
    assert low <= -0.017 <= high
    bins = summary["median_ratio_by_length"]["truncated_support"]
    assert [b["from"] for b in bins] == [1, 100, 300, 1000, 2000] and sum(b["rows"] for b in bins) == 64
    assert all(0.85 < b["median"] <= 1.0 for b in bins)
    trl_bins = summary["median_ratio_by_length"]["trl"]
    assert trl_bins[-1]["median"] < 1e-10  # e^(-0.017 × 2000+)
    # TRL's ratio under truncation falls below C_min 0.5 from 41 tokens on: sequence_mask with it drops those rows
    assert summary["dropped_rows"]["trl"]["sequence_mask_clip_min_None"] == 0.0
    assert summary["dropped_rows"]["trl"]["sequence_mask_clip_min_0.5"] == 63 / 64
    assert summary["targets"]["slope_met"] and summary["targets"]["median_met"]
    missed = analyse(synthetic_record(-0.017, -3e-4))["targets"]
    assert not missed["slope_met"] and not missed["median_met"]  # e^(-3e-4 × 2500) = 0.47 in the last bin
    assert length_bins([50.0, 150.0], [0.5, 2.0])[2] == {"from": 300, "to": 1000, "rows": 0, "median": None}


def test_the_dry_run_measures_through_the_trainer_and_the_stand_in_engine(tmp_path, monkeypatch):
    """``--dry-run``: TRL's colocated path with DFPO's truncated support, one engine for every setting; the engines
    agree, so ours is 1 on every row where TRL's is the kept mass, and the product's log K is the meter's."""
    monkeypatch.setattr(is_ratio, "PROMPTS", is_ratio.PROMPTS[:2])
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)  # restored afterwards: TRL's colocated set-up writes them
    import trl.generation.vllm_generation as generation

    for name in ("LLM", "SamplingParams", "is_vllm_available"):
        monkeypatch.setattr(generation, name, getattr(generation, name, None), raising=False)
    out = tmp_path / "is_ratio.json"
    torch.set_num_threads(1)
    is_ratio.main(["--dry-run", "--out", str(out), "--settings", "untruncated_t1", "recipe_8b_lora",
                   "--num-generations", "4", "--max-completion", "8", "--cost-rounds", "1",
                   "--cost-max-completion", "4"])
    result = json.loads(out.read_text())
    assert set(result["slope_per_token"]) == {"untruncated_t1", "recipe_8b_lora"}
    assert set(result["slope_per_token"]["recipe_8b_lora"]) == {"trl", "truncated_support", "off"}
    record = result["settings"]["recipe_8b_lora"]["record"]
    ours, trl = record["rows"]["log_ratio"]["truncated_support"], record["rows"]["log_ratio"]["trl"]
    assert max(abs(v) for v in ours) < 1e-4
    assert min(trl) < -0.5  # top-k 20 of a 20-word vocabulary is no cut; top-p 0.8 is
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(trl, record["rows"]["sum_log_mass_meter"],
                                                                  strict=True))
    assert record["tokens"]["max_abs_product_minus_meter"] < 1e-4
    assert result["cost"]["rounds"] == 1 and result["cost"]["truncated_support"]["loop"]["ratios"]

