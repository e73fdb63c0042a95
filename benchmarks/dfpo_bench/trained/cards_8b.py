"""The 8B LoRA recipe's card table run as a user runs it: ``dfpo-train recipes/qwen3_8b_lora.yaml`` plus exactly the
row's flags (:data:`ROWS`), one process per row, on a simulated card (commands: benchmarks/README.md).

Plus what the GPU machine cannot do without (:func:`machine_flags`; no network there, and a random model never ends
a completion: the worst case for memory). A card of N GB (taken as N GiB) is the process's own view of the GPU
(:data:`SITECUSTOMIZE`). The two lanes share the GPU's time, not its memory, so the times are indicative."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shlex
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

from dfpo_bench.lib import common

ROOT = common.ROOT
RECIPE = ROOT / "recipes" / "qwen3_8b_lora.yaml"
CONTEXT_GIB = 1.0  # the CUDA context and libraries, outside PyTorch's allocator (0.7-0.9 GiB measured on the H200)
MODEL_DIR = "/tmp/random-qwen3-8b"
TOKENIZER = "/root/models/qwen2.5-coder-0.5b-instruct"  # the GPU kit's Qwen2.5: Qwen3's vocabulary
FALLBACK_TOKENIZER = "/root/models/smollm2-135m-instruct"  # the kit's first checkpoint, when Qwen2.5 is not laid
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)  # Qwen/Qwen3-8B's config.json
VLLM = ["--use_vllm", "true", "--vllm_mode", "colocate"]
# The table's rows: the card, the flags on top of the recipe, the environment a user sets (and the generation).
ROWS: list[dict[str, Any]] = [
    {"name": name, "card_gib": card, "generation": "colocated vLLM" if VLLM[0] in flags else "transformers",
     "flags": flags, "env": env} for name, card, flags, env in [
        ("24GB", 24, ["--per_device_train_batch_size", "4"], {}), ("32GB", 32, [], {}),
        ("32GB_default_allocator", 32, [], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
        ("40GB", 40, [*VLLM, "--per_device_train_batch_size", "4", "--vllm_gpu_memory_utilization", "0.45"], {}),
        ("48GB", 48, [*VLLM, "--per_device_train_batch_size", "4", "--vllm_gpu_memory_utilization", "0.5"], {}),
        ("80GB", 80, [*VLLM, "--vllm_gpu_memory_utilization", "0.35"], {})]]
REWARD = "dfpo_bench.trained.cards_8b:coin_reward"


def machine_flags(model_dir: str, dataset_dir: str) -> list[str]:
    """After the row's flags, what the GPU machine cannot do without: the random Qwen3-8B, the offline dataset, a
    seeded coin reward (a random model's answers are never right) and one rollout's two steps."""
    return ["--model_name_or_path", model_dir, "--dataset", dataset_dir, "--reward_funcs", REWARD, "--max_steps", "2"]


def coin_reward(completions: list[Any], **_: Any) -> list[float]:
    """0 or 1 per completion, a seeded coin of its text (CRC-32 parity): reproducible, and about half of each
    group rewarded, so that every group has signal (a random model's completions are never correct)."""
    texts = [c if isinstance(c, str) else " ".join(str(m.get("content", "")) for m in c) for c in completions]
    return [float(zlib.crc32(text.encode()) % 2) for text in texts]


# A card: PyTorch capped at it less CONTEXT_GIB, mem_get_info reporting it (so vLLM's memory share is of the card).
SITECUSTOMIZE = '''"""Written by dfpo_bench.trained.cards_8b: this process sees a card of DFPO_BENCH_CARD_GIB GiB."""
import atexit, importlib.abc, importlib.machinery, json, os, subprocess, sys

GIB = 2**30
CARD = float(os.environ["DFPO_BENCH_CARD_GIB"]) * GIB
CONTEXT = float(os.environ.get("DFPO_BENCH_CONTEXT_GIB", "1.0")) * GIB

def process_bytes():
    """What nvidia-smi says this process holds on the GPU (its CUDA context included), or None."""
    try:
        lines = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()):
            return float(parts[1]) * 2**20
    return None

def install(torch):
    real = torch.cuda.mem_get_info

    def card_view(device=None):
        real(device)  # the real call's checks and initialisation
        held = process_bytes()
        if held is None:
            held = torch.cuda.memory_reserved(device) + CONTEXT
        return max(0, int(CARD - held)), int(CARD)

    torch.cuda.mem_get_info = card_view
    torch.cuda.memory.mem_get_info = card_view
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "get_memory_info"):
        accelerator.get_memory_info = card_view

    def cap():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (CARD - CONTEXT) / total), 0)

    torch.cuda._lazy_call(cap)

    def peaks():
        if not torch.cuda.is_initialized():
            return
        held = process_bytes()
        reserved = torch.cuda.memory_reserved()
        record = {"card_gib": CARD / GIB, "cap_gib": (CARD - CONTEXT) / GIB,
                  "device_total_gib": torch.cuda.get_device_properties(0).total_memory / GIB,
                  "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                  "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
                  "process_gib_at_exit": None if held is None else held / GIB,
                  "overhead_gib": None if held is None else max(0.0, held - reserved) / GIB,
                  "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        with open(os.environ["DFPO_BENCH_PEAKS"], "w") as handle:
            json.dump(record, handle)

    atexit.register(peaks)

class AfterTorch(importlib.abc.MetaPathFinder):
    """Installs the card once torch is imported, whoever imports it (nothing here imports torch earlier)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            install(module)

        spec.loader.exec_module = exec_module
        return spec

# Only the row's own process: the processes it starts (compile workers) inherit the environment and leave it be.
if os.environ.setdefault("DFPO_BENCH_OWNER", str(os.getpid())) == str(os.getpid()):
    sys.meta_path.insert(0, AfterTorch())
'''


def write_site(work: pathlib.Path) -> pathlib.Path:
    """The folder holding the card's ``sitecustomize.py`` (put first on a row's PYTHONPATH)."""
    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


def build_model(model_dir: pathlib.Path, tokenizer_path: str, seed: int) -> dict[str, Any]:
    """Qwen3-8B's architecture with random bf16 weights, on the GPU, saved with Qwen2.5's tokenizer padded to the
    head's vocabulary (every id the random head samples decodes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.add_tokens([f"<|unused{i}|>" for i in range(QWEN3_8B["vocab_size"] - len(tokenizer))],
                         special_tokens=True)  # an empty list (a no-op) when none is missing
    config = Qwen3Config(**QWEN3_8B, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    started = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(model_dir, max_shard_size="5GB")
    tokenizer.save_pretrained(model_dir)
    return {"parameters": sum(p.numel() for p in model.parameters()), "build_and_save_s": time.perf_counter() - started}


def write_dataset(folder: pathlib.Path, train: int = 2000, test: int = 16, seed: int = 0) -> None:
    """GSM8K-shaped problems (a few sentences, a "#### N" answer) saved to disk, train and test splits."""
    from datasets import Dataset, DatasetDict

    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy"]
    things = ["clips", "apples", "books", "pages", "marbles", "cookies", "stamps", "shells"]

    def problem(rng: random.Random) -> tuple[str, str]:
        name, thing = rng.choice(names), rng.choice(things)
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        text = (f"{name} had {a} {thing} in April. In May {name} got {b} more {thing}, and then gave away a "
                f"{c}th of all of them to friends at school. A friend later returned 3 {thing}. How many {thing} "
                f"does {name} have at the end of May, if every {thing} that was given away was counted once?")
        total = a + b
        return text, f"{name} had {a} + {b} = {total} {thing}.\n#### {total - total // c + 3}"

    rng = random.Random(seed)
    splits = {split: [problem(rng) for _ in range(n)] for split, n in (("train", train), ("test", test))}
    DatasetDict({split: Dataset.from_dict({"question": [q for q, _ in rows], "answer": [a for _, a in rows]})
                 for split, rows in splits.items()}).save_to_disk(str(folder))


def user_command(row: dict[str, Any]) -> str:
    """The row as the table tells a user to run it."""
    env = " ".join(f"{k}={v}" for k, v in row["env"].items())
    return " ".join(filter(None, [env, "dfpo-train recipes/qwen3_8b_lora.yaml", shlex.join(row["flags"])]))


def row_argv(row: dict[str, Any], model_dir: str, dataset_dir: str) -> list[str]:
    """What a row runs: the program on the recipe, the row's flags, then the machine's (:func:`machine_flags`)."""
    return [sys.executable, "-m", "dfpo_trl", str(RECIPE), *row["flags"], *machine_flags(model_dir, dataset_dir)]


def row_env(row: dict[str, Any], site: pathlib.Path, peaks: pathlib.Path, port: int) -> dict[str, str]:
    """The row's environment: the user's own (``row["env"]``), the card, the card's sitecustomize first on the
    import path (then the repository and the benchmarks, for the coin reward), a free MASTER_PORT."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(row["env"], PYTHONPATH=common.child_pythonpath(str(site)), PYTHONUNBUFFERED="1",
               DFPO_BENCH_CARD_GIB=str(row["card_gib"]), DFPO_BENCH_CONTEXT_GIB=str(CONTEXT_GIB),
               DFPO_BENCH_PEAKS=str(peaks), MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false")
    return env


def start_row(row: dict[str, Any], args: argparse.Namespace, site: pathlib.Path, port: int) -> dict[str, Any]:
    """Start one row's process in its own folder (the recipe's relative output_dir lands there)."""
    folder = pathlib.Path(args.work) / row["name"]
    folder.mkdir(parents=True, exist_ok=True)
    peaks = folder / "peaks.json"
    peaks.unlink(missing_ok=True)
    argv = row_argv(row, args.model_dir, str(pathlib.Path(args.work) / "gsm8k_offline"))
    log = open(folder / "run.log", "w")  # noqa: SIM115 - the child owns it
    print(f"[{time.strftime('%H:%M:%S')}] start {row['name']}: {user_command(row)}", flush=True)
    process = subprocess.Popen(argv, cwd=folder, env=row_env(row, site, peaks, port), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    return {"row": row, "argv": argv, "process": process, "started": time.perf_counter(), "folder": folder,
            "commit": args.commit}


def finish_row(job: dict[str, Any], code: int | None) -> dict[str, Any]:
    """A finished (or timed-out, ``code`` None) row's record: it passes when it exits 0 and its peak reserved plus
    what it held outside PyTorch fits the card."""
    row, folder = job["row"], job["folder"]
    peaks = common.load_json(folder / "peaks.json") or {}
    log = (folder / "run.log").read_text(errors="replace")
    errors = [line for line in log.splitlines() if line.startswith("dfpo-train: error")]
    summary_path = next(folder.glob("outputs/*/dfpo_summary.json"), None)
    summary = json.loads(summary_path.read_text()) if summary_path else {}
    reserved, overhead = peaks.get("peak_reserved_gib"), peaks.get("overhead_gib")
    needs = None if reserved is None or overhead is None else reserved + overhead
    engine_lines = [line.strip() for line in log.splitlines()
                    if any(k in line for k in ("KV cache memory", "gpu_memory_utilization", "vllm_max_model_length"))]
    record = {
        "name": row["name"], "card_gib": row["card_gib"], "generation": row["generation"], "flags": row["flags"],
        "commit": job["commit"], "date": time.strftime("%Y-%m-%d"),  # this call's (the record's head)
        "env": row["env"], "user_command": user_command(row), "machine_flags": job["argv"][len(row["flags"]) + 4:],
        "exit": code, "wall_s": time.perf_counter() - job["started"], **peaks, "needs_gib": needs,
        "passed": code == 0 and needs is not None and needs <= row["card_gib"], "error": errors[-1] if errors else None,
        "steps": summary.get("steps"), "times": summary.get("times"),
        "engine_log": engine_lines[-8:], "log_tail": None if code == 0 else log[-4000:],
    }
    (folder / "record.json").write_text(json.dumps(record, indent=1))
    mark = "pass" if record["passed"] else "FAIL"
    print(f"[{time.strftime('%H:%M:%S')}] {row['name']}: {mark} (exit {code}, needs {needs} GiB)", flush=True)
    return record


def run_lanes(rows: list[dict[str, Any]], args: argparse.Namespace, site: pathlib.Path,
              written: Callable[[], Any]) -> list[dict[str, Any]]:
    """The rows in two lanes at once (transformers generation; colocated vLLM), so that a call holds more rows; the
    limits (``--help``) keep the JSON written before the call ends. ``written`` is called after each row's record."""
    lanes = {0: list(rows), 1: []} if args.lanes == 1 else {
        lane: [r for r in rows if (r["generation"] == "transformers") == (lane == 0)] for lane in (0, 1)}
    running: dict[int, dict[str, Any] | None] = {0: None, 1: None}
    records = []
    deadline, budget = args.started + args.deadline_s, args.started + args.budget_s
    while any(lanes.values()) or any(running.values()):
        for lane, job in running.items():
            if job is not None:
                code = job["process"].poll()
                late = time.perf_counter() - job["started"] > args.row_timeout_s or time.time() > budget
                if code is None and late:
                    os.killpg(job["process"].pid, 9)
                    job["process"].wait()
                if code is not None or late:
                    records.append(finish_row(job, code))
                    running[lane] = None
                    written()
            if running[lane] is None and lanes[lane] and time.time() < deadline:
                running[lane] = start_row(lanes[lane].pop(0), args, site, 29500 + 17 * lane)
        if time.time() >= deadline and not any(running.values()):
            break
        time.sleep(2.0)
    return records


def collect(work: pathlib.Path) -> list[dict[str, Any]]:
    """Every row's latest record in ``work`` (this call's and an earlier call's: ``--rows`` runs the rest), in the
    table's order; a row without one is marked not run."""
    not_run = "not run (the deadline passed, or not asked for): run it with --rows"
    return [common.load_json(work / row["name"] / "record.json") or {
        "name": row["name"], "card_gib": row["card_gib"], "user_command": user_command(row), "exit": None,
        "passed": False, "error": not_run} for row in ROWS]


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The random model (in a child process, so that the driver holds no GPU memory) and the offline dataset."""
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    built: dict[str, Any] = {"model_dir": args.model_dir}
    if not (pathlib.Path(args.model_dir) / "config.json").exists():
        if args.tokenizer == TOKENIZER and not pathlib.Path(TOKENIZER).exists():
            print(f"{TOKENIZER} is not there: SmolLM2's tokenizer, padded to Qwen3's vocabulary", flush=True)
            args.tokenizer = FALLBACK_TOKENIZER
        built["tokenizer"] = args.tokenizer
        code = subprocess.run([sys.executable, "-m", "dfpo_bench.trained.cards_8b", "--build", args.model_dir,
                               "--tokenizer", args.tokenizer, "--out", str(work / "built.json")], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=common.child_pythonpath())).returncode
        if code:
            raise SystemExit(f"building the random Qwen3-8B failed (exit {code})")
        built.update(json.loads((work / "built.json").read_text()))
    if not (work / "gsm8k_offline" / "dataset_dict.json").exists():
        write_dataset(work / "gsm8k_offline")
    return built


def print_table(records: list[dict[str, Any]]) -> None:
    """The call's table on the driver's log."""
    for r in records:
        reserved, needs = ("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("peak_reserved_gib", "needs_gib"))
        print(f"{r['name']:24s} {'pass' if r['passed'] else 'FAIL':4s} reserved {reserved:>6s} needs {needs:>6s} GiB  "
              f"{r['user_command']}{'  | ' + r['error'] if r.get('error') else ''}", flush=True)


def row_result(r: dict[str, Any]) -> str:
    """A row's result cell: only a run that exited says pass or fail; a row never started, or stopped before it
    exited (no exit code, no peaks), is no result, and says which."""
    if r["passed"]:
        return "passes"
    error = r.get("error") or ""
    if error.startswith("not run"):
        return "not run (no record: the driver's deadline passed, or the row was not asked for)"
    if r.get("exit") is None:
        return "no record: the run was stopped before it exited (not a result)"
    return f"fails: {error or 'exit ' + str(r['exit'])}"


def report(result: dict[str, Any]) -> str:
    """The RESULTS.md section, from the JSON alone."""
    lines = [f"**The 8B LoRA recipe's cards, as a user runs them** (`dfpo_bench.trained.cards_8b`; {result['card']}, "
             f"{result['date']}). Each row is `dfpo-train recipes/qwen3_8b_lora.yaml` with the row's flags and "
             f"environment, plus what the GPU machine cannot do without: `{' '.join(result['machine_flags'])}` "
             "(Qwen3-8B's architecture with random weights, an offline GSM8K-shaped dataset with 16 held-out "
             "problems, a seeded coin reward, one rollout and its two optimizer steps). The card is simulated: "
             f"PyTorch capped at the card less {result['context_gib']:g} GiB, `torch.cuda.mem_get_info` reporting the "
             "card, so vLLM's `vllm_gpu_memory_utilization` is a share of the card. Needs = peak reserved + what the "
             "process held outside PyTorch's allocator; a row passes when the run exits 0 and that fits the card.",
             "", "| card | command | result | peak allocated GiB | peak reserved GiB | outside PyTorch GiB | needs GiB "
             "| wall s |", "|---|---|---|---|---|---|---|---|"]

    def cell(value: Any, spec: str = ".2f") -> str:
        return "–" if value is None else format(value, spec)

    current = {row["name"]: row["flags"] for row in ROWS}
    for r in result["rows"]:
        earlier = "" if current.get(r["name"]) == r["flags"] else " (earlier flags: not the recipe's row now)"
        lines.append(f"| {r['card_gib']:g} GB | `{r['user_command']}` | {row_result(r)}{earlier} | "
                     f"{cell(r.get('peak_allocated_gib'))} | {cell(r.get('peak_reserved_gib'))} | "
                     f"{cell(r.get('overhead_gib'))} | {cell(r.get('needs_gib'))} | {cell(r.get('wall_s'), '.0f')} |")
    by_name = {r["name"]: r for r in result["rows"]}
    unrun = [row for row in ROWS if by_name.get(row["name"], {}).get("flags") != row["flags"]]
    if unrun:
        lines += ["", "Not run with the recipe's flags of now: " + "; ".join(
            f"{row['card_gib']:g} GB (`{' '.join(row['flags'])}`)" for row in unrun) + "."]
    with_, without = by_name.get("32GB"), by_name.get("32GB_default_allocator")
    if with_ and without and with_.get("peak_reserved_gib") and without.get("peak_reserved_gib"):
        lines += ["", f"Expandable segments (dfpo-train's default) against PyTorch's default allocator on the 32 GB "
                      f"row: peak reserved {with_['peak_reserved_gib']:.2f} GiB against "
                      f"{without['peak_reserved_gib']:.2f} GiB (cap {without.get('cap_gib', 0):.2f}); "
                      f"{'both pass' if with_['passed'] and without['passed'] else 'see the result column'}."]
    models = [result.get("model", {}), *(call.get("model", {}) for call in result.get("calls", []))]
    tokenizers = list(dict.fromkeys(m["tokenizer"] for m in models if m.get("tokenizer")))
    if tokenizers:
        lines += ["", f"Tokenizer: {' and '.join(f'`{t}`' for t in tokenizers)} (a call's own, padded to Qwen3's "
                      "151,936 ids when it is not Qwen's)."]
    vllm_rows = [r for r in result["rows"] if r.get("generation") == "colocated vLLM"]
    if vllm_rows and not any(r.get("engine_log") for r in vllm_rows):
        lines += ["", "The vLLM rows' logs hold no engine-size line (`engine_log` empty): the engine's size on the "
                      "simulated card is not confirmed from the log."]
    real = {round(r["device_total_gib"], 1) for r in result["rows"] if r.get("device_total_gib")}
    named = [r for r in result["rows"] if r.get("error") and any(f"GPU {g} GiB" in r["error"] for g in real)]
    if named:
        cards = ", ".join(format(r["card_gib"], "g") + " GB" for r in named)
        lines += ["", f"A known limit of the simulation: the out-of-memory message of the {cards} row(s) names the "
                      f"real GPU's memory ({', '.join(f'{g} GiB' for g in sorted(real))}), not the simulated card's: "
                      "the cap is PyTorch's per-process fraction, and the message reads the device's total."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the JSON record")
    parser.add_argument("--work", default="/tmp/cards")
    parser.add_argument("--model-dir", default=MODEL_DIR)
    parser.add_argument("--tokenizer", default=TOKENIZER)
    parser.add_argument("--rows", nargs="+", choices=[r["name"] for r in ROWS], help="run only these (default all)")
    parser.add_argument("--lanes", type=int, choices=(1, 2), default=2, help="rows running at once (default 2)")
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="start no row after this many seconds from the driver's start (default 420)")
    parser.add_argument("--budget-s", type=float, default=565.0,
                        help="stop every row still running this many seconds after the driver's start (default 565: "
                             "the JSON is written before a 600 s call ends)")
    parser.add_argument("--row-timeout-s", type=float, default=420.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="print each row's command and environment, run none")
    parser.add_argument("--report", metavar="JSON", help="print the RESULTS section of an earlier --out")
    parser.add_argument("--build", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report:
        print(report(json.loads(pathlib.Path(args.report).read_text())))
        return
    if args.build:
        pathlib.Path(args.out).write_text(json.dumps(build_model(pathlib.Path(args.build), args.tokenizer, args.seed)))
        return
    rows = [r for r in ROWS if not args.rows or r["name"] in args.rows]
    work = pathlib.Path(args.work)
    dataset = str(work / "gsm8k_offline")
    if args.dry_run:
        for row in rows:
            env = row_env(row, work / "site", work / row["name"] / "peaks.json", 29500)
            shown = " ".join(f"{k}={env[k]}" for k in (*row["env"], "DFPO_BENCH_CARD_GIB", "DFPO_BENCH_CONTEXT_GIB"))
            print(f"{row['name']}: {user_command(row)}\n  runs: {shlex.join(row_argv(row, args.model_dir, dataset))}\n"
                  f"  env: {shown}")
        return
    if not args.out:
        parser.error("--out is required")
    args.started = time.time()
    built = prepare(args)
    site = write_site(work)
    head = {**common.run_head("dfpo_bench.trained.cards_8b", sys.argv[1:]), "context_gib": CONTEXT_GIB, "model": built,
            "machine_flags": machine_flags(args.model_dir, dataset)}
    args.commit = head["commit"]  # each row's record names it: rows of earlier calls keep theirs

    def write() -> list[dict[str, Any]]:  # after every row: what a cut call leaves is the rows done so far
        records = collect(work)
        pathlib.Path(args.out).write_text(json.dumps({**head, "rows": records}, indent=1))
        return records

    run_lanes(rows, args, site, write)
    print_table(write())


if __name__ == "__main__":
    main()
