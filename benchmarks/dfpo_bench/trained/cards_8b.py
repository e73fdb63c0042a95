"""The 8B LoRA recipe's cards, measured: what fits on a card of 24, 32, 40, 48 and 80 GB, and with which settings.

    # on the GPU machine after the kit (benchmarks/README.md, "The GPU kit"); about 15 minutes on one GPU
    python -m dfpo_bench.trained.cards_8b --out $OUT/cards_8b.json --work /tmp/cards
    # CPU smoke test of the plan and the table (no GPU: a tiny random Qwen3, transformers generation only)
    python -m dfpo_bench.trained.cards_8b --smoke --out /tmp/cards.json --work /tmp/cards

Each configuration is one process running one rollout and its two optimizer steps of ``recipes/qwen3_8b_lora.yaml``
(Qwen3-8B's architecture with random weights built on the GPU, the recipe's LoRA, batch, 768-token completions,
Min-Replace; dfpo_bench.cost.users_size's runner): generation through transformers or a colocated vLLM engine
(with and without TRL's ``vllm_enable_sleep_mode``), ``per_device_train_batch_size`` 8 or 4 (4 < G = 8: the pre-pass
layout). A random model answers nothing, so the reward is users_size's ``id_parity`` (groups have both signs and the
pre-pass runs); it also samples until the length cap, the worst case for memory.

A card is simulated on the larger GPU by capping PyTorch's allocator (``torch.cuda.set_per_process_memory_fraction``)
at the card's size less what the process holds outside PyTorch's allocator (the CUDA context, cuBLAS and NCCL
buffers: ``nvidia-smi``'s figure for the process less ``torch.cuda.memory_reserved``, measured in every run). A card
of "N GB" is taken as N GiB in all (A100 40 GB and 80 GB have 40 and 80 GiB; an L40S has 45 GiB, less than its
name). The colocated engine gets the same ``--engine-gib`` on every card, i.e. ``vllm_gpu_memory_utilization`` =
engine GiB ÷ card GiB, which is the setting the table gives.

Stage 1 runs every configuration uncapped and measures its peak allocated and reserved memory. A card is then
decided without a run where it can be: a card below the peak allocated plus the overhead cannot hold the run
(PyTorch never holds less than it allocates), a card at or above the peak reserved plus the overhead holds it
(the capped allocator behaves as the uncapped one until it reaches the cap). Stage 2 runs, capped, only the cards
in between: there the allocator's freeing and retrying under the cap decides. The table marks each cell
``measured`` (a capped run) or ``deduced`` (from stage 1 and the rule above).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]
CARDS_GIB = (24, 32, 40, 48, 80)
EXPANDABLE = "expandable_segments:True"
# name -> (generation through vLLM, sleep mode, per-device batch, PyTorch allocator setting)
CONFIGS: dict[str, dict[str, Any]] = {
    "transformers_b8": {"vllm": False, "sleep": False, "batch": 8, "alloc": EXPANDABLE},
    "transformers_b4": {"vllm": False, "sleep": False, "batch": 4, "alloc": EXPANDABLE},
    "transformers_b8_default_allocator": {"vllm": False, "sleep": False, "batch": 8, "alloc": ""},
    "vllm_b8": {"vllm": True, "sleep": False, "batch": 8, "alloc": EXPANDABLE},
    "vllm_b4": {"vllm": True, "sleep": False, "batch": 4, "alloc": EXPANDABLE},
    "vllm_b8_sleep": {"vllm": True, "sleep": True, "batch": 8, "alloc": EXPANDABLE},
}
TABLE_CONFIGS = ("transformers_b8", "transformers_b4", "vllm_b8", "vllm_b4", "vllm_b8_sleep")  # with stage 2


def method_of(config: dict[str, Any]) -> str:
    """users_size's method: the recipe's Min-Replace at its batch 8, or at batch 4 (the pre-pass layout)."""
    return "min_replace_b4" if config["batch"] == 4 else "min_replace"


def decide(card_gib: float, record: dict[str, Any]) -> str | None:
    """``"fits"`` / ``"does not fit"`` where the uncapped run decides the card (module docstring), None where only a
    capped run can."""
    if record.get("crash") or record.get("peak_allocated_gib") is None or record.get("overhead_gib") is None:
        return None  # a crash, or a CPU run (no allocator to read)
    overhead = record["overhead_gib"]
    if record["peak_allocated_gib"] + overhead > card_gib:
        return "does not fit"
    if record["peak_reserved_gib"] + overhead <= card_gib:
        return "fits"
    return None


def row(stem: str, run: dict[str, Any], records: dict[str, dict[str, Any]], cards: tuple[float, ...],
        default_engine_gib: float, borrowed_overhead: float | None) -> dict[str, Any]:
    """One configuration's row: its uncapped run's peaks and times, and a cell per card (fits or not, and how that
    is known: ``measured`` by a capped run ``<name>@<card>``, ``deduced`` by :func:`decide`, or ``not run``)."""
    name, tag = stem.split("@", 1)
    config = CONFIGS[name]
    suffix = tag.removeprefix("uncapped")
    asked = re.search(r"_engine(\d+)", suffix)
    engine = run.get("engine_gib_requested") or (float(asked.group(1)) if asked else default_engine_gib)
    overhead, overhead_note = run.get("overhead_gib"), "measured"
    if config["vllm"] and config["sleep"] and borrowed_overhead is not None:
        # vLLM's sleep mode unmaps the engine's memory and PyTorch still counts it as reserved, so nvidia-smi's
        # figure at the end is below PyTorch's: take the largest overhead the other vLLM runs measured
        overhead, overhead_note = borrowed_overhead, "from the other vLLM runs (sleep mode)"
    steps = run.get("steps") or []
    total = sum(step["total_s"] for step in steps)
    pre_pass = sum(step.get("pre_pass_s", 0.0) for step in steps)
    out: dict[str, Any] = {
        "variant": name + suffix, "config": name, "batch": config["batch"], "allocator": config["alloc"] or "default",
        "generation": "vLLM colocate" if config["vllm"] else "transformers", "sleep_mode": config["sleep"],
        "engine_gib_requested": engine if config["vllm"] else None, "crash": run.get("crash"),
        "peak_allocated_gib": run.get("peak_allocated_gib"), "peak_reserved_gib": run.get("peak_reserved_gib"),
        "overhead_gib": overhead, "overhead": overhead_note,
        "needs_gib": None if run.get("crash") or overhead is None or run.get("peak_reserved_gib") is None
        else run["peak_reserved_gib"] + overhead,  # None on the CPU (no allocator to read)
        "rollout_s": steps[0].get("rollout_s") if steps else None,
        "generation_s": steps[0].get("generation_s") if steps else None,
        "whole_s": total or None, "pre_pass_s": pre_pass, "pre_pass_share": pre_pass / total if total else None,
        "cards": [],
    }
    judged = {**run, "overhead_gib": overhead}
    for card in cards:
        entry: dict[str, Any] = {"card_gib": card}
        if config["vllm"]:
            entry["vllm_gpu_memory_utilization"] = round(engine / card, 3)
        capped = records.get(f"{name}@{card}") if not suffix else None
        if capped is not None:
            entry.update(fits=capped.get("crash") is None, how="measured", crash=capped.get("crash"))
        else:
            verdict = decide(card, judged)
            entry.update(fits=None if verdict is None else verdict == "fits",
                         how="deduced" if verdict is not None else ("crashed" if run.get("crash") else "not run"))
        out["cards"].append(entry)
    return out


def tabulate(work: pathlib.Path, cards: tuple[float, ...], default_engine_gib: float) -> list[dict[str, Any]]:
    """A row per uncapped run recorded in ``work`` (``<config>@uncapped[_variant].json``; a variant such as
    ``_engine20`` names what differs), with capped runs (``<config>@<card>.json``) as the cells they measured."""
    records = {path.stem: json.loads(path.read_text()) for path in sorted(work.glob("*@*.json"))}
    uncapped = {stem: r for stem, r in records.items() if stem.split("@", 1)[1].startswith("uncapped")}
    measured = [r["overhead_gib"] for stem, r in uncapped.items() if CONFIGS[stem.split("@")[0]]["vllm"]
                and not CONFIGS[stem.split("@")[0]]["sleep"] and not r.get("crash") and r.get("overhead_gib")]
    borrowed = max(measured) if measured else None
    return [row(stem, run, records, cards, default_engine_gib, borrowed) for stem, run in uncapped.items()]


def process_gib() -> float | None:
    """What ``nvidia-smi`` reports for this process (its CUDA context included), in GiB."""
    try:
        lines = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()):
            return float(parts[1]) / 1024
    return None


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this process (the allocator setting came with the environment), capped or not."""
    import torch

    from dfpo_bench.cost import users_size

    config = CONFIGS[args.one]
    on_gpu = torch.cuda.is_available()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else 0.0
    if on_gpu:
        torch.cuda.init()
        if args.cap_gib:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib / total_gib), 0)
    runner_args = argparse.Namespace(
        lora=True, vllm=config["vllm"], vllm_memory=args.engine_gib / total_gib if config["vllm"] else None,
        max_model_length=args.max_model_length, completion_length=args.completion_length, rollouts=1,
        seed=args.seed, config_extra={"vllm_enable_sleep_mode": True} if config["sleep"] else {})
    started = time.perf_counter()
    record: dict[str, Any] = {"config": args.one, "cap_gib": args.cap_gib, "allocator": config["alloc"] or "default",
                              "device_total_gib": total_gib,
                              "engine_gib_requested": args.engine_gib if config["vllm"] else None}
    try:
        runner = users_size.Runner(runner_args, args.model_dir)
        if config["vllm"]:
            runner.share_engine()
        result = runner.run(method_of(config))
    except Exception as error:  # loading the model or building the engine under the cap: a crash, recorded
        import traceback

        result = {"crash": f"{type(error).__name__}: {error}"[:2000],
                  "crash_frames": [f.name for f in traceback.extract_tb(error.__traceback__)[-8:]]}
        if on_gpu:
            result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    else:
        result["engine_gib"] = runner.engine.get("allocated_gib") if config["vllm"] else None
        result["engine_start_s"] = runner.engine.get("start_s") if config["vllm"] else None
    record.update({k: v for k, v in result.items() if k != "steps"})
    record["steps"] = result.get("steps")
    record["wall_s"] = time.perf_counter() - started
    if on_gpu:
        seen = process_gib()
        record["process_gib_at_end"] = seen
        record["overhead_gib"] = None if seen is None else max(0.0, seen - torch.cuda.memory_reserved() / 2**30)
    else:
        record["overhead_gib"] = 0.0
    if config["vllm"] and not record.get("crash"):
        record["engine_gib"] = record.get("engine_gib") or args.engine_gib
    return record


