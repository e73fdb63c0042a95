"""The trained-weights kit's meters (dfpo_bench.trained): the rebuilt vLLM support whose mass K explains TRL's
importance-sampling ratio under truncated sampling, the per-mode row factors, and the offline task."""

from __future__ import annotations

import math
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from dfpo_bench.trained.is_ratio import rebuild_support_log_mass, row_factors, slope_per_token  # noqa: E402
from dfpo_bench.trained.tasks import TwoStepTask  # noqa: E402


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


def test_two_step_task_answers_and_splits():
    task = TwoStepTask()
    train, held = task.build_dataset("train", 50, seed=1), task.build_dataset("test", 8, seed=1)
    assert held["answer"] == task.build_dataset("test", 8, seed=99)["answer"]  # the held-out set ignores the seed
    assert train["answer"] != task.build_dataset("train", 50, seed=2)["answer"]
    for row in train:
        text = row["prompt"][0]["content"]
        a, b, c = (int(x) for x in text.split("Compute ")[1].split(".")[0].replace("×", "+").split("+"))
        assert row["answer"] == a * b + c and 10 <= a <= 99 and 10 <= b <= 99 and 100 <= c <= 999
    reward = task.reward_funcs[0]
    scores = reward(prompts=[None] * 2, completions=[f"so Answer: {held['answer'][0]}", "Answer: 0"],
                    answer=[held["answer"][0]] * 2)
    assert scores == [1.0, 0.0]


def test_learning_queue_orders_arms_and_contrasts():
    """Each contrast overrides the runs' IS fields (its flags come last) and the IS contrast runs beside seed 0's
    Min-Replace run; an unknown contrast is refused by the parser."""
    import argparse

    from dfpo_bench.trained import learn

    args = argparse.Namespace(seeds=[0, 1], arms=["off", "min_replace"], contrasts=["transformers_eval",
                              "min_replace_is_on"], is_flags="--vllm_importance_sampling_correction false")
    queue = learn.build_queue(args)
    assert [(r.method, r.seed) for r in queue] == [("off", 0), ("min_replace", 0), ("min_replace_is_on", 0),
                                                   ("off", 1), ("min_replace", 1), ("transformers_eval", 0)]
    is_on = queue[2].flags
    assert is_on[is_on.index("--vllm_importance_sampling_correction", 2) + 1] == "true"  # the last one wins
    assert queue[1].flags[-1] == "false"
    assert queue[-1].flags[queue[-1].flags.index("--use_vllm") + 1] == "false"


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


def test_report_length_correlation_and_paired_time_ratios():
    """The report's run-level numbers: a gradient that falls as exp(-c·length) correlates −1 in logs; steps with a
    zero gradient (no signal) are left out; the time ratio pairs the arms by seed, complete runs only."""
    from dfpo_bench.reports.report_trained import length_correlation, paired_time_ratios

    lengths = [[s, 50.0 * s] for s in range(1, 6)]
    run = {"series": {"completions/mean_length": lengths,
                      "grad_norm": [[s, math.exp(-0.01 * 50.0 * s) if s != 3 else 0.0] for s in range(1, 6)]}}
    # log g = −0.5 s is linear in s, not in log length: the correlation is negative and not exactly −1
    value = length_correlation(run, "grad_norm")
    assert -1.0 < value < -0.9
    run["series"]["grad_norm"] = [[s, (50.0 * s) ** -2] for s in range(1, 6)]
    assert abs(length_correlation(run, "grad_norm") + 1.0) < 1e-12
    timing = {"step_time": [[1, 2.0], [2, 4.0]]}
    runs = [{"method": "off", "seed": 0, "complete": True, "series": timing},
            {"method": "min_replace", "seed": 0, "complete": True, "series": {"step_time": [[1, 3.0], [2, 3.0]]}},
            {"method": "min_replace", "seed": 1, "complete": True, "series": timing},
            {"method": "off", "seed": 1, "complete": False, "series": timing}]
    assert paired_time_ratios(runs) == [(0, 1.0)]


def test_trend_adjusted_ratio_recovers_an_effect_under_a_drifting_load():
    """Times that fall 2% per run with the treated runs 5% slower: the fit returns 1.05 exactly and an interval of
    zero width (no noise); a paired ratio of neighbours would be biased by the drift. One arm alone: no answer."""
    from dfpo_bench.reports.report_trained import trend_adjusted_ratio

    treated = [False, False, True, False, True, True, False, False, True, False]
    sequence = [(t, 80.0 * 0.98**i * (1.05 if t else 1.0)) for i, t in enumerate(treated)]
    ratio, low, high = trend_adjusted_ratio(sequence)
    assert abs(ratio - 1.05) < 1e-12 and abs(high - low) < 1e-9
    noisy = [(t, s * (1.0 + 0.01 * (-1) ** i)) for i, (t, s) in enumerate(sequence)]
    ratio, low, high = trend_adjusted_ratio(noisy)
    assert low < ratio < high and low < 1.05 < high
    assert trend_adjusted_ratio([(False, 1.0)] * 6) is None


def test_gain_comparison_pairs_by_seed_and_states_what_it_could_detect():
    """Min-Replace's gain minus DFPO off's, per seed with both arms; the interval and the MDE by hand (t with 2 df)."""
    from dfpo_bench.lib.stats import t_ppf, t_quantile
    from dfpo_bench.reports.report_trained import gain_comparison

    def run(method: str, seed: int, before: float, after: float) -> dict:
        return {"method": method, "seed": seed, "heldout": {"before": before, "after": after}}

    done = [run("off", 0, 0.2, 0.3), run("min_replace", 0, 0.2, 0.5), run("off", 1, 0.1, 0.5),
            run("min_replace", 1, 0.1, 0.4), run("off", 2, 0.3, 0.4), run("min_replace", 2, 0.3, 0.6),
            run("min_replace", 3, 0.0, 0.9)]  # seed 3 has no DFPO-off run: left out
    diffs = [0.2, -0.1, 0.2]
    mean = sum(diffs) / 3
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2 / 3)
    (line,) = gain_comparison(done)
    assert "s0: +0.200, s1: -0.100, s2: +0.200" in line and f"mean {mean:+.3f}" in line
    assert f"{mean - t_quantile(2) * se:+.3f} to {mean + t_quantile(2) * se:+.3f} over 3 seeds" in line
    assert f"below {(t_ppf(0.975, 2) + t_ppf(0.8, 2)) * se:.2f} in avg@k" in line
    assert gain_comparison(done[:2]) == []  # one seed: no interval
