"""RESULTS.md's section on trained weights (``benchmarks/dfpo_bench/trained/``): TRL's vLLM importance-sampling ratio
against the truncated support's and the correction off at the recipes' sampling settings, with the independent meter
beside it, and the 8B LoRA recipe's cards. Called by ``dfpo_bench.reports.report``; every number is read from
``results/trained/``."""

from __future__ import annotations

import pathlib
from typing import Any

from dfpo_bench.lib.common import load_json

LABELS = {"untruncated_t1": "untruncated, T 1.0", "recipe_8b_lora": "8B recipe: T 0.7, top-p 0.8, top-k 20",
          "recipe_32b": "32B recipe: T 0.6, top-p 0.95, top-k 20", "untruncated_t06": "untruncated, T 0.6"}

# The truncated-support runs' dates (their records carry none) and, for the first, main's commit: its JSON's checkout
# names the device's stale .git copy.
LATEST_RUN, BEFORE_RUN, CONTROL_RUN = ("2026-12-03", None), ("2026-12-02", "ca7651e"), ("2026-12-03", "fae533e")


def run_words(record: dict[str, Any], run: tuple[str, str | None]) -> str:
    """Where an ``is_ratio.py`` record ran: card, date, code."""
    date, main_commit = run
    checkout = record["checkout"]
    if main_commit:
        code = (f"main at {main_commit}: the JSON's checkout says {checkout['commit'][:7]} with a diff because the "
                "machine's .git copy was stale")
    else:
        code = f"{checkout['commit'][:7]} {'with a diff' if checkout.get('diff_sha256') else 'as committed'}"
    return f"{record['card']}, {date}, {code}"


def cost_ratio(cost: dict[str, Any], kind: str, part: str) -> str:
    """``is_ratio.py``'s cost of ``kind`` against the correction off in ``part``: median ratio [95% interval]."""
    c = cost[kind][part]
    return f"{c['median_ratio_to_off']:.3f} [{c['interval_95'][0]:.3f}, {c['interval_95'][1]:.3f}]"


def compare_lines(before: dict[str, Any], latest: dict[str, Any]) -> list[str]:
    """The run before 2ef086d against the latest, row by row: which fields differ (the rollouts are seeded, so only
    what the product computes from them may), its slopes of ours and its cost rounds."""
    differing = {name: [key for key, rows in s["record"]["rows"].items()
                        if rows != latest["settings"].get(name, {}).get("record", {}).get("rows", {}).get(key)]
                 for name, s in before["settings"].items()}
    cost = before["cost"]
    verdict = "; ".join(f"{LABELS.get(n, n)}: {'differs in ' + ', '.join(d) if d else 'every row field identical'}"
                        for n, d in differing.items())
    fields = ", ".join(next(iter(before["settings"].values()))["record"]["rows"])
    slopes = ", ".join(f"{LABELS.get(name, name)} {s['slope_per_token']['truncated_support']:.3g}"
                       for name, s in before["settings"].items())
    return [f"**The run before** (`results/trained/is_ratio_truncated_support_before_head_dtype.json`; "
            f"{run_words(before, BEFORE_RUN)}; the same command, before 2ef086d took log K from the logits TRL's "
            f"head scores ℓ^old with). Against the run above, row by row ({fields}): {verdict}. Its slopes of ours: "
            f"{slopes}. Its cost rounds ({cost['rounds']}): ours {cost_ratio(cost, 'truncated_support', 'loss_steps')}"
            f" in the loss steps and {cost_ratio(cost, 'truncated_support', 'loop')} in the whole loop; TRL's "
            f"{cost_ratio(cost, 'trl', 'loss_steps')} and {cost_ratio(cost, 'trl', 'loop')}. Its rerun at 98afe02 "
            "(2026-12-03) came out identical in every row field: `git checkout 2b4a600 -- "
            "benchmarks/results/trained/is_ratio_truncated_support_rerun.json`. Why, and what changed: "
            "docs/source/concepts/decisions.md, \"vLLM's importance-sampling ratio under truncated sampling\".", ""]


def control_lines(control: dict[str, Any], latest: dict[str, Any]) -> list[str]:
    """The untruncated control at the 32B recipe's temperature beside the 32B setting: the engines' mismatch alone."""
    c, big = control["settings"]["untruncated_t06"], latest["settings"]["recipe_32b"]

    def slope(s: dict[str, Any], kind: str) -> str:
        low, high = s["slope_interval_95"][kind]
        return f"{s['slope_per_token'][kind]:.2g} [{low:.2g}, {high:.2g}]"

    return [f"**Control: untruncated at T 0.6** (`results/trained/is_ratio_untruncated_t06.json`, `is_ratio.py "
            f"--settings untruncated_t06 --cost-rounds 0`; {run_words(control, CONTROL_RUN)}, its source_sha256 that "
            f"commit's; {c['rows']} rows up to {c['longest']:.0f} tokens). Nothing is truncated, so TRL's ratio and "
            f"ours are both the engines' mismatch alone: slope {slope(c, 'truncated_support')} per token, mean log "
            f"ratio {c['record']['tokens']['mean_truncated_support_log_ratio']:.1e} a token, medians by bin "
            + " ".join(format(b["median"], ".3g") for b in c["median_ratio_by_length"]["truncated_support"])
            + ". Ours at the 32B recipe's settings (the same temperature, truncated): "
            f"{slope(big, 'truncated_support')}, mean {big['record']['tokens']['mean_truncated_support_log_ratio']:.1e}"
            " a token. The residual of ours there is of the size of the mismatch the engines have without truncation,"
            " which the correction is there to carry.", ""]


