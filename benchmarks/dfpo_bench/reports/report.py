"""Write ``benchmarks/RESULTS.md`` and its figures from the benchmark JSONs.

    python -m dfpo_bench.reports.report                                   # benchmarks/results/*.json -> RESULTS.md
    python -m dfpo_bench.reports.report --results-dir /tmp/smoke --out /tmp/smoke/RESULTS.md

Reads ``overhead.json`` (one model's result, or several keyed by model; ``overhead_*.json`` when it is
absent), ``learning.json`` + ``learning_curves.json``, ``dapo/learning.json`` + ``dapo/learning_curves.json``
(the sequence-level methods rerun with ``loss_type="dapo"`` and the eq. 24 energy metric), ``transforms_timing.json``,
``zero3.json``, ``NOTES.md`` and ``layouts.json`` (§7's figure; the section is ``layouts/section.md``); any of them
may be missing. Every number and every sentence is computed from
those files: intervals are 95% Student-t intervals over seeds (means) and Welch intervals (differences); a
prediction "held" when the interval of the difference excludes 0 in the predicted direction, "went the other
way" when it excludes 0 in the other, and is "not resolved" otherwise. Overhead goals are judged on the median
of the optimizer steps with no rollout in them, with its bootstrap interval, where the file has it
(``median_train_only_step_s``), else on the median step.
"""

from __future__ import annotations

import argparse
import pathlib
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]

from dfpo_bench.launch.layouts_report import plot_ratios  # noqa: E402
from dfpo_bench.lib.common import load_json  # noqa: E402
from dfpo_bench.lib.trainers import label  # noqa: E402
from dfpo_bench.reports import (  # noqa: E402
    report_launch_shape,
    report_long_run,
    report_study_v2,
    report_study_v3,
    report_study_v4,
    report_study_v4_long,
    report_trained,
    report_users_size,
)
from dfpo_bench.reports.report_cancellation import cancellation_figures, cancellation_section  # noqa: E402
from dfpo_bench.reports.report_learning import ENERGY, dapo_section, has_metric, learning_section, plot_curves  # noqa: E402
from dfpo_bench.reports.report_overhead import (  # noqa: E402
    loss_step_section,
    overhead_entries,
    overhead_section,
    transforms_section,
)


# --------------------------------------------------------------------------------------------------- main
def zero3_section(result: dict[str, Any] | None, number: int = 3) -> list[str]:
    """The ZeRO-3 run (dfpo_bench.launch.zero3): exactness against the single-process reference, step time."""
    if not result:
        return []
    steps = result.get("median_step_s", {})
    verdict = "match" if result["coefficients_match_reference"] else "do NOT match"
    lines = [
        f"## {number}. ZeRO-3, groups across processes and micro-steps (`benchmarks/dfpo_bench/launch/zero3.py`)",
        "",
        f"{result['gpus']} × {result['device']}, DeepSpeed ZeRO-{result['zero_stage']}, layout "
        f"{', '.join(result['layout'])}: the per-sequence s̄ and s̃ every process used {verdict} the single-process "
        f"reference on the same generation batch (max abs difference {result['max_abs_diff']:.2g}, tolerance "
        f"{result['tolerance']:g}); losses finite: {result['loss_finite']}.",
        "",
        "| layout | median step (s) |",
        "| --- | --- |",
        *[f"| {name} ({result['layouts_timed'].get(name, name)}) | {v:.3f} |" for name, v in steps.items()],
        "",
    ]
    if "pre_pass_over_co_located" in result:
        lines += [
            f"Same generation batch and optimizer-step size: the pre-pass layout (micro-batches of half a group, "
            f"two micro-steps and one no-grad pre-pass forward per optimizer step) takes "
            f"{result['pre_pass_over_co_located']:.2f}× the step time of whole groups per micro-batch; medians over "
            f"steps 3–{result['steps']}, rollout steps included.",
            "",
        ]
    return lines


def notes_section(path: pathlib.Path, number: int | None = None) -> list[str]:
    """Hand-written notes on what was not run and how to read a metric (``results/NOTES.md``), appended as is,
    except that a numbered first heading (``## 4. ...``) takes ``number``, the sections before it being optional."""
    if not path.exists():
        return []
    lines = path.read_text().rstrip().splitlines()
    if number is not None and lines:
        lines[0] = re.sub(r"^## \d+\. ", f"## {number}. ", lines[0])
    return [*lines, ""]


