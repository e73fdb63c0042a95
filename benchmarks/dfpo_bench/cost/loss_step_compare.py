"""Pool ``loss_step.py`` runs of two builds of the code and bootstrap the difference of their ratios to TRL.

Used to check that the drop-in refactor left the step time unchanged or better: ``loss_step.py`` run several times
in one GPU job, alternating the code after a change (``--tag code-new-<i>``) and before it (``--tag code-old-<i>``,
run from a checkout of the old commit). Per method, the per-round ratios to TRL's ``GRPOTrainer`` (same process,
same round) of all runs of a build are pooled; the difference of the pooled medians (new − old) gets a 95% bootstrap
interval (resampling rounds within each build).

    python -m dfpo_bench.cost.loss_step_compare benchmarks/results/loss_step_code

Writes ``summary.json`` in that folder and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics


def pooled_ratios(folder: pathlib.Path) -> tuple[dict[str, dict[str, list[float]]], set[str]]:
    """{method: {build: [per-round ratio to TRL, pooled over runs]}} and the devices the runs used."""
    ratios: dict[str, dict[str, list[float]]] = {}
    devices = set()
    for path in sorted(folder.glob("loss_step_code-*.json")):
        build = path.stem.split("-")[1]  # loss_step_code-<build>-<i>
        run = json.loads(path.read_text())
        devices.add(run["device"])
        base = run["methods"][run["baseline"]]["round_median_s"]
        for method, entry in run["methods"].items():
            if method == run["baseline"]:
                continue
            pooled = ratios.setdefault(method, {}).setdefault(build, [])
            pooled.extend(t / b for t, b in zip(entry["round_median_s"], base, strict=True))
    return ratios, devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--draws", type=int, default=4000)
    args = parser.parse_args()
    ratios, devices = pooled_ratios(args.folder)
    rng = random.Random(0)
    summary: dict[str, object] = {"devices": sorted(devices), "methods": {}}
    print(f"{'method':22s} {'new':>7s} {'old':>7s} {'new - old':>10s}  95% interval")
    for method, builds in ratios.items():
        new, old = builds["new"], builds["old"]
        draws = sorted(
            statistics.median(rng.choices(new, k=len(new))) - statistics.median(rng.choices(old, k=len(old)))
            for _ in range(args.draws)
        )
        low, high = draws[int(0.025 * args.draws)], draws[int(0.975 * args.draws) - 1]
        difference = statistics.median(new) - statistics.median(old)
        summary["methods"][method] = {  # type: ignore[index]
            "ratio_new": statistics.median(new), "ratio_old": statistics.median(old), "rounds_new": len(new),
            "rounds_old": len(old), "difference": difference, "difference_interval_95": [low, high],
        }
        print(f"{method:22s} {statistics.median(new):7.4f} {statistics.median(old):7.4f} {difference:+10.4f}  "
              f"[{low:+.4f}, {high:+.4f}]")
    (args.folder / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
