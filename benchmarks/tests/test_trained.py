"""The trained-weights kit's meters (dfpo_bench.trained): the rebuilt vLLM support whose mass K explains TRL's
importance-sampling ratio under truncated sampling, the per-mode row factors, and the 8B cards' verdicts."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dfpo_bench.trained.is_ratio import rebuild_support_log_mass, row_factors, slope_per_token

ROOT = Path(__file__).resolve().parents[2]


def brute_force_kept_mass(probs: list[float], top_p: float, top_k: int) -> float:
    """vLLM's order written out element by element: the top k tokens, renormalised; then, ascending, drop tokens
    while the running mass stays at or below 1 − top_p (the largest always kept); the kept tokens' original mass."""
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
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
    """p = (0.5, 0.3, 0.15, 0.05): top-p 0.8 drops 0.05 and 0.15 (running 0.05, 0.2 ≤ 0.2), K = 0.8; top-k 3 then
    top-p 0.9 keeps all three (0.15 / 0.95 > 0.1), K = 0.95; untruncated K = 1."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert math.isclose(float(rebuild_support_log_mass(logits, 1.0, 0.8, 0).exp()), 0.8, rel_tol=1e-6)
    assert math.isclose(float(rebuild_support_log_mass(logits, 1.0, 0.9, 3).exp()), 0.95, rel_tol=1e-6)
    assert float(rebuild_support_log_mass(logits, 1.0, 1.0, 0)) == 0.0


def test_support_mass_matches_the_element_by_element_rule_at_a_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    for temperature, top_p, top_k in ((0.7, 0.8, 20), (0.6, 0.95, 20), (1.0, 0.5, 0), (0.9, 1.0, 5)):
        got = rebuild_support_log_mass(logits, temperature, top_p, top_k).exp()
        probs = torch.softmax(logits / temperature, dim=-1)
        want = torch.tensor([brute_force_kept_mass(row.tolist(), top_p, top_k) for row in probs])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_row_factors_are_trls_formulas():
    """Two rows: gaps of −0.1 per token over 3 and 1 tokens; the second row's log K equals its gap."""
    gap = torch.tensor([[-0.1, -0.1, -0.1], [-0.1, 0.0, 0.0]])
    log_mass = torch.tensor([[0.0, 0.0, 0.0], [-0.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    factors = row_factors(gap, log_mass, mask)
    # float32 inputs: −0.1 is held to float32's rounding (relative 6e-8 per value)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(factors["sequence_mask"],
                                                                [math.exp(-0.3), math.exp(-0.1)], strict=True))
    assert factors["off"] == [1.0, 1.0]
    assert math.isclose(factors["token_truncate"][0], math.exp(-0.1), rel_tol=1e-6)
    assert math.isclose(factors["against_truncated_support"][0], math.exp(-0.3), rel_tol=1e-6)
    assert math.isclose(factors["against_truncated_support"][1], 1.0, rel_tol=1e-6)
    above = row_factors(torch.tensor([[2.0]]), torch.zeros(1, 1), torch.ones(1, 1))
    assert above["sequence_mask"] == [0.0] and above["sequence_truncate"] == [3.0]  # TRL's cap C_max 3


def test_slope_recovers_an_exponential_in_length():
    lengths = [10.0, 100.0, 1000.0]
    assert math.isclose(slope_per_token(lengths, [math.exp(-0.02 * x) for x in lengths]), -0.02, rel_tol=1e-9)
    assert slope_per_token(lengths, [1.0, 1.0, 1.0]) == 0.0


def test_cards_decide_only_what_the_uncapped_run_settles():
    """Below peak allocated + overhead: cannot fit; at or above peak reserved + overhead: fits; between: a capped
    run is needed (stage 2), and a crashed or CPU run decides nothing."""
    from dfpo_bench.trained import cards_8b

    run = {"peak_allocated_gib": 23.0, "peak_reserved_gib": 30.0, "overhead_gib": 0.5, "crash": None}
    assert cards_8b.decide(23.4, run) == "does not fit"
    assert cards_8b.decide(23.5, run) is None and cards_8b.decide(30.4, run) is None
    assert cards_8b.decide(30.5, run) == "fits"
    assert cards_8b.decide(80, {**run, "crash": "OutOfMemoryError"}) is None
    assert cards_8b.decide(80, {**run, "peak_allocated_gib": None}) is None
    uncapped = {"transformers_b8": run, "vllm_b8": {**run, "engine_gib": 20.0, "crash": "boom"}}
    assert cards_8b.stage_two(uncapped, (24, 32, 40)) == [("transformers_b8", 24)]


def test_cards_table_reads_capped_runs_variants_and_sleep_mode_overhead(tmp_path):
    """A capped run is the cell it measured; a variant's tag names its engine size; a sleep-mode run takes the
    largest overhead the other vLLM runs measured (its own reading is below PyTorch's reserved); a crash decides
    nothing."""
    import json

    from dfpo_bench.trained import cards_8b

    def write(stem, **record):
        base = {"crash": None, "peak_allocated_gib": 20.0, "peak_reserved_gib": 21.0, "overhead_gib": 0.5,
                "steps": [{"total_s": 10.0, "rollout_s": 8.0}, {"total_s": 2.0, "pre_pass_s": 0.5}]}
        (tmp_path / f"{stem}.json").write_text(json.dumps({**base, **record}))

    write("transformers_b8@uncapped", peak_allocated_gib=23.0, peak_reserved_gib=30.0)
    write("transformers_b8@24", crash="OutOfMemoryError: CUDA out of memory")
    write("vllm_b4@uncapped_engine20", peak_allocated_gib=35.0, peak_reserved_gib=35.2, overhead_gib=0.9)
    write("vllm_b8_sleep@uncapped", peak_allocated_gib=39.3, peak_reserved_gib=39.5, overhead_gib=0.0)
    write("vllm_b8@uncapped_engine20", crash="ValueError: No available memory for the cache blocks")
    rows = {r["variant"]: r for r in cards_8b.tabulate(tmp_path, (24, 40), 28.0)}
    b8 = {c["card_gib"]: c for c in rows["transformers_b8"]["cards"]}
    assert (b8[24]["fits"], b8[24]["how"]) == (False, "measured")
    assert (b8[40]["fits"], b8[40]["how"]) == (True, "deduced")
    assert rows["transformers_b8"]["pre_pass_share"] == 0.5 / 12.0
    engine20 = rows["vllm_b4_engine20"]
    assert engine20["engine_gib_requested"] == 20.0 and engine20["cards"][1]["vllm_gpu_memory_utilization"] == 0.5
    sleep = rows["vllm_b8_sleep"]
    assert sleep["overhead_gib"] == 0.9 and sleep["cards"][1]["fits"] is False  # 39.3 + 0.9 > 40
    assert all(c["how"] == "crashed" and c["fits"] is None for c in rows["vllm_b8_engine20"]["cards"])