def hand_section(path: pathlib.Path, number: int) -> list[str]:
    """A section written by hand from a benchmark's own files (its heading's number set to ``number``)."""
    if not path.exists():
        return []
    lines = path.read_text().rstrip().splitlines()
    lines[0] = re.sub(r"^## \d+\.", f"## {number}.", lines[0])
    return lines


def layouts_figure(layouts: dict[str, Any] | None, fig_dir: pathlib.Path, out: pathlib.Path) -> list[str]:
    """§7's figure, ``layouts_ratio.png``, from ``results/layouts.json`` (the merged timing runs) by the layouts
    report's own drawing (``layouts.py --merge ... --plot`` draws the same file); the hand-written section links it."""
    if not layouts:
        return []
    path = fig_dir / "layouts_ratio.png"
    plot_ratios(layouts, path)
    return [str(path.relative_to(out.parent)) if path.is_relative_to(out.parent) else str(path)]


def make_figures(curves: dict[str, Any] | None, specs: list[tuple[str, str, str, dict[str, Any]]],
                 fig_dir: pathlib.Path, out: pathlib.Path) -> list[str]:
    """Draw each (file name, curve key, y label, plot_curves options) that has data; paths relative to ``out``."""
    figures: list[str] = []
    if not curves:
        return figures
    for name, key, ylabel, extra in specs:
        if plot_curves(curves, key, ylabel, fig_dir / name, **extra):
            figures.append(str((fig_dir / name).relative_to(out.parent)) if fig_dir.is_relative_to(out.parent)
                           else str(fig_dir / name))
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--out", default="benchmarks/RESULTS.md")
    p.add_argument("--fig-dir", help="default: <dir of --out>/figures")
    args = p.parse_args(argv)
    results, out = pathlib.Path(args.results_dir), pathlib.Path(args.out)
    fig_dir = pathlib.Path(args.fig_dir) if args.fig_dir else out.parent / "figures"
    summary, curves = load_json(results / "learning.json"), load_json(results / "learning_curves.json")
    dapo = load_json(results / "dapo" / "learning.json")
    dapo_curves = load_json(results / "dapo" / "learning_curves.json")
    figures = make_figures(curves, [
        ("reward_curves.png", "reward", "sampled reward", {"threshold": (curves or {}).get("threshold")}),
        ("residual_curves.png", "residual", "shared-prefix residual", {}),
        ("asym_curves.png", "asym_after", "Asym (solid: after, dashed: before)", {"dashed": "asym_before"}),
        ("entropy_curves.png", "entropy", "entropy", {}),
    ], fig_dir, out)
    buckets = int(((dapo or {}).get("settings") or {}).get("energy_buckets") or 0)
    dapo_figures = make_figures(dapo_curves, [
        ("dapo_reward_curves.png", "reward", "sampled reward", {"threshold": (dapo_curves or {}).get("threshold")}),
        ("dapo_residual_curves.png", "residual", "shared-prefix residual", {}),
        ("dapo_energy_curves.png", "energy_frequent", "energy share of the most frequent bucket",
         {"threshold": 1 / buckets if buckets else None}),
    ], fig_dir, out)
    # Sections 1 and 2 are always there; the ones after them only when their files are.
    zero3, notes = load_json(results / "zero3.json"), results / "NOTES.md"
    study = load_json(results / "cancellation.json")
    study_figures = cancellation_figures(study, fig_dir, out)
    e2e, long_run = load_json(results / "vllm_e2e.json"), load_json(results / "long_run.json")
    number = 3 + bool(dapo) + bool(zero3) + bool(study)
    dapo_lines = dapo_section(dapo, summary, dapo_figures, 3, notes=number if notes.exists() else None)
    zero3_lines = zero3_section(zero3, 3 + bool(dapo_lines))
    energy_elsewhere = None
    if dapo_lines and has_metric(dapo["methods"], ENERGY[0]):
        loss = (dapo.get("settings") or {}).get("sequence_loss_type") or "grpo"
        energy_elsewhere = (f"§3, a rerun of {', '.join(label(m) for m in dapo['methods'])} with "
                            f"`loss_type=\"{loss}\"` and the metric on")

    long_run_figures = report_long_run.plot_long_run(long_run, fig_dir, out) if long_run else {}
    # After the notes: the hand-written layout section (its measurements are in results/layouts/), then vLLM's.
    layouts_lines = hand_section(results / "layouts" / "section.md", number + notes.exists())
    layouts_figures = layouts_figure(load_json(results / "layouts.json") if layouts_lines else None, fig_dir, out)
    vllm_number = number + notes.exists() + bool(layouts_lines)
    e2e_lines = report_long_run.e2e_section(e2e, vllm_number)
    long_run_lines = report_long_run.long_run_section(long_run, long_run_figures, vllm_number + bool(e2e_lines),
                                                      report_long_run.read_records(results / "long_run"))
    shape_lines = report_launch_shape.launch_shape_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines))
    study_v2_lines = report_study_v2.study_v2_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines))
    users_size_lines = report_users_size.users_size_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines)
        + bool(study_v2_lines))
    study_v3_lines = report_study_v3.study_v3_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines)
        + bool(study_v2_lines) + bool(users_size_lines))
    trained_lines = report_trained.trained_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines)
        + bool(study_v2_lines) + bool(users_size_lines) + bool(study_v3_lines))
    study_v4_lines = report_study_v4.study_v4_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines)
        + bool(study_v2_lines) + bool(users_size_lines) + bool(study_v3_lines) + bool(trained_lines))
    study_v4_long_lines = report_study_v4_long.study_v4_long_section(
        results, fig_dir, out, vllm_number + bool(e2e_lines) + bool(long_run_lines) + bool(shape_lines)
        + bool(study_v2_lines) + bool(users_size_lines) + bool(study_v3_lines) + bool(trained_lines)
        + bool(study_v4_lines))
    lines = [
        "# Benchmark results",
        "",
        "Generated by `dfpo_bench.reports.report` from the JSON files in `benchmarks/results/`; how to rerun them "
        "is in `benchmarks/README.md`. The card's name is given with every measurement.",
        "",
        "**The end token of the GPU runs before 2026-11-27.** The GPU kit's conversion of SmolLM2-135M-Instruct "
        "(transformers 5.17) gave its tokenizer `<|im_start|>` (id 1) as the end token where the model's config says "
        "`<|im_end|>` (id 2), and TRL aligned the model's and the generation config's end token to it. Every "
        "SmolLM2 run in sections 1–9 ran so: completions ended (in TRL's completion mask and in `generate`) at "
        "`<|im_start|>` instead of `<|im_end|>`, and the drift meter scored `<|im_start|>` as the end of each "
        "answer form, which put its `drift/set_logp_mean` several nats too low. Timings are unaffected in kind; "
        "rewards, completion lengths and the drift meter's log-probabilities are from that setting. The embedded "
        "model of the CPU main job takes its end token from the model's config (`dfpo_trl/cli/embedded.py`). "
        "Sections 10 to 13 ran with the corrected kit.",
        "",
        *overhead_section(overhead_entries(results)),
        *transforms_section(load_json(results / "transforms_timing.json")),
        *loss_step_section(results),
        *learning_section(summary, curves, figures, energy_elsewhere=energy_elsewhere),
        *dapo_lines,
        *zero3_lines,
        *cancellation_section(study, study_figures, 3 + bool(dapo_lines) + bool(zero3_lines)),
        *notes_section(notes, number),
        *layouts_lines,
        *e2e_lines,
        *long_run_lines,
        *shape_lines,
        *study_v2_lines,
        *users_size_lines,
        *study_v3_lines,
        *trained_lines,
        *study_v4_lines,
        *study_v4_long_lines,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    n = len(figures) + len(dapo_figures) + sum(len(f) for f in study_figures.values()) + len(long_run_figures)
    n += len(layouts_figures)
    print(f"wrote {out}" + (f" and {n} figures in {fig_dir}" if n else ""))


if __name__ == "__main__":
    main()
