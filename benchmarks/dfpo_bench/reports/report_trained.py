"""RESULTS.md's section on trained weights (``benchmarks/dfpo_bench/trained/``): TRL's vLLM importance-sampling ratio
at the recipes' sampling settings against completion length, the independent meter beside it, and the learning runs
as far as they got. Called by ``dfpo_bench.reports.report``; every number is read from ``results/trained/``."""

from __future__ import annotations

import ast
import io
import math
import pathlib
import re
import statistics
import tarfile
from typing import Any

from dfpo_bench.lib.common import load_json, part_seconds, save_figure

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
        "(`benchmarks/dfpo_bench/trained/`)",
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
        "line when a rollout's ratio falls below 0.5) is in docs/source/concepts/decisions.md, "
        "\"vLLM's importance-sampling ratio "
        "under truncated sampling\". The first run of the script changed the sampling settings after building "
        "the trainer, and TRL had built its log-prob head at temperature 1.0: its recipe-setting rows were "
        "scored at the wrong temperature (kept in `is_ratio_qwen05_first_run_wrong_temperature.json`; only its "
        "untruncated row is used above).",
        "",
    ]
    learn = learn_records(folder)
    if learn:
        lines += learn_lines(learn, fig_dir, out)
        earlier = partial_runs(folder / "learn_qwen05_partial_logs.tgz")
        if earlier:
            lines += [f"(An earlier session's {len(earlier)} learning runs were cut by the device budget at steps "
                      f"{min(r['steps'] for r in earlier)}–{max(r['steps'] for r in earlier)}; their logs are kept in "
                      "`learn_qwen05_partial_logs.tgz` and not used.)", ""]
    cards = load_json(folder / "cards_8b.json")
    if cards:
        lines += cards_lines(cards)
    pairs = load_json(folder / "gen_pairs_8b.json")
    if pairs:
        lines += generation_pairs_lines(pairs, folder / "gen_pairs_8b.log")
    return lines


# Later sessions' learning runs, beside the first session's ``learn_qwen05.json``: file -> what the report calls it
LATER_LEARNING = {"learn_qwen05_seed2.json": "second session"}


def learn_records(folder: pathlib.Path) -> dict[str, Any] | None:
    """The learning runs of every session, each run marked with its session (``first session`` for
    ``learn_qwen05.json``); None when the first session's file is missing."""
    first = load_json(folder / "learn_qwen05.json")
    if not first:
        return None
    runs = [{**run, "session": "first session"} for run in first["runs"]]
    for name, session in LATER_LEARNING.items():
        later = load_json(folder / name)
        if later:
            runs += [{**run, "session": session} for run in later["runs"]]
    return {**first, "runs": runs}


# ------------------------------------------------------------------------------------------- the learning runs
def series_mean(run: dict[str, Any], key: str, from_step: int = 1) -> float | None:
    values = [v for step, v in run["series"].get(key, []) if step >= from_step]
    return statistics.fmean(values) if values else None