def support_lines(record: dict[str, Any]) -> list[str]:
    """``is_ratio.py``'s run with ``vllm_importance_sampling_support``: TRL's / ours / off per setting, the targets,
    the product's log K against the meter, TRL's mask modes, and the cost against the correction off."""
    versions, settings, cost = record["versions"], record["settings"], record["cost"]
    lora, big, flat = settings["recipe_8b_lora"], settings["recipe_32b"], settings["untruncated_t1"]

    def num(value: float | None, spec: str = ".2g") -> str:
        return "–" if value is None else format(value, spec)

    lines = [
        f"**`vllm_importance_sampling_support: truncated` against TRL's ratio and the correction off** "
        f"(`trained/is_ratio.py`, `gpu_job.sh is`; {run_words(record, LATEST_RUN)}; torch {versions['torch']}, "
        f"transformers {versions['transformers']}, TRL {versions['trl']}, vLLM colocated; "
        f"{record['model'].rsplit('/', 1)[-1]}, trained weights; eight prompts from a two-digit sum to a long code "
        f"module, {record['num_generations']} completions each, up to {record['max_completion']} tokens; "
        "`results/trained/is_ratio_truncated_support.json`). One trainer per setting, TRL's correction on "
        "(`sequence_mask`, C_max 3), the product's support truncated; TRL's ratio and the correction off are read "
        "from the same rows. Slope: OLS of the row's log ratio on its length, nats per token, with a 95% bootstrap "
        "interval over prompts. Target for ours, read on the point estimates: |slope| ≤ "
        f"{lora['targets']['slope_abs_max']:g} and a median in [{lora['targets']['median_within'][0]:g}, "
        f"{lora['targets']['median_within'][1]:g}] in every length bin.", "",
        "| sampling | rows | slope TRL's | slope ours | slope off | ours' median ratio by length bin (rows) "
        "| TRL's median by bin | targets met (slope, medians) | log K per token: product / meter (max row |diff|) "
        "| log ratio per token: TRL's / ours |", "|---" * 10 + "|"]
    for name, s in settings.items():
        slope, interval, bins = s["slope_per_token"], s["slope_interval_95"], s["median_ratio_by_length"]

        def by_bin(kind: str, with_rows: bool, bins: dict[str, Any] = bins) -> str:
            return " · ".join(f"{b['from']}–{b['to'] - 1 if b['to'] else '…'}: {num(b['median'])}"
                              + (f" ({b['rows']})" if with_rows else "") for b in bins[kind])

        tokens, targets = s["record"]["tokens"], s["targets"]
        lines.append(
            f"| {LABELS.get(name, name)} | {s['rows']} | {num(slope['trl'], '.3g')} "
            f"[{num(interval['trl'][0], '.2g')}, {num(interval['trl'][1], '.2g')}] | "
            f"{num(slope['truncated_support'], '.3g')} [{num(interval['truncated_support'][0], '.2g')}, "
            f"{num(interval['truncated_support'][1], '.2g')}] | {num(slope['off'], '.3g')} | "
            f"{by_bin('truncated_support', True)} | {by_bin('trl', False)} | "
            f"{'yes' if targets['slope_met'] else 'no'}, {'yes' if targets['median_met'] else 'no'} | "
            f"{tokens['mean_log_mass_product']:+.4f} / {tokens['mean_log_mass_meter']:+.4f} "
            f"({tokens['max_abs_product_minus_meter']:.2g}) | {tokens['mean_trl_log_ratio']:+.4f} / "
            f"{tokens['mean_truncated_support_log_ratio']:+.1e} |")
    lines += ["", "The factor each of TRL's modes puts on a row, from the same rows (slope of its log on the length, "
              "nats per token), and the share of rows `sequence_mask` drops (C_max 3, with C_min none or 0.5) or "
              "in which `token_mask` drops a token:", "",
              "| sampling | ratio | `sequence_mask` | `sequence_truncate` | `token_truncate` | dropped by "
              "`sequence_mask` (C_min none) | (C_min 0.5) | rows with a token dropped by `token_mask` |",
              "|---" * 8 + "|"]
    for name, s in settings.items():
        for kind, label in (("trl", "TRL's"), ("truncated_support", "ours")):
            modes, dropped = s["mode_factor_slope_per_token"][kind], s["dropped_rows"][kind]
            lines.append(f"| {LABELS.get(name, name)} | {label} | {num(modes['sequence_mask'], '.3g')} | "
                         f"{num(modes['sequence_truncate'], '.3g')} | {num(modes['token_truncate'], '.3g')} | "
                         f"{dropped['sequence_mask_clip_min_None']:.1%} | {dropped['sequence_mask_clip_min_0.5']:.1%} "
                         f"| {dropped['token_mask_rows_with_a_dropped_token']:.1%} |")

    def met(target: str) -> str:
        return ", ".join(LABELS.get(n, n) for n, s in settings.items() if s["targets"][target]) or "no setting"

    ours_modes = lora["mode_factor_slope_per_token"]["truncated_support"]
    return lines + [
        "", f"Cost against the correction off ({cost['rounds']} rounds, each the three conditions in a shuffled "
        f"order, at the {LABELS.get(cost['setting'], cost['setting'])} setting with {cost['max_completion']}-token "
        "completions; the median over rounds of the within-round ratio, 95% bootstrap interval): ours "
        f"{cost_ratio(cost, 'truncated_support', 'loss_steps')} in the loss steps and "
        f"{cost_ratio(cost, 'truncated_support', 'loop')} in the whole loop (rollout + loss steps); TRL's "
        f"{cost_ratio(cost, 'trl', 'loss_steps')} and {cost_ratio(cost, 'trl', 'loop')}.", "",
        "What it shows. The truncated support removes most of TRL's length-driven fall at the truncating settings "
        f"(slope {lora['slope_per_token']['trl']:.3g} → {lora['slope_per_token']['truncated_support']:.2g} per token "
        f"at the 8B recipe's, {big['slope_per_token']['trl']:.3g} → {big['slope_per_token']['truncated_support']:.2g}"
        " at the 32B recipe's); the product's log K agrees with the independent meter to "
        f"{max(s['record']['tokens']['max_abs_product_minus_meter'] for s in settings.values()):.1g} nats in every "
        f"row. Ours meets the slope target at {met('slope_met')} and the median target at {met('median_met')}. "
        "What is left is the engines' mismatch (their logits differ, and with them at times the support): ours' "
        "mean log ratio per token is "
        + ", ".join(f"{s['record']['tokens']['mean_truncated_support_log_ratio']:.1e} ({LABELS.get(name, name)})"
                    for name, s in settings.items())
        + ", and the untruncated control (nothing truncated, so the ratio is the mismatch alone, ours equal to "
        f"TRL's) has a slope of {flat['slope_per_token']['trl']:.2g} per token and medians by bin of "
        + " ".join(num(b["median"], ".3g") for b in flat["median_ratio_by_length"]["truncated_support"])
        + ": a mismatch that adds up with length at this model and engine, which no choice of support removes. "
        "`token_truncate`'s factor (a row's mean of its per-token ratios capped at 3) has a slope of "
        f"{num(ours_modes['token_truncate'], '.1g')} per token with ours at the 8B setting (sequence modes "
        f"{num(ours_modes['sequence_mask'], '.2g')}), and `token_mask` dropped a token in no row.", ""]


