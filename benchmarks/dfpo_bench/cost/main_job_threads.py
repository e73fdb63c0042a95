"""The main job's wall time with 1 and 2 PyTorch threads, on a quiet machine and beside one busy core.

    # on the project's 2-core CPU machine, nothing else running; about 30 minutes
    python -m dfpo_bench.cost.main_job_threads --out benchmarks/results/main_job_threads.json

Each condition runs ``dfpo-train recipes/smollm2_cpu.yaml`` as the README's main job does (the embedded model,
already converted), with ``OMP_NUM_THREADS`` set to the thread count (PyTorch's intra-op threads follow it), in a
fresh output folder. "busy": a second process spins on one core for the whole run (``while True: pass``), the
load of one other single-threaded job, as when another engineer's tests run beside it. Recorded per condition: the
wall time, the run's own time split (``dfpo_summary.json``), the held-out accuracy before and after, and the
1-minute load average at the start and the end. The conditions run one after another in the order given.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]
SPIN = "while True: pass"


def one_run(threads: int, busy: bool, work: pathlib.Path, extra: list[str], timeout: float) -> dict[str, Any]:
    out = work / f"threads{threads}_{'busy' if busy else 'quiet'}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    load_start = os.getloadavg()[0]
    start = time.monotonic()
    timed_out = False
    try:
        code = subprocess.call([sys.executable, "-m", "dfpo_trl", "recipes/smollm2_cpu.yaml", "--output_dir", str(out),
                                *extra], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=timeout)
    except subprocess.TimeoutExpired:  # the wall time is then a lower bound
        code, timed_out = None, True
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    wall = time.monotonic() - start
    record: dict[str, Any] = {"threads": threads, "busy_core": busy, "exit_code": code, "wall_s": round(wall, 1),
                              "timed_out": timed_out,
                              "load_1min_start": round(load_start, 2), "load_1min_end": round(os.getloadavg()[0], 2)}
    summary_path = out / "dfpo_summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        record["time_split"] = summary.get("time_split")
        record["heldout"] = {k: (summary.get("heldout") or {}).get(k) for k in ("before", "after")}
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/main_job_threads.json")
    p.add_argument("--work", default="/tmp/main_job_threads")
    p.add_argument("--conditions", nargs="+", default=["2:quiet", "1:quiet", "2:busy", "1:busy"],
                   help="THREADS:quiet|busy, run in this order")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take; then stopped (a lower bound)")
    p.add_argument("extra", nargs="*", help="more dfpo-train flags after --")
    args = p.parse_args(argv)
    runs = []
    for condition in args.conditions:
        threads, load = condition.split(":")
        if load not in ("quiet", "busy"):
            p.error(f"condition {condition!r}: expected THREADS:quiet or THREADS:busy")
        runs.append(one_run(int(threads), load == "busy", pathlib.Path(args.work), args.extra, args.timeout))
        print(json.dumps(runs[-1]), flush=True)
        pathlib.Path(args.out).write_text(json.dumps({"machine": {"cpus": os.cpu_count()}, "runs": runs}, indent=1)
                                          + "\n")


if __name__ == "__main__":
    main()