def child(args: argparse.Namespace, name: str, cap: float | None, work: pathlib.Path) -> subprocess.Popen:
    """Start one configuration's process; its record goes to ``work/<name>@<cap>.json``."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if CONFIGS[name]["alloc"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = CONFIGS[name]["alloc"]
    tag = f"{name}@{cap or 'uncapped'}"
    command = [sys.executable, "-m", "dfpo_bench.trained.cards_8b", "--one", name, "--model-dir", str(args.model_dir),
               "--out", str(work / f"{tag}.json"), "--engine-gib", str(args.engine_gib),
               "--completion-length", str(args.completion_length), "--max-model-length", str(args.max_model_length)]
    if cap:
        command += ["--cap-gib", str(cap)]
    log = open(work / f"{tag}.log", "w")  # noqa: SIM115 - the child owns it
    print(f"[{time.strftime('%H:%M:%S')}] start {tag}", flush=True)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_lanes(args: argparse.Namespace, jobs: list[tuple[str, float | None]], work: pathlib.Path) -> None:
    """Run ``jobs`` in two lanes, one after another in each: transformers generation, and vLLM (one engine starting
    at a time on a GPU: vLLM's start-up profiling fails when another process's memory moves)."""
    lanes = {True: [j for j in jobs if CONFIGS[j[0]]["vllm"]], False: [j for j in jobs if not CONFIGS[j[0]]["vllm"]]}
    running: dict[bool, subprocess.Popen | None] = {True: None, False: None}
    deadline = time.time() + args.budget_s
    while any(lanes.values()) or any(running.values()):
        for lane, process in running.items():
            if process is not None and process.poll() is not None:
                running[lane] = None
            if running[lane] is None and lanes[lane] and time.time() < deadline:
                name, cap = lanes[lane].pop(0)
                running[lane] = child(args, name, cap, work)
        if time.time() >= deadline and not any(running.values()):
            break
        time.sleep(2.0)


def read(work: pathlib.Path, tag: str) -> dict[str, Any] | None:
    path = work / f"{tag}.json"
    return json.loads(path.read_text()) if path.exists() else None


def stage_two(uncapped: dict[str, dict[str, Any]], cards: tuple[float, ...]) -> list[tuple[str, float]]:
    """The capped runs the uncapped ones leave undecided (module docstring)."""
    return [(name, card) for name in TABLE_CONFIGS if name in uncapped and not uncapped[name].get("crash")
            for card in cards if decide(card, uncapped[name]) is None]


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from dfpo_bench.lib import common, provenance

    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cards = (0.2, 0.3, 0.5) if args.smoke else CARDS_GIB
    names = ["transformers_b8", "transformers_b4"] if args.smoke else (args.configs or list(CONFIGS))
    if not (pathlib.Path(args.model_dir) / "config.json").exists():
        from dfpo_bench.cost import users_size
        from dfpo_bench.lib import trainers

        device = "cpu" if args.smoke else "cuda"
        tokenizer = args.tokenizer or trainers.default_tokenizer_path()
        model, _ = users_size.build_model("tiny" if args.smoke else "qwen3-8b", tokenizer, pathlib.Path(args.model_dir),
                                          device, args.seed)
        del model  # the runs load it from disk, one process each
        if not args.smoke:
            import torch

            torch.cuda.empty_cache()
    result: dict[str, Any] = {"command": "python -m dfpo_bench.trained.cards_8b " + " ".join(sys.argv[1:]),
                              **provenance.checkout_state(ROOT), "versions": common.versions(),
                              "card": common.device_name("cpu" if args.smoke else "cuda"),
                              "engine_gib": args.engine_gib, "completion_length": args.completion_length}
    run_lanes(args, [(n, None) for n in names], work)
    # every configuration with a record in ``work``: an earlier driver's too (``--configs`` reruns some)
    uncapped = {n: r for n in CONFIGS if (r := read(work, f"{n}@uncapped")) is not None}
    jobs = [] if args.smoke else stage_two(uncapped, cards)  # no allocator cap on the CPU
    print(f"stage 2: {len(jobs)} capped runs: {jobs}", flush=True)
    run_lanes(args, jobs, work)
    result.update(cards_gib=list(cards), rows=tabulate(work, cards, args.engine_gib),
                  missing=[n for n in names if n not in uncapped] + [f"{n}@{c}" for n, c in jobs
                                                                       if read(work, f"{n}@{c}") is None])
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result["rows"])
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    for entry in rows:
        cells = " ".join(f"{c['card_gib']:g}:{'?' if c['fits'] is None else 'yes' if c['fits'] else 'no'}"
                         for c in entry["cards"])
        needs = "?" if entry["needs_gib"] is None else f"{entry['needs_gib']:.2f}"
        print(f"{entry['variant']:36s} needs {needs:>6s} GiB  {cells}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/cards")
    parser.add_argument("--model-dir", default="/root/models/random-qwen3-8b")
    parser.add_argument("--tokenizer", default=None, help="default: the GPU kit's SmolLM2 (users_size)")
    parser.add_argument("--engine-gib", type=float, default=20.0, help="the colocated engine's memory on every card")
    parser.add_argument("--completion-length", type=int, default=768)
    parser.add_argument("--max-model-length", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=1200.0, help="start no run after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                        help="run only these (default: all); the table takes every record in --work")
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny model, transformers generation only")
    parser.add_argument("--table", metavar="WORK", default=None,
                        help="no runs: the table from the records in WORK (with --out)")
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        from dfpo_bench.lib import common

        common.quiet()
        record = run_one(args)
        pathlib.Path(args.out).write_text(json.dumps(record))
        print(json.dumps({k: v for k, v in record.items() if k != "steps"})[:3000], flush=True)
        return
    if args.table:
        rows = tabulate(pathlib.Path(args.table), CARDS_GIB, args.engine_gib)
        pathlib.Path(args.out).write_text(json.dumps({"cards_gib": list(CARDS_GIB), "records": args.table,
                                                      "rows": rows}, indent=1))
        print_table(rows)
        return
    if args.smoke and args.model_dir == "/root/models/random-qwen3-8b":
        args.model_dir = str(pathlib.Path(args.work) / "tiny-model")
    drive(args)


if __name__ == "__main__":
    main()