def trained_section(results: pathlib.Path, number: int) -> list[str]:
    folder = results / "trained"
    lines = [f"## {number}. Trained weights: the importance-sampling ratio at the recipes' settings, and the 8B "
             "cards (`benchmarks/dfpo_bench/trained/`)", ""]
    # the first runs, TRL's ratio alone: archived (docs/source/research.md)
    if support := load_json(folder / "is_ratio_truncated_support.json"):
        lines += support_lines(support)
        if before := load_json(folder / "is_ratio_truncated_support_before_head_dtype.json"):
            lines += compare_lines(before, support)
        if control := load_json(folder / "is_ratio_untruncated_t06.json"):
            lines += control_lines(control, support)
    if as_run := load_json(folder / "cards_8b_as_run.json"):  # the rows as a user runs them (trained/cards_8b.py)
        from dfpo_bench.trained import cards_8b

        lines += [cards_8b.report(as_run), ""]
        trained = [r for r in as_run["rows"] if "2/2 [" in (r.get("log_tail") or "")]
        in_eval = [r for r in trained if "held-out evaluation" in (r.get("error") or "")]
        stopped = [r for r in trained if r.get("exit") is None]
        lines += [f"The code that ran: {as_run.get('code') or as_run['commit']}. "
                  + "".join(f"The {r['card_gib']:g} GB row with `{' '.join(r['flags'])}` trained both optimizer "
                            "steps (its log), then ran out of memory in the held-out evaluation after them, at the "
                            "peak its row shows. " for r in in_eval)
                  + "".join(f"The {r['card_gib']:g} GB row was stopped by the driver after both steps: not a "
                            "result. " for r in stopped)
                  + "Per-row records and logs: `results/trained/cards_8b_as_run_logs.tgz`.", ""]
    return lines
