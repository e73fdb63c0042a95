"""RESULTS.md's section on trained weights (``benchmarks/trained/``): TRL's vLLM importance-sampling ratio at the
recipes' sampling settings against completion length, the independent meter beside it, and the learning runs as far
as they got. Called by ``benchmarks/reports/report.py``; every number is read from ``results/trained/``."""

from __future__ import annotations

import ast
import io
import math
import pathlib
import re
import statistics
import tarfile
from typing import Any

from benchmarks.lib.common import load_json, save_figure

BINS = ((0, 100), (100, 300), (300, 1000), (1000, 4097))
LABELS = {"untruncated_t1": "untruncated, T 1.0", "recipe_8b_lora": "8B recipe: T 0.7, top-p 0.8, top-k 20",
          "recipe_32b": "32B recipe: T 0.6, top-p 0.95, top-k 20"}
_NUMBER = re.compile(r"^-?[\d.]+(e[+-]?\d+)?$")


def ratio_figure(record: dict[str, Any], fig_dir: pathlib.Path, out: pathlib.Path) -> str:
    """TRL's sequence ratio (log scale) against completion length, one panel per setting, with exp(Σ log K)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = record["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), sharey=True)
    for ax, setting in zip(axes, settings, strict=True):
        rows = setting["rows"]
        ratio = [max(r, 1e-45) for r in rows["trl_ratio"]]
        support = [math.exp(max(s, -103.0)) for s in rows["sum_log_mass"]]
        ax.scatter(rows["length"], ratio, s=8, label="TRL's ratio (sequence_mask)")
        ax.scatter(rows["length"], support, s=8, marker="x", label="exp(Σ log K): truncated mass")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(LABELS.get(setting["setting"], setting["setting"]), fontsize=9)
        ax.set_xlabel("completion length (tokens)")
    axes[0].set_ylabel("factor on the row's loss")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, fig_dir, "trained_is_ratio.png", out, 110)


def binned_rows(setting: dict[str, Any]) -> list[str]:
    rows = setting["rows"]
    cells = []
    for low, high in BINS:
        picked = [i for i, length in enumerate(rows["length"]) if low <= length < high]
        if not picked:
            cells.append("–")
            continue
        ratio = statistics.median(rows["trl_ratio"][i] for i in picked)
        cells.append(f"{ratio:.2g} (n {len(picked)})")
    return cells


def partial_runs(archive: pathlib.Path) -> list[dict[str, Any]]:
    """Steps reached, step time, sampled reward and held-out accuracy of each run's log in the archive."""
    if not archive.exists():
        return []
    runs = []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not member.name.endswith(".log") or "/logs/" not in member.name:
                continue
            text = io.TextIOWrapper(tar.extractfile(member), errors="replace").read()
            steps = []
            for line in text.splitlines():
                if line.startswith("{'loss'"):
                    entry = ast.literal_eval(line)
                    steps.append({k: float(v) for k, v in entry.items() if _NUMBER.match(str(v))})
            before = re.search(r"held-out greedy accuracy before training: ([\d.]+) \((\d+) problems, (\d+) s\)", text)
            name = member.name.rsplit("/", 1)[-1]
            method, seed = name.split("__")[1], name.split("__")[2].split(".")[0].removeprefix("s")
            rewards = [s["reward"] for s in steps if "reward" in s]
            runs.append({"method": method, "seed": seed, "steps": len(steps),
                         "step_time": statistics.median(s["step_time"] for s in steps if "step_time" in s),
                         "reward_first": statistics.mean(rewards[:3]), "reward_last": statistics.mean(rewards[-3:]),
                         "heldout_before": before.groups() if before else None})
    return runs


def peak_memory_gib(archive: pathlib.Path) -> list[float]:
    """Each process's largest GPU memory in the archive's ``nvidia-smi`` samples (GiB)."""
    peaks: dict[str, float] = {}
    with tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("gpu_memory.csv")), None)
        if member is None:
            return []
        for line in io.TextIOWrapper(tar.extractfile(member)).read().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[2].endswith("MiB"):
                peaks[parts[1]] = max(peaks.get(parts[1], 0.0), float(parts[2].split()[0]) / 1024)
    return sorted(peaks.values())


