"""Write ``benchmarks/RESULTS.md`` and its figures from the benchmark JSONs.

    python -m dfpo_bench.reports.report                                   # benchmarks/results/*.json -> RESULTS.md
    python -m dfpo_bench.reports.report --results-dir /tmp/smoke --out /tmp/smoke/RESULTS.md

Reads ``overhead.json`` (one model's result, or several keyed by model; ``overhead_*.json`` when it is absent),
``transforms_timing.json``, ``loss_step_*.json``, ``zero3.json``, ``NOTES.md``, ``layouts.json`` (the layouts
section's figure; the section itself is ``layouts/section.md``), the launch runs' files (``vllm_server*.json``,
``loop_cost.json``) and ``trained/`` (the importance-sampling ratio, the 8B cards); any of them
may be missing, and a section whose files are missing is left out. Every number and every sentence is computed from
those files. Overhead goals are judged on the median of the optimizer steps with no rollout in them, with its
bootstrap interval, where the file has it (``median_train_only_step_s``), else on the median step.
"""

from __future__ import annotations

import argparse
import pathlib
import re
from typing import Any

from dfpo_bench.launch.layouts import plot_ratios
from dfpo_bench.lib.common import load_json
from dfpo_bench.reports import report_launch_shape, report_trained
from dfpo_bench.reports.report_overhead import (
    loss_step_section,
    overhead_entries,
    overhead_section,
    transforms_section,
)


# --------------------------------------------------------------------------------------------------- main
def zero3_section(result: dict[str, Any] | None, number: int = 2) -> list[str]:
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--out", default="benchmarks/RESULTS.md")
    p.add_argument("--fig-dir", help="default: <dir of --out>/figures")
    args = p.parse_args(argv)
    results, out = pathlib.Path(args.results_dir), pathlib.Path(args.out)
    fig_dir = pathlib.Path(args.fig_dir) if args.fig_dir else out.parent / "figures"
    zero3, notes = load_json(results / "zero3.json"), results / "NOTES.md"
    zero3_lines = zero3_section(zero3, 2)
    number = 2 + bool(zero3_lines)
    notes_lines = notes_section(notes, number)
    number += bool(notes_lines)
    layouts_lines = hand_section(results / "layouts" / "section.md", number)
    layouts_figures = layouts_figure(load_json(results / "layouts.json") if layouts_lines else None, fig_dir, out)
    number += bool(layouts_lines)
    shape_lines = report_launch_shape.launch_shape_section(results, fig_dir, out, number)
    number += bool(shape_lines)
    trained_lines = report_trained.trained_section(results, fig_dir, out, number)
    lines = [
        "# Benchmark results",
        "",
        "Generated by `dfpo_bench.reports.report` from the JSON files in `benchmarks/results/`; how to rerun them "
        "is in `benchmarks/README.md`. The card's name is given with every measurement. The finished studies "
        "(learning, drift, cancellation, long runs, studies v2–v4, the users' size) and their sections are archived: "
        "docs/source/research.md says where.",
        "",
        "**The end token of the SmolLM2 runs before 2026-11-27.** The GPU kit's conversion of SmolLM2-135M-Instruct "
        "gave its tokenizer `<|im_start|>` as the end token where the model's config says `<|im_end|>`; the "
        "SmolLM2 runs of §1 ran so (completions ended at `<|im_start|>`). Timings are unaffected in kind.",
        "",
        *overhead_section(overhead_entries(results)),
        *transforms_section(load_json(results / "transforms_timing.json")),
        *loss_step_section(results),
        *zero3_lines,
        *notes_lines,
        *layouts_lines,
        *shape_lines,
        *trained_lines,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    drawn = layouts_figures or shape_lines or trained_lines
    print(f"wrote {out}" + (f" and the figures in {fig_dir}" if drawn else ""))


if __name__ == "__main__":
    main()
