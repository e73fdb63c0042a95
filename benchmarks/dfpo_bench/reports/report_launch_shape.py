"""RESULTS.md section for the launch runs in server mode (``launch/vllm_server.py``). Called by
``dfpo_bench.reports.report``; every number is read from the JSON files."""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from dfpo_bench.lib.common import load_json


def mean_abs(a: list[float], b: list[float]) -> float:
    return statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True))


def mean_step_time(per_step: dict[str, Any], training_only: bool) -> float | None:
    """Mean of TRL's logged ``step_time`` over every step but the first (vLLM warm-up, first weight push), or with
    ``training_only`` over the steps that did not generate (no ``reward`` logged: TRL logs it at a rollout's first)."""
    generating = {step for step, _ in per_step.get("reward", [])}
    times = [t for step, t in per_step.get("step_time", []) if (step not in generating if training_only else step > 1)]
    return statistics.fmean(times) if times else None


def launch_shape_section(results: pathlib.Path, number: int) -> list[str]:
    server, three = load_json(results / "vllm_server.json"), load_json(results / "vllm_server_three_runs.json")
    if not server:
        return []
    w, run = server["weight_sync_numbers"], server["runs"]["dfpo"]
    lines = [
        f"## {number}. vLLM server mode", "",
        f"**Server mode, 2 GPUs** (`vllm_server.py --runs dfpo --enforce-eager`, {server['cards'][0]}; server on "
        f"GPU 1, trainer on GPU 0): {run['steps']} steps of {run['method']}, {run['weight_syncs']} weight pushes "
        f"({run['final_syncs']} of them after the last step), held-out {run['heldout']['before']} → "
        f"{run['heldout']['after']}. Weight-sync check **{str(server['weight_sync_check']).lower()}**: over "
        f"{w['tokens']} tokens the server differs from the trained model by at most "
        f"{w['max_abs_diff_server_vs_trained']:.3f} nats (mean {w['mean_abs_diff_server_vs_trained']:.3f}) and "
        f"from the initial one by {w['max_abs_diff_server_vs_initial']:.3f} (mean "
        f"{w['mean_abs_diff_server_vs_initial']:.3f}); the bound {w['bound']:.3f} is the tolerance "
        f"{w['tolerance']} plus twice the server-vs-transformers gap on the same (initial) weights, "
        f"{w['max_abs_diff_same_weights_floor']:.3f} (mean {w['mean_abs_diff_same_weights_floor']:.3f}): bf16 "
        "kernels differ most on unlikely tokens.", ""]
    if three:
        cmp_ = {k: v for k, v in (three.get("dfpo_off_vs_trl") or {}).items() if k != "step_time"}  # a timing
        same = [k for k, v in cmp_.items() if isinstance(v, dict) and v["max_abs_diff"] == 0]
        differ = {k: v for k, v in cmp_.items() if isinstance(v, dict) and v["max_abs_diff"] != 0}
        w3 = three["weight_sync_numbers"]
        lines += [
            f"**DFPO off against `GRPOTrainer` in server mode** (`vllm_server.py`, three runs, one server each, vLLM "
            f"sampling seeded per request, {three['cards'][0]}): identical in {', '.join(f'`{k}`' for k in same)} at "
            "every step; " + "; ".join(f"`{k}` differs from step {v['first_step_differing']} on by at most "
                                       f"{v['max_abs_diff']:.1e}" for k, v in differ.items())
            + ". Rewards, gradient norms and entropies are identical, so the two servers drew the same samples; the "
            "importance-sampling ratio, computed from each server's log-probabilities of them, differs in the 5th "
            "decimal and the loss with it (two servers' log-probabilities differing in their last bits; not traced "
            "further). This run's weight check used the earlier max-only rule (`weight_sync_check` "
            f"{str(three['weight_sync_check']).lower()}: max {w3['max_abs_diff_server_vs_trained']:.3f} nats at one "
            f"token, mean {mean_abs(w3['server'], w3['trained']):.3f} against "
            f"{mean_abs(w3['server'], w3['initial']):.3f} from the initial model), replaced by the bound above.", ""]
        steps = {k: mean_step_time(r.get("per_step", {}), False) for k, r in three["runs"].items()}
        train = {k: mean_step_time(r.get("per_step", {}), True) for k, r in three["runs"].items()}
        if all(steps.values()) and all(train.values()):
            lines += [
                f"**Server mode**, one run each (steps 2–16, TRL's `step_time`): DFPO Min-Replace "
                f"{steps['dfpo'] / steps['trl']:.2f}× and DFPO off {steps['dfpo_off'] / steps['trl']:.2f}× "
                f"`GRPOTrainer`'s mean step ({steps['trl']:.3f} s). One run per method, not interleaved: a "
                f"measurement, not an interval. Its steps that did not generate took {train['dfpo']:.3f} s "
                f"against TRL's {train['trl']:.3f} s (DFPO off {train['dfpo_off']:.3f} s) on this 135M model.", ""]
    return lines
