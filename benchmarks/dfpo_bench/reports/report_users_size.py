"""RESULTS.md's section on the users' size (``benchmarks/dfpo_bench/cost/users_size.py``, ``microstep_profile.py``,
``prepass_rows.py``, ``memory_model.py``): the whole-loop and loss-step ratios to GRPOTrainer with their intervals,
the time split, memory, the pre-pass's rows, the micro-step profile and the 32B memory on paper. Called by
``dfpo_bench.reports.report``; every number is read from the files in ``results/users_size/`` and ``results/``."""

from __future__ import annotations

import pathlib
from typing import Any

from dfpo_bench.lib.common import load_json, save_figure

RESOLUTION = 1.01  # the ratio the whole-loop study is asked to decide: at most 1.01x TRL's time


def verdict(interval: list[float]) -> str:
    """What a 95% interval of a ratio decides against 1.01x."""
    low, high = interval
    if high <= RESOLUTION:
        return "≤ 1.01× (decided)"
    if low > RESOLUTION:
        return "> 1.01× (decided)"
    return f"not resolved (width {high - low:.3f})"


def ratio_cell(entry: dict[str, Any], key: str) -> str:
    r = entry.get(f"{key}_ratio")
    if not r:
        return "baseline"
    low, high = r["interval_95"]
    return f"{r['median']:.3f} [{low:.3f}, {high:.3f}]"