def paired_time_ratios(runs: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """Per seed with both arms complete: Min-Replace's whole-loop time (the sum of TRL's ``step_time``) ÷ DFPO off's,
    the two started side by side and sharing the GPU."""
    by = {(r["method"], r["seed"]): r for r in runs if r.get("complete")}
    out = []
    for (method, seed), run in sorted(by.items()):
        if method == "min_replace" and ("off", seed) in by:
            mine = sum(v for _, v in run["series"]["step_time"])
            base = sum(v for _, v in by[("off", seed)]["series"]["step_time"])
            out.append((seed, mine / base))
    return out


def learn_figure(record: dict[str, Any], fig_dir: pathlib.Path, out: pathlib.Path) -> str:
    """Left: held-out avg@k over steps, one line a run. Right: the IS contrast's gradient norm and TRL's ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"off": "tab:blue", "min_replace": "tab:orange", "min_replace_is_on": "tab:red"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in record["runs"]:
        curve = (run.get("heldout") or {}).get("curve") or []
        if run["method"] in colours and curve and run.get("complete"):
            left.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", color=colours[run["method"]],
                      alpha=0.8, label=f"{run['method']} s{run['seed']}")
    left.set_xlabel("optimizer step")
    left.set_ylabel("held-out avg@k")
    left.legend(fontsize=7)
    for run in record["runs"]:
        if run["method"] in ("min_replace_is_on",) or (run["method"] == "min_replace" and run["seed"] == 0):
            grad = [(step, v) for step, v in run["series"].get("grad_norm", []) if v > 0]  # 0: no group had signal
            right.scatter([s for s, _ in grad], [v for _, v in grad], s=9, color=colours[run["method"]],
                          label=f"{run['method']} s{run['seed']}: grad norm (steps with signal)")
    right.set_yscale("log")
    right.set_xlabel("optimizer step")
    right.set_ylabel("gradient norm (before clipping)")
    right.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, fig_dir, "trained_learning.png", out, 110)


def learn_lines(record: dict[str, Any], fig_dir: pathlib.Path, out: pathlib.Path) -> list[str]:
    from dfpo_bench.lib.stats import mean_ci

    runs = record["runs"]
    card = next((r["card"] for r in runs if r.get("card")), "?")
    commits = sorted({(r.get("checkout") or {}).get("commit", "?")[:10] for r in runs})
    metric = next(((r.get("heldout") or {}).get("metric") for r in runs if (r.get("heldout") or {}).get("metric")),
                  "held-out accuracy")
    lines = [
        f"**Learning runs** ({card}; commit {', '.join(commits)}; `dfpo_bench.trained.learn`, `qwen05_lora.yaml`: "
        "the 8B LoRA recipe's objective, LoRA, batch shape, 768-token completions and sampling, colocated vLLM, "
        "importance-sampling correction off (the recipes' setting), the offline two-step task; all of a session's "
        "runs at once on the GPU, the two arms of a seed started next to each other; rows marked \"second session\" "
        "ran in a later session, beside other jobs on the same GPU). `min_replace_is_on` is seed 0's Min-Replace "
        "run with TRL's default correction (`sequence_mask`) left on; `transformers_eval` runs one step without "
        "vLLM to time the greedy held-out path.",
        "",
        f"| run | exit | steps | {metric} before → after (curve) | TRL's IS ratio, mean | off-policy φ, mean | "
        "clipped share (rows with signal) | one-sided groups | median step s | whole loop s | held-out eval s "
        "(before, after) | peak GPU GiB |",
        "|---" * 12 + "|",
    ]
    for run in runs:
        held = run.get("heldout") or {}
        curve = " ".join(f"{step}:{acc:.2f}" for step, acc in held.get("curve") or [])
        fmt = lambda v, d=3: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
        steps = run["series"].get("step_time", [])
        memory = run.get("peak_gpu_memory_mib")
        later = "" if run.get("session", "first session") == "first session" else f" ({run['session']})"
        lines.append(
            f"| {run['method']} s{run['seed']}{later} | {run['exit_code']} | {run.get('steps')} | "
            f"{fmt(held.get('before'))} → {fmt(held.get('after'))} ({curve}) | "
            f"{fmt(series_mean(run, 'sampling/importance_sampling_ratio/mean'), 3)} | "
            f"{fmt(series_mean(run, 'diagnostics/phi_mean_off_policy'))} | "
            f"{fmt(series_mean(run, 'diagnostics/clip_fraction_signal'))} | "
            f"{fmt(series_mean(run, 'cancellation/one_sided_groups'))} | "
            f"{fmt(statistics.median(v for _, v in steps) if steps else None, 2)} | "
            f"{fmt(sum(v for _, v in steps) if steps else None, 0)} | "
            f"{fmt(held.get('before_seconds'), 0)}, {fmt(held.get('after_seconds'), 0)} | "
            f"{fmt(memory / 1024 if memory else None, 1)} |")
    ratios = paired_time_ratios(runs)
    if ratios:
        logs = mean_ci([math.log(r) for _, r in ratios])
        text = ", ".join(f"seed {s}: {r:.3f}" for s, r in ratios)
        if logs is not None and logs[3] >= 2:
            text += (f"; geometric mean {math.exp(logs[0]):.3f}, 95% t-interval {math.exp(logs[1]):.3f}–"
                     f"{math.exp(logs[2]):.3f} over {logs[3]} seeds")
        lines += ["", f"Whole-loop time, Min-Replace ÷ DFPO off (sum of TRL's `step_time`, paired by seed): {text}."]
    lines += ["", f"![learning runs]({learn_figure(record, fig_dir, out)})", ""]
    lines += learn_findings(runs)
    return lines


IS_MEAN = "sampling/importance_sampling_ratio/mean"


def learn_findings(runs: list[dict[str, Any]]) -> list[str]:
    """What the runs show, each number read from them: learning, the IS contrast, the evaluation paths' times."""
    by: dict[tuple[str, int], dict[str, Any]] = {}
    for run in runs:  # a complete run of a (method, seed) wins over one another session stopped
        if run.get("complete") or (run["method"], run["seed"]) not in by:
            by[(run["method"], run["seed"])] = run
    done = [r for r in runs if r.get("complete") and r["method"] in ("off", "min_replace")]
    lines = []
    if done:
        gains = [(r["heldout"]["after"] - r["heldout"]["before"]) for r in done]
        seeds = {arm: sorted(r["seed"] for r in done if r["method"] == arm) for arm in ("off", "min_replace")}
        lines.append(
            f"Every complete run learned: avg@k rose by {min(gains):+.2f} to {max(gains):+.2f} over 100 steps "
            f"({len(done)} runs; seeds {', '.join(map(str, seeds['off']))} of DFPO off and "
            f"{', '.join(map(str, seeds['min_replace']))} of Min-Replace).")
        lines += gain_comparison(done)
    for session in sorted({r.get("session", "first session") for r in runs}):
        stopped = [f"{r['method']} s{r['seed']}" for r in runs
                   if r.get("exit_code") == 143 and r.get("session", "first session") == session]
        if stopped:
            lines.append(f"{', '.join(stopped)} ({session}) were stopped by hand (exit 143) at their start, "
                         f"{STOPPED_WHY.get(session, '')}; they are not runs of the comparison.")
    on, off = by.get(("min_replace_is_on", 0)), by.get(("min_replace", 0))
    if on and off and on.get("complete") and off.get("complete"):
        def signal_mean(run: dict[str, Any]) -> float:  # over steps with signal (0: no group had both signs)
            return statistics.fmean(v for _, v in run["series"]["grad_norm"] if v > 0)

        g_on, g_off = signal_mean(on), signal_mean(off)
        ratio = series_mean(on, "sampling/importance_sampling_ratio/mean")
        lines += ["", f"The importance-sampling setting in a run (seed 0, Min-Replace, the same rollouts' settings): "
                  f"with TRL's default correction on, the rollouts' mean sequence ratio was {ratio:.3f} and the mean "
                  f"gradient norm over steps with signal {g_on:.3f}, against {g_off:.3f} with the correction off "
                  f"(the recipes' setting), {g_off / g_on:.1f}× larger; the held-out avg@k after 100 steps was "
                  f"{on['heldout']['after']:.3f} on and {off['heldout']['after']:.3f} off (one seed each: Adam's "
                  "normalisation absorbs much of a uniform shrink, not the length-dependent part). Across the "
                  "steps with signal, the correlation of the log gradient norm with the log of the rollout's mean "
                  f"completion length was {length_correlation(on, 'grad_norm'):+.2f} with the correction on and "
                  f"{length_correlation(off, 'grad_norm'):+.2f} off, and the rollout's log mean ratio fell with its "
                  f"mean length (correlation {length_correlation(on, IS_MEAN):+.2f})."]
    greedy = by.get(("transformers_eval", 0))
    sampled = [r for r in done if (r.get("heldout") or {}).get("before_seconds")]
    if greedy and sampled:
        held = greedy["heldout"]
        seconds = [r["heldout"][key] for r in sampled for key in ("before_seconds", "after_seconds")
                   if r["heldout"].get(key)]
        lines += ["", f"Evaluation paths, on the same GPU shared by all the runs (so indicative only): avg@8 through "
                  f"vLLM (64 problems × 8 sampled completions of up to 768 tokens) took {min(seconds):.0f}–"
                  f"{max(seconds):.0f} s; transformers' greedy path (64 completions, batch 64) took "
                  f"{held['before_seconds']:.0f} and {held['after_seconds']:.0f} s, about "
                  f"{8 * held['before_seconds'] / statistics.median(seconds):.1f}× longer per completion than the "
                  "median vLLM evaluation."]
    hashes = sorted({json_key(r.get("checkout") or {})[:12] for r in runs
                     if r.get("session", "first session") == "first session"})
    lines += ["", "Provenance: the first session's records name commit 0f29322 with an uncommitted diff (source hashes "
              f"{', '.join(hashes)}): the GPU machine's copy of the repository kept this session's first commit as "
              "HEAD. The tree it ran was commit 94ac975's benchmark and product code with two edits not yet committed "
              "(cards_8b.py's `--configs`, committed next; a draft of this report); DFPO off seed 0 started before "
              "the `--configs` edit reached the machine, the other runs after it, hence two source hashes. Neither "
              "edit is imported by the runs."]
    later = [r for r in runs if r.get("session", "first session") != "first session" and r.get("checkout")]
    for commit, source in sorted({(r["checkout"].get("commit", "?")[:7], json_key(r["checkout"])[:12])
                                  for r in later}):
        lines += ["", f"The second session's records name commit {commit} with an uncommitted diff and source hash "
                  f"{source}: the hash of commit a40acd4's sources (checked by recomputing it at that commit), which "
                  "the GPU machine ran while its copy of the repository kept the session's first HEAD."]
    return lines + [""]


# Why a session's runs were stopped by hand at their start (RESULTS says so beside the names)
STOPPED_WHY = {
    "first session": "so that the others could finish within the device budget",
    "second session": "so that the device time left went to the generation pairs below and study v4's pilot",
}


def gain_comparison(done: list[dict[str, Any]]) -> list[str]:
    """Min-Replace's held-out gain minus DFPO off's, paired by seed: the mean with its 95% t-interval and the
    difference the runs could have detected (80% power, two-sided 0.05)."""
    from dfpo_bench.lib.stats import mde_t, mean_ci, t_quantile

    gain = {(r["method"], r["seed"]): r["heldout"]["after"] - r["heldout"]["before"] for r in done}
    diffs = [(seed, gain[("min_replace", seed)] - gain[("off", seed)]) for (method, seed) in sorted(gain)
             if method == "min_replace" and ("off", seed) in gain]
    ci = mean_ci([d for _, d in diffs])
    if ci is None or ci[3] < 2:
        return []
    mean, low, high, n = ci
    se = (high - mean) / t_quantile(n - 1)  # the interval's half-width is t(0.975, n - 1) × se
    each = ", ".join(f"s{seed}: {d:+.3f}" for seed, d in diffs)
    return [f"Held-out gain, Min-Replace − DFPO off, paired by seed ({each}): "
            f"mean {mean:+.3f}, 95% t-interval {low:+.3f} to {high:+.3f} over {n} seeds; a difference below "
            f"{mde_t(se, n - 1):.2f} in avg@k could not have been detected (80% power), so none is claimed: "
            "not detected above that size."]


def length_correlation(run: dict[str, Any], key: str) -> float:
    """Pearson correlation over steps of log(``key``) with log(mean completion length), positive values only."""
    lengths = dict(run["series"]["completions/mean_length"])
    pairs = [(math.log(lengths[step]), math.log(v)) for step, v in run["series"][key] if v > 0 and step in lengths]
    xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((a - mx) * (b - my) for a, b in pairs)
    return cov / math.sqrt(sum((a - mx) ** 2 for a in xs) * sum((b - my) ** 2 for b in ys))


def json_key(checkout: dict[str, Any]) -> str:
    return str(checkout.get("source_sha256") or "?")


# ------------------------------------------------------------------------------------------------- the 8B cards
def cards_lines(record: dict[str, Any]) -> list[str]:
    """The 8B LoRA recipe's cards table (``trained/cards_8b.py --table``): a row per configuration, a cell per card."""
    rows = record["rows"]
    cards = record["cards_gib"]
    sample = next((r for r in rows if not r["crash"]), None)
    lines = [
        "**The 8B LoRA recipe's cards** (`dfpo_bench.trained.cards_8b`; records in `results/trained/cards_8b/`). "
        "One NVIDIA H200 (141 GB); Qwen3-8B's architecture with random weights, `recipes/qwen3_8b_lora.yaml`'s LoRA, "
        "batch, 768-token completions and Min-Replace; one rollout and its two optimizer steps per process. The need "
        "is PyTorch's peak reserved memory plus what the process holds outside PyTorch (the CUDA context and "
        "libraries: `nvidia-smi` less `memory_reserved`, 0.7–0.9 GiB). A card of N GB is taken as N GiB. A cell is "
        "*deduced* from the uncapped run (below the peak allocated plus overhead: cannot fit; at or above the need: "
        "fits); no cell here needed a capped run, except the default allocator's 32 and 40 GB, which were not run. "
        "The times are one rollout on a GPU shared with other jobs (study v4's processes): indicative only.",
        "",
        "| configuration | peak allocated GiB | need GiB | " + " | ".join(f"{c:g} GB" for c in cards)
        + " | rollout s (generation s) | pre-pass share of the loop |",
        "|---" * (5 + len(cards)) + "|",
    ]
    for r in rows:
        label = f"{r['generation']}, batch {r['batch']}"
        if r["generation"] != "transformers":
            label += f", engine {r['engine_gib_requested']:g} GiB" + (", sleep mode" if r["sleep_mode"] else "")
        if r["allocator"] == "default":
            label += ", default allocator"
        if r["crash"]:
            lines.append(f"| {label} ({r['variant']}) | – | – | " + " | ".join("–" for _ in cards)
                         + f" | crashed: {r['crash'][:90]} | – |")
            continue

        def mark(c: dict[str, Any]) -> str:
            if c["fits"] is None:
                return "not run"
            verdict = "yes" if c["fits"] else "no"
            util = ""
            if c["fits"] and "vllm_gpu_memory_utilization" in c:
                util = f", util {c['vllm_gpu_memory_utilization']:.2f}"
            return f"{verdict} ({c['how']}{util})"

        generation = f" ({r['generation_s']:.1f})" if r.get("generation_s") else ""
        share = f"{100 * r['pre_pass_share']:.1f}%" if r["pre_pass_s"] else "no pre-pass"
        lines.append(f"| {label} | {r['peak_allocated_gib']:.1f} | {r['needs_gib']:.1f} | "
                     + " | ".join(mark(c) for c in r["cards"]) + f" | {r['rollout_s']:.1f}{generation} | {share} |")
    if sample:
        lines += ["", "util: the `vllm_gpu_memory_utilization` that gives the engine the same memory on that card "
                  "(engine GiB ÷ card GiB). Settings per card are in `recipes/qwen3_8b_lora.yaml`'s header.", ""]
    return lines


# ------------------------------------------------------------------------- generation under the pre-pass layout
def trend_adjusted_ratio(sequence: list[tuple[bool, float]]) -> tuple[float, float, float] | None:
    """The treated runs' time ÷ the others', from least squares on log time with an intercept, a linear trend in
    run order and a treatment indicator (the load on a shared GPU drifts during a job); (ratio, low, high) with the
    coefficient's 95% t-interval. ``sequence``: (treated, seconds) in the order the runs ran."""
    import numpy as np

    from dfpo_bench.lib.stats import t_quantile

    if len(sequence) < 4 or len({t for t, _ in sequence}) < 2:
        return None
    design = np.array([[1.0, float(i), 1.0 if treated else 0.0] for i, (treated, _) in enumerate(sequence)])
    log_time = np.log([seconds for _, seconds in sequence])
    coef, *_ = np.linalg.lstsq(design, log_time, rcond=None)
    residual = log_time - design @ coef
    dof = len(sequence) - 3
    variance = float(residual @ residual) / dof * np.linalg.inv(design.T @ design)[2, 2]
    half = t_quantile(dof) * math.sqrt(variance)
    return math.exp(coef[2]), math.exp(coef[2] - half), math.exp(coef[2] + half)


def generation_pairs_lines(record: dict[str, Any], log: pathlib.Path) -> list[str]:
    """Transformers generation under the pre-pass layout (Min-Replace at per-device batch 4 < G) against TRL's
    GRPOTrainer at the same batch, 8B LoRA shape, interleaved rounds (``cost/users_size.py --no-vllm``)."""
    from dfpo_bench.lib.stats import mean_ci

    treated, base = "min_replace_b4", "trl_b4"
    rounds = [r for r in record["rounds"] if treated in r["runs"] and base in r["runs"]]
    cut = [r for r in record["rounds"] if r not in rounds]
    sequence = [(False, part_seconds(record["warm_up"], "generation_s"))] + [
        (method == treated, part_seconds(r["runs"][method], "generation_s"))
        for r in record["rounds"] for method in r["order"] if method in r["runs"]]
    tokens = sorted({m.group(1) for m in re.finditer(r"'num_tokens': '([^']+)'", log.read_text())}) \
        if log.exists() else []
    requested = re.search(r"--rounds (\d+)", record["command"])
    lines = [
        f"**Generation under the pre-pass layout** (`dfpo_bench.cost.users_size --no-vllm`, {record['card']}; "
        f"commit {record['commit'][:7]} with a diff, source hash {record['source_sha256'][:12]}, the second "
        "session's). Qwen3-8B's architecture with random weights, the 8B recipe's LoRA, per-device batch 4 "
        "(< G = 8: Min-Replace takes the pre-pass layout, TRL's trainer has none), 768-token completions through "
        f"transformers' `generate`, PyTorch capped at {record['cap_gib']} GiB ({record['allocator']}): a 24 GiB "
        "card less what the process holds outside PyTorch. A run is one rollout and its two optimizer steps from the "
        "same initial weights; a round runs both methods in a shuffled order; the first run is a warm-up of TRL's. "
        "The first rounds shared the GPU with the second session's learning runs (and round 0 with study v4's "
        "pilot), so the absolute times drift; the ratio is taken within a round and, over all runs, with a linear "
        "trend in run order.",
        "",
        "| round | order | TRL generation s | pre-pass layout generation s | ratio | pre-pass forward s (share of the "
        "run) | peak reserved GiB (TRL, pre-pass) |",
        "|---" * 7 + "|",
    ]
    ratios = []
    for index, r in enumerate(record["rounds"]):
        if r not in rounds:
            continue
        mine, theirs = r["runs"][treated], r["runs"][base]
        generated, baseline = part_seconds(mine, "generation_s"), part_seconds(theirs, "generation_s")
        ratio = generated / baseline
        ratios.append(ratio)
        pre_pass = part_seconds(mine, "pre_pass_s")
        lines.append(f"| {index} | {' then '.join(r['order'])} | {baseline:.1f} | {generated:.1f} | {ratio:.3f} | "
                     f"{pre_pass:.2f} ({pre_pass / mine['total_s']:.1%}) | "
                     f"{theirs['peak_reserved_gib']:.1f}, {mine['peak_reserved_gib']:.1f} |")
    logs = mean_ci([math.log(r) for r in ratios])
    fitted = trend_adjusted_ratio(sequence)
    lines.append("")
    if logs is not None and logs[3] >= 2:
        lines.append(f"Generation time, pre-pass layout ÷ TRL's, paired within rounds: geometric mean "
                     f"{math.exp(logs[0]):.3f}, 95% t-interval {math.exp(logs[1]):.3f}–{math.exp(logs[2]):.3f} over "
                     f"{logs[3]} pairs" + (f" ({len(rounds)} of the {requested.group(1)} rounds asked for finished; "
                                           f"{len(cut)} was cut by the device budget after its first run)"
                                           if requested and cut else "") + ".")
    if fitted is not None:
        lines.append(f"Over all {len(sequence)} runs in the order they ran, with a linear trend: "
                     f"{fitted[0]:.3f}, 95% t-interval {fitted[1]:.3f}–{fitted[2]:.3f}.")
    if len(tokens) == 1:
        lines.append(f"Every run generated the same {float(tokens[0]):,.0f} tokens (TRL's `num_tokens`, from the "
                     "job's log): the same work in both layouts.")
    peak = max(r["runs"][m]["peak_reserved_gib"] for r in rounds for m in (treated, base))
    lines.append(f"The largest peak reserved, {peak:.1f} GiB, stayed below the cap.")
    upper = max(v for v in (fitted[2] if fitted else None, math.exp(logs[2]) if logs else None) if v is not None)
    lines += ["", "What it shows. No generation slowdown under the pre-pass layout was detected above "
              f"{upper - 1:.1%} (the larger upper bound of the two intervals), which excludes the roughly 10% seen "
              "earlier in two pairs on an H100. Nothing of the layout runs before or during "
              "generation: the pre-pass forward runs inside the loss micro-steps (here at the rollout's second, "
              "off-policy optimizer step), after TRL has generated and scored the rollout from the same prompts in "
              "the same generation batch; what moved between runs was the load on the shared GPU, and this job's own "
              "times moved by more than its pairs differ.", ""]
    return lines