def trained_section(results: pathlib.Path, fig_dir: pathlib.Path, out: pathlib.Path, number: int) -> list[str]:
    folder = results / "trained"
    record = load_json(folder / "is_ratio_qwen05.json")
    if not record:
        return []
    figure = ratio_figure(record, fig_dir, out)
    versions = record["versions"]
    lines = [
        f"## {number}. Trained weights: the importance-sampling ratio at the recipes' settings "
        "(`benchmarks/trained/`)",
        "",
        f"{record['card']}; torch {versions['torch']}, transformers {versions['transformers']}, TRL {versions['trl']}, "
        "vLLM 0.26.0 colocated. Model: Qwen2.5-Coder-0.5B-Instruct, trained weights (the GPU kit's bf16 checkpoint). "
        f"Eight prompts from a two-digit sum to a long code module, {record['runs']['second']['num_generations']} "
        f"completions each (16 in the untruncated run), up to {record['max_completion']} tokens. `is_ratio.py` runs "
        "TRL's own rollout (`vllm_importance_sampling_correction` on, mode `sequence_mask`) and, beside it, a "
        "forward with the full logits that rebuilds vLLM's top-k/top-p support and takes its mass K under the "
        "trainer's tempered distribution. That forward's log-prob of each sampled token equals TRL's "
        "`old_per_token_logps` to within 5e-7 (the meter's check).",
        "",
        "| sampling | tokens | gap trainer − vLLM per token | log K per token | gap − log K | "
        + " | ".join(f"TRL's ratio, median, length {low}–{high - 1}" for low, high in BINS) + " |",
        "|---" * (5 + len(BINS)) + "|",
    ]
    for setting in record["settings"]:
        tokens = setting["tokens"]
        lines.append(f"| {LABELS.get(setting['setting'], setting['setting'])} | {tokens['count']} | "
                     f"{tokens['mean_gap']:+.4f} | {tokens['mean_log_mass']:+.4f} | {tokens['mean_mismatch']:+.5f} | "
                     + " | ".join(binned_rows(setting)) + " |")
    recipe = {s["setting"]: s for s in record["settings"]}
    lora = recipe.get("recipe_8b_lora", {}).get("tokens", {})
    lora_rows = recipe.get("recipe_8b_lora", {}).get("rows", {"trl_ratio": [], "length": []})
    mid = [r for r, length in zip(lora_rows["trl_ratio"], lora_rows["length"], strict=True) if 300 <= length < 1000]
    lines += [
        "",
        f"![TRL's ratio against length]({figure})",
        "",
        "(Rows TRL masks, a ratio above its cap 3, are drawn at the plot's floor.)",
        "",
        "What it shows. Under truncated sampling vLLM returns log-probs renormalised over the top-k/top-p support "
        "(`logprobs_mode=processed_logprobs`), while the trainer scores the untruncated tempered distribution, so "
        "each token's gap is log K ≤ 0: at the 8B recipe's settings the gap per token "
        f"({lora.get('mean_gap', float('nan')):+.4f}) equals log K ({lora.get('mean_log_mass', float('nan')):+.4f}) "
        f"to {abs(lora.get('mean_mismatch', float('nan'))):.5f}; what is left is the engines' numerical mismatch. "
        "TRL's sequence ratio is exp(Σ gap): it falls exponentially with length, so at the 8B recipe's settings a "
        f"completion of 300–999 tokens gets a median factor of {statistics.median(mid) if mid else float('nan'):.1g} "
        "and carries no gradient. The "
        "decision this led to (the recipes turn the correction off when they truncate, and the trainer prints one "
        "line when a rollout's ratio falls below 0.5) is in docs/decisions.md, \"vLLM's importance-sampling ratio "
        "under truncated sampling\". The first run of the script changed the sampling settings after building "
        "the trainer, and TRL had built its log-prob head at temperature 1.0: its recipe-setting rows were "
        "scored at the wrong temperature (kept in `is_ratio_qwen05_first_run_wrong_temperature.json`; only its "
        "untruncated row is used above).",
        "",
    ]
    runs = partial_runs(folder / "learn_qwen05_partial_logs.tgz")
    if runs:
        lines += [
            "**The learning runs did not finish** (`benchmarks/trained/learn.py`, `qwen05_lora.yaml`: the 8B LoRA "
            "recipe's objective, LoRA, batch shape, 768-token completions and sampling, the correction off, the "
            "offline two-step arithmetic task; six runs at once on the one GPU). The session's device time ended "
            "before any reached step 100, so no comparison of DFPO off and Min-Replace is made here. What the logs "
            "show, as they stood:",
            "",
            "| run | optimizer steps reached | median step time (s, six runs sharing the GPU) | sampled reward, "
            "first 3 rollouts → last 3 | held-out greedy accuracy before training (problems, seconds) |",
            "|---|---|---|---|---|",
        ]
        for run in runs:
            before = run["heldout_before"]
            held = f"{before[0]} ({before[1]}, {before[2]} s)" if before else "–"
            lines.append(f"| {run['method']} seed {run['seed']} | {run['steps']} | {run['step_time']:.2f} | "
                         f"{run['reward_first']:.3f} → {run['reward_last']:.3f} | {held} |")
        peaks = peak_memory_gib(folder / "learn_qwen05_partial_logs.tgz")
        if peaks:
            lines += ["", f"Each of the {len(peaks)} processes (trainer and its colocated engine at "
                      "`vllm_gpu_memory_utilization` 0.12) peaked at "
                      f"{peaks[0]:.1f}–{peaks[-1]:.1f} GiB in `nvidia-smi`, most of it the engine's reservation."]
        lines.append("")
    return lines