def run_table(run: dict[str, Any]) -> list[str]:
    engine = run["engine"]["allocated_gib"]
    lines = ["| method | layout | run (s) | rollout (s) | of it generation / weight sync (s) | loss steps (s) | "
             "peak allocated, of it engine (GiB) | φ mean | pre-pass rows | whole loop ÷ baseline [95%] | "
             "loss steps ÷ baseline [95%] | loss steps vs 1.01× |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    layouts = {m: r["layout"] for rnd in run["rounds"] for m, r in rnd["runs"].items()}
    for method, s in run["summary"].items():
        phi = "–" if s.get("phi_mean") is None else f"{s['phi_mean']:.4f}"
        loss = s.get("loss_steps_s_ratio")
        lines.append(
            f"| `{method}` | {layouts.get(method, '–')} | {s['median_total_s']:.2f} | {s['median_rollout_s']:.2f} | "
            f"{s['median_generation_s']:.2f} / {s['median_weight_sync_s']:.3f} | {s['median_loss_steps_s']:.2f} | "
            f"{s['peak_allocated_gib']:.1f}, {engine:.1f} | {phi} | {s['pre_pass_rows_per_run']:g} | "
            f"{ratio_cell(s, 'total_s')} | {ratio_cell(s, 'loss_steps_s')} | "
            f"{verdict(loss['interval_95']) if loss else '–'} |")
    return lines


def ratio_figure(runs: dict[str, dict[str, Any]], fig_dir: pathlib.Path, out: pathlib.Path) -> str | None:
    """One panel per run: each method's loss-step and whole-loop ratio with its interval, and the 1.01 line."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (title, run) in zip(axes[0], runs.items(), strict=True):
        methods = [m for m, s in run["summary"].items() if s.get("loss_steps_s_ratio")]
        for offset, key, marker in ((-0.15, "loss_steps_s", "o"), (0.15, "total_s", "s")):
            for i, m in enumerate(methods):
                r = run["summary"][m][f"{key}_ratio"]
                low, high = r["interval_95"]
                ax.errorbar(i + offset, r["median"], yerr=[[r["median"] - low], [high - r["median"]]], fmt=marker,
                            color="C0" if key == "loss_steps_s" else "C1", capsize=3,
                            label=("loss steps" if key == "loss_steps_s" else "whole loop") if i == 0 else None)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(RESOLUTION, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("ratio to the baseline (median, 95% interval)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, fig_dir, "users_size_ratios.png", out, dpi=110)


def split_figure(runs: dict[str, dict[str, Any]], fig_dir: pathlib.Path, out: pathlib.Path) -> str | None:
    """The time split of one run (one rollout, two optimizer steps) per method: generation, sync, rest of the
    rollout, loss steps."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (title, run) in zip(axes[0], runs.items(), strict=True):
        methods = list(run["summary"])
        bottom = [0.0] * len(methods)
        parts = [("generation", lambda s: s["median_generation_s"]),
                 ("weight sync", lambda s: s["median_weight_sync_s"]),
                 ("rest of rollout", lambda s: s["median_rollout_s"] - s["median_generation_s"]
                  - s["median_weight_sync_s"]),
                 ("loss steps", lambda s: s["median_loss_steps_s"])]
        for name, part in parts:
            values = [part(run["summary"][m]) for m in methods]
            ax.bar(range(len(methods)), values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("seconds per run (median over rounds)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, fig_dir, "users_size_split.png", out, dpi=110)


def profile_rows(profile: dict[str, Any]) -> list[str]:
    rows = []
    for method, t in profile["timing"]["methods"].items():
        step, p = t["training_step"], profile["profile"].get(method, {})
        syncs = profile.get("host_syncs", {}).get(method, {})
        quiet, logging = syncs.get("non_logging_steps", {}), syncs.get("logging_steps", {})
        ratio = "baseline" if "ratio_to_trl" not in step else (
            f"{step['ratio_to_trl']:.3f} [{step['ratio_interval_95'][0]:.3f}, {step['ratio_interval_95'][1]:.3f}]")
        sites = ", ".join(f"`{x}`" for x in quiet.get("training_step_sites", []))
        rows.append(f"| `{method}` | {step['median_ms']:.1f} | {ratio} | {p.get('dfpo_self_cpu_ms', 0):.2f} | "
                    f"{p.get('dfpo_self_cuda_kernels', 0):.0f} | {quiet.get('training_step_per_step', 0):g} {sites} | "
                    f"{logging.get('log_per_step', 0):g} |")
    return rows


def profile_lines(gpu: dict[str, Any] | None, cpu_before: dict[str, Any] | None,
                  cpu_after: dict[str, Any] | None) -> list[str]:
    header = ["| method | micro-step (ms) | ÷ TRL [95%] | DFPO's own CPU time (ms) | DFPO's kernels | host syncs on "
              "the loss path per micro-step (non-logging step) | host syncs per logging step |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines: list[str] = []
    if gpu:
        lines += ["", "**One micro-step, profiled** (`benchmarks/dfpo_bench/cost/microstep_profile.py`, "
                  f"{gpu['card']}, {gpu['model']} in bf16, `{gpu['command']}`; {gpu['timing']['rounds_done']} "
                  "interleaved rounds), before the "
                  "change below (the script as of e3dc25f, the package as of 75746fb with e49928d's SmolLM2-135M "
                  "shape; the device's checkout records its base commit as dirty): a non-generating micro-step (loss "
                  "and backward) of each method, then a profile with "
                  "DFPO's parts labelled; host synchronisations counted with CUDA's sync debug mode.", "", *header,
                  *profile_rows(gpu)]
    for title, run in (("before", cpu_before), ("after", cpu_after)):
        if run:
            lines += ["", f"On the CPU, {title} the change ({run['card']}, {run['model']}, `{run['command']}`; no "
                      "device time was left for the GPU rerun):", "", *header, *profile_rows(run)]
    return lines


def prepass_rows_lines(rows: dict[str, Any] | None) -> list[str]:
    if not rows:
        return []
    lines = ["", f"**Rows the pre-pass forwards** (`dfpo_bench.cost.prepass_rows`, {rows['card']}): counted by a "
             "forward hook on the model, per off-policy optimizer step, mean over seeds and steps.", "",
             "| b | G | A | S | R | F, group order | F, TRL's per-sample order | predicted (`pre_pass_rows`) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in rows["cases"]:
        lines.append(f"| {c['b']} | {c['G']} | {c['A']} | {c['steps_per_generation']} | {c['R']} | "
                     f"{c['groups']['mean_F']:.2f} | {c['per_sample']['mean_F']:.2f} | "
                     f"{', '.join(str(x) for x in c['predicted'])} |")
    return lines


def memory_lines(model: dict[str, Any] | None) -> list[str]:
    if not model:
        return []
    lines = ["", "**Qwen3-32B's memory per GPU on paper** (`dfpo_bench.cost.memory_model`; ESTIMATED, per-device "
             f"batch 1, ZeRO-3, gradient checkpointing; {model['parameters'] / 1e9:.1f}B parameters): the terms are "
             "in the script's docstring.", "",
             "| launch | context | optimizer | params / grads / optimizer (GB) | activations + logits (GB) | total "
             "(GB) | fits 80 GB | fits 141 GB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for launch in model["launches"]:
        g = launch["per_gpu_gb"]
        act = g["checkpoints"] + g["one_layer_recomputed"] + g["logits"]
        where = "CPU offload" if launch["offload_optimizer"] else "GPU"
        lines.append(f"| {launch['launch']} | {launch['context']} | {where} "
                     f"| {g['parameters_bf16']:.1f} / {g['gradients_bf16']:.1f} / {g['optimizer_fp32']:.1f} | "
                     f"{act:.1f} | {g['total']:.1f} | {'yes' if launch['fits_80gb'] else 'no'} | "
                     f"{'yes' if launch['fits_141gb'] else 'no'} |")
    anchor = model.get("anchor_8b_lora")
    if anchor and anchor.get("measured_trainer_peak_gb"):
        lines += ["", f"Anchor: the same terms predict {anchor['predicted_gb']['total']:.1f} GB for the 8B LoRA "
                  f"trainer above; measured {anchor['measured_trainer_peak_gb']:.1f} GB (peak allocated less the "
                  f"engine's {anchor['engine_allocated_gb']:.1f} GB, {anchor['card']}): measured ÷ predicted "
                  f"{anchor['measured_over_predicted']:.2f}."]
    return lines


def _interval(entry: dict[str, Any], key: str) -> list[float] | None:
    r = entry.get(f"{key}_ratio")
    return r["interval_95"] if r else None


def findings(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The section's reading, computed from the runs."""
    out = []
    phis = [s["phi_mean"] for run in runs.values() for s in run["summary"].values() if s.get("phi_mean") is not None]
    if phis:
        out.append(f"* **φ** averaged {min(phis):.4f}–{max(phis):.4f} over the transforms' off-policy steps. At "
                   "φ = 1 the transforms ran at their full cost (no branch of their arithmetic depends on the values) "
                   "but changed nothing: after one optimizer step at learning rate 1e-5 in bf16 the policy's "
                   "log-probabilities of the rollout had not moved, every s̄ was 1 and Min-Replace is then the "
                   "identity. A run where the transforms change the update at this size was not made.")
    for title, run in runs.items():
        decided, open_, above = [], [], []
        for method, s in run["summary"].items():
            interval = _interval(s, "loss_steps_s")
            if interval is None:
                continue
            text = verdict(interval)
            (decided if text.startswith("≤") else above if text.startswith(">") else open_).append(
                f"`{method}` [{interval[0]:.3f}, {interval[1]:.3f}]")
        whole = [_interval(s, "total_s") for s in run["summary"].values() if _interval(s, "total_s")]
        widths = [b - a for a, b in whole]
        out.append(f"* **{title}**, {len(run['rounds'])} rounds. Loss steps ≤ 1.01× TRL's, decided: "
                   f"{', '.join(decided) or 'none'}; above 1.01×, decided: {', '.join(above) or 'none'}; not "
                   f"resolved: {', '.join(open_) or 'none'}. Whole loop: interval widths "
                   f"{min(widths):.3f}–{max(widths):.3f}, so "
                   f"{'none' if all(w > 0.02 for w in widths) else 'not every one'} resolved at 1%: generation "
                   "(identical work in every method) varied between runs more than the loss steps differ.")
    for run in runs.values():
        s = run["summary"]
        if "min_replace_b4" in s and "min_replace_b4_per_sample" in s:
            a, b = s["min_replace_b4"], s["min_replace_b4_per_sample"]
            out.append(f"* **Pre-pass** (per-device batch 4 < G 8, one process): the group order forwards "
                       f"{a['pre_pass_rows_per_run']:g} rows per off-policy step instead of "
                       f"{b['pre_pass_rows_per_run']:g}, and the loss steps cost "
                       f"{a['loss_steps_s_ratio']['median']:.3f}× TRL's instead of "
                       f"{b['loss_steps_s_ratio']['median']:.3f}×.")
    for title, run in runs.items():
        peak = max(s["peak_allocated_gib"] for s in run["summary"].values())
        engine = run["engine"]["allocated_gib"]
        out.append(f"* **Memory, {title}**: peak {peak:.1f} GiB allocated, of it {engine:.1f} GiB the colocated "
                   f"engine's (weights and KV cache at `vllm_gpu_memory_utilization` "
                   f"{run['config']['vllm_gpu_memory_utilization']}), so the trainer's share is {peak - engine:.1f} "
                   "GiB; nothing was refused or changed to fit. Not run on an 80 GB card.")
    return out


def users_size_section(results: pathlib.Path, fig_dir: pathlib.Path, out: pathlib.Path, number: int) -> list[str]:
    folder = results / "users_size"
    lora, full, prepass = (load_json(folder / f"users_size_{n}.json") for n in ("8b_lora", "1p7b", "1p7b_prepass"))
    if not (lora or full or prepass):
        return []
    runs = {title: run for title, run in (("Qwen3-8B architecture, LoRA r 32", lora),
                                          ("Qwen3-1.7B architecture, full fine-tune", full),
                                          ("1.7B, pre-pass layout (b 4 < G 8)", prepass)) if run}
    first = next(iter(runs.values()))
    lines = [f"## {number}. At the users' size: Qwen3-8B LoRA and Qwen3-1.7B on one GPU "
             "(`benchmarks/dfpo_bench/cost/users_size.py`)",
             "",
             f"{first['card']}; torch {first['versions']['torch']}, transformers {first['versions']['transformers']}, "
             f"TRL {first['versions']['trl']}, vLLM 0.26.0 colocated (one engine per process, shared by every run). "
             "Models: random init with the published architectures, Qwen3's vocabulary (151,936), saved in bf16 for "
             "vLLM; reward `id_parity` (1 for an odd sum of the completion's token ids, so groups hold both signs). "
             "The recipe `recipes/qwen3_8b_lora.yaml`'s batch (8 = G per micro-batch, 4 per optimizer step, 8 per "
             "rollout: 2 optimizer steps, the second off-policy), lengths (completions ≤ 768 tokens; the random "
             "models ran to the limit: mean length 753), LoRA (r 32, α 64, every linear layer), learning rate 1e-5, "
             "gradient checkpointing, bf16. A run is one rollout (2 optimizer steps) from the same initial weights; a "
             "round runs every method once in a shuffled order; ratios are taken within a round, medians over rounds "
             "with percentile-bootstrap 95% intervals. The device's checkout recorded commit "
             f"{first['commit'][:7]} with uncommitted changes (`dirty`): the code that ran is that of 75746fb, "
             "where `users_size.py` first exists (`results/users_size/*.json`, the command in each).", ""]
    for title, run in runs.items():
        model = run["model"]
        built = (f"built in {model['build_s']:.1f} s and saved in {model['save_s']:.1f} s"
                 if model.get("build_s") is not None else "built by the previous call")
        lines += [f"**{title}** ({model['parameters'] / 1e9:.2f}B parameters, {built}; engine start-up "
                  f"{run['engine']['start_s']:.0f} s, its allocation {run['engine']['allocated_gib']:.1f} GiB at "
                  f"`vllm_gpu_memory_utilization` {run['config']['vllm_gpu_memory_utilization']}; "
                  f"{len(run['rounds'])} rounds, `{run['command']}`):", "", *run_table(run), ""]
    ratios, split = ratio_figure(runs, fig_dir, out), split_figure(runs, fig_dir, out)
    lines += [f"![ratios]({ratios})" if ratios else "", "", f"![time split]({split})" if split else "", ""]
    lines += ["What this shows and what it does not:", "", *findings(runs), ""]
    profiles = results / "microstep_profile"
    lines += profile_lines(*(load_json(profiles / f"microstep_profile_{n}.json") for n in ("gpu_before", "cpu_before",
                                                                                      "cpu_after")))
    lines += prepass_rows_lines(load_json(results / "prepass_rows.json"))
    lines += memory_lines(load_json(results / "users_size" / "memory_model.json"))
    return [*lines, ""]
