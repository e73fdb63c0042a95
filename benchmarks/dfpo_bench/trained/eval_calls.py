"""Held-out avg@k through colocated vLLM: its time at one problem per vLLM call (``--per_device_eval_batch_size 8``,
TRL's default) against ``dfpo-train``'s default (at most a training rollout's rows per call: :func:`default_rows`).

Each arm is one ``dfpo-train`` process (:func:`command`), evaluating before and after one optimizer step; the arms
alternate between repeats (:func:`plan`), so that a drift of the GPU's speed shows between repeats, not arms.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

from dfpo_bench.lib import common
from dfpo_bench.trained.cards_8b import RECIPE, ROOT, write_dataset

MODEL = "/root/models/qwen2.5-coder-0.5b-instruct"
# name -> the flags that differ between the arms
ARMS: dict[str, list[str]] = {"one_problem_per_call": ["--per_device_eval_batch_size", "8"], "dfpo_default": []}
COMMON = ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.15",
          "--eval_size", "100", "--num_generations_eval", "8", "--max_completion_length", "256", "--max_steps", "1",
          "--eval_every", "0", "--save_model", "false", "--plot", "false"]
K = int(COMMON[COMMON.index("--num_generations_eval") + 1])  # k of avg@k


def default_rows(problems: int = 100) -> int:
    """The eval batch ``dfpo-train`` sets for the recipe on one process, by the documented rule (decisions.md,
    "Held-out avg@k through vLLM"): k x problems, but at most a training rollout's rows rounded down to k's multiple."""
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text())
    rollout = recipe["per_device_train_batch_size"] * recipe["steps_per_generation"]
    return min(K * problems, K * max(1, rollout // K))


def command(model: str, arm: str, output_dir: pathlib.Path, dataset: pathlib.Path) -> list[str]:
    """The ``dfpo-train`` command of one arm."""
    return [sys.executable, "-m", "dfpo_trl", str(RECIPE.relative_to(ROOT)), "--model_name_or_path", model,
            "--dataset", str(dataset), "--output_dir", str(output_dir), *COMMON, *ARMS[arm]]


def plan(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(arm, repeat, command) in the order they run: the arms alternate, each repeat reversing the last."""
    work = pathlib.Path(args.work)
    return [(arm, repeat, command(args.model, arm, work / f"{arm}_{repeat}", work / "gsm8k_offline"))
            for repeat in range(args.repeats) for arm in (list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS)))]


def run_arm(arm: str, repeat: int, argv: list[str], work: pathlib.Path) -> dict[str, Any]:
    """Run one arm; its evaluations' avg@8 and seconds from the summary (``before_seconds``, ``after_seconds``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=common.child_pythonpath())
    log = work / f"{arm}_{repeat}.log"
    started = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    record: dict[str, Any] = {"arm": arm, "repeat": repeat, "command": " ".join(argv), "exit": code,
                              "wall_s": time.perf_counter() - started, "log": str(log)}
    summary_path = pathlib.Path(argv[argv.index("--output_dir") + 1]) / "dfpo_summary.json"
    if code == 0 and summary_path.exists():
        heldout = json.loads(summary_path.read_text())["heldout"]
        record.update(metric=heldout["metric"], problems=heldout["n"], avg_at_k=[heldout["before"], heldout["after"]],
                      eval_s=[heldout["before_seconds"], heldout["after_seconds"]])
    else:
        record["tail"] = log.read_text()[-3000:]
    print(f"{arm} (repeat {repeat}): exit {code}, eval s {record.get('eval_s')}, avg@k {record.get('avg_at_k')}",
          flush=True)
    return record


def tabulate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm: every evaluation's seconds, their median, and the avg@8 values measured (samples, not compared)."""
    rows = []
    for arm in ARMS:
        done = [r for r in records if r["arm"] == arm and "eval_s" in r]
        seconds = [s for r in done for s in r["eval_s"]]
        rows.append({"arm": arm, "flags": " ".join(ARMS[arm]) or "(none)", "evaluations": len(seconds),
                     "eval_s": seconds, "median_eval_s": statistics.median(seconds) if seconds else None,
                     "avg_at_k": [v for r in done for v in r["avg_at_k"]]})
    return rows


def report(result: dict[str, Any]) -> str:
    """The RESULTS.md section, from the JSON alone."""
    rows = result["dfpo_default_rows"]
    lines = [f"**Held-out avg@8 through colocated vLLM, one problem per call against dfpo-train's default** "
             f"(`dfpo_bench.trained.eval_calls`; {result['card']}, {result['date']}). `recipes/qwen3_8b_lora.yaml` "
             f"with colocated vLLM on `{result['model']}`, an offline GSM8K-shaped dataset, 100 held-out "
             "problems x 8 completions of at most 256 tokens, each `dfpo-train` process evaluating before and after "
             f"one optimizer step. dfpo-train's default eval batch for this recipe: {rows} rows, {rows // K} problems "
             "per vLLM call.", "",
             "| eval batch flags | evaluations | seconds each | median s | avg@8 measured |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        seconds = ", ".join(f"{s:.1f}" for s in row["eval_s"]) or "–"
        median = "–" if row["median_eval_s"] is None else f"{row['median_eval_s']:.1f}"
        values = ", ".join(f"{v:.3f}" for v in row["avg_at_k"]) or "–"
        lines.append(f"| `{row['flags']}` | {row['evaluations']} | {seconds} | {median} | {values} |")
    slow, fast = (r["median_eval_s"] for r in result["rows"])
    if slow and fast:
        lines += ["", f"Median evaluation {slow:.1f} s at one problem per call, {fast:.1f} s at the default: "
                      f"{slow / fast:.1f}x faster. avg@8 is a sample (800 completions an evaluation at the recipe's "
                      "sampling): the arms' values are two samples of the same measure, not a comparison."]
    lines += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in result["records"][:len(ARMS)])]
    if result.get("calls"):
        lines += ["", "Calls: " + " ".join(f"`{c['command']}` ({c['wall_s']:.0f} s): {c['ran']}."
                                           for c in result["calls"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the JSON record (needed unless --report)")
    parser.add_argument("--work", default="/tmp/eval_calls")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each arm, alternating (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--report", metavar="JSON", help="print the RESULTS section of an earlier --out")
    args = parser.parse_args(argv)
    if args.report:
        print(report(json.loads(pathlib.Path(args.report).read_text())))
        return
    if not args.out:
        parser.error("--out is needed to run or to --dry-run")
    planned = plan(args)
    if args.dry_run:
        for arm, repeat, cmd in planned:
            print(f"{arm} {repeat}: {' '.join(cmd)}")
        return
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "gsm8k_offline" / "dataset_dict.json").exists():
        write_dataset(work / "gsm8k_offline", train=500, test=100)
    records = [run_arm(arm, repeat, cmd, work) for arm, repeat, cmd in planned]
    result = {**common.run_head("dfpo_bench.trained.eval_calls", sys.argv[1:]), "model": args.model,
              "dfpo_default_rows": default_rows(), "records": records, "rows": tabulate(records)}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    for row in result["rows"]:
        print(f"{row['flags']:36s} evaluations {row['evaluations']}  median {row['median_eval_s']} s  "
              f"avg@8 {row['avg_at_k']}", flush=True)


if __name__ == "__main__":
    main()
