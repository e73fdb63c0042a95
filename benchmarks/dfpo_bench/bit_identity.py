"""Bit-identical runs before and after a refactor: a few CPU training steps per configuration, fingerprinted.

Each configuration trains ``dfpo_trl.testing``'s tiny random Llama for ``--steps`` optimizer steps (seed 0, float32,
two micro-steps per step, a rollout every four, so off-policy steps occur). The fingerprint is the SHA-256 of every
parameter's bytes and the exact ``repr`` of every logged number: equal on one machine means the same arithmetic in
the same order; another CPU rounds differently, so compare files of one machine only (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import pathlib
import platform
import subprocess
import sys
import tempfile
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]

# name -> DFPOConfig fields on top of dfpo_trl.testing.tiny_config_kwargs and SHARED
SEQUENCE = {"importance_sampling_level": "sequence", "epsilon": 3e-2, "epsilon_high": 4e-2}
CONFIGS: dict[str, dict[str, Any]] = {
    "off_token": {"group_transform": "none"},
    "off_sequence": {**SEQUENCE, "group_transform": "none"},
    "min_replace": {**SEQUENCE, "group_transform": "min_replace"},
    "min_replace_gradient": {**SEQUENCE, "group_transform": "min_replace", "cancellation_target": "gradient"},
    "orth_proj": {**SEQUENCE, "group_transform": "orth_proj"},
    "orth_proj_gradient": {**SEQUENCE, "group_transform": "orth_proj", "cancellation_target": "gradient"},
    "positive_orth_proj": {**SEQUENCE, "group_transform": "positive_orth_proj"},
    "truncate_rebalance": {**SEQUENCE, "group_transform": "truncate_rebalance"},
    "scale": {**SEQUENCE, "group_transform": "scale", "transform_scale": 0.7},
    "min_replace_score": {**SEQUENCE, "group_transform": "min_replace", "transform_gradient": "score"},
    "min_replace_no_stop_gradient": {**SEQUENCE, "group_transform": "min_replace", "transform_stop_gradient": False},
    "min_replace_pre_pass": {**SEQUENCE, "group_transform": "min_replace", "group_layout": "pre_pass"},
    # the users'-size ordering: a micro-batch smaller than a group, so the pre-pass lays each process's groups in
    # consecutive rows (groups/layout.py's seeded group order) and forwards only the step's groups
    "min_replace_pre_pass_small_batch": {**SEQUENCE, "group_transform": "min_replace", "group_layout": "pre_pass",
                                         "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    "min_replace_redistributed": {**SEQUENCE, "group_transform": "min_replace", "group_layout": "redistributed",
                                  "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    "grpo_fix": {"symmetric_clip": True},
    "delta": {"token_weighting": "delta"},
    "min_replace_metrics": {**SEQUENCE, "group_transform": "min_replace", "log_mechanism_metrics": True,
                            "log_energy_buckets": 2}}
SHARED = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_generation": 4,
          "num_generations": 4, "learning_rate": 5e-2, "max_completion_length": 6}
TIMING_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}


def fingerprint(name: str, steps: int) -> dict[str, Any]:
    """Train one configuration for ``steps`` optimizer steps; the parameters' SHA-256 and every logged number."""
    import torch
    from dfpo_trl import DFPOConfig, DFPOTrainer
    from dfpo_trl.testing import tiny_trainer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        trainer = tiny_trainer(DFPOTrainer, DFPOConfig, output_dir=out, max_steps=steps, **{**SHARED, **CONFIGS[name]})
        trainer.train()
    digest = hashlib.sha256()
    for key, value in sorted(trainer.model.state_dict().items()):
        digest.update(key.encode() + value.detach().cpu().contiguous().numpy().tobytes())
    logs = [{k: repr(v) for k, v in row.items() if isinstance(v, (int, float)) and k not in TIMING_KEYS}
            for row in trainer.state.log_history]
    return {"params_sha256": digest.hexdigest(), "log_history": logs,
            "finite": all(math.isfinite(float(v)) for row in logs for v in row.values())}


def compare(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Print what differs run by run, then the verdict; the exit code (1: not bit-identical)."""
    same = True
    for name in sorted(set(before["runs"]) | set(after["runs"])):
        a, b = before["runs"].get(name), after["runs"].get(name)
        if a is None or b is None:
            print(f"{name:30s} only in {'after' if a is None else 'before'}")
            same = False
            continue
        params = a["params_sha256"] == b["params_sha256"]
        logs = a["log_history"] == b["log_history"]
        print(f"{name:30s} parameters {'identical' if params else 'DIFFER'}, logs {'identical' if logs else 'DIFFER'}")
        if not logs:
            for i, (ra, rb) in enumerate(zip(a["log_history"], b["log_history"], strict=False)):
                diff = {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}
                if diff:
                    print(f"    log row {i}: {dict(sorted(diff.items()))}")
                    break
        same &= params and logs
    print("bit-identical" if same else "NOT bit-identical")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the fingerprints here")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--check", metavar="FILE", help="rerun FILE's configurations and steps here and compare")
    args = p.parse_args(argv)
    if args.check:
        before = json.loads(pathlib.Path(args.check).read_text())
        args.steps, args.configs = before["steps"], list(before["runs"])
    if args.compare:
        return compare(*(json.loads(pathlib.Path(f).read_text()) for f in args.compare))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # a fingerprint holds on one machine and one set of versions only: they are recorded beside it
    versions = {name: importlib.import_module(name).__version__ for name in ("torch", "transformers", "trl")}
    result = {"commit": commit, "machine": platform.processor() or platform.machine(), "versions": versions,
              "steps": args.steps, "shared": SHARED, "configs": {n: CONFIGS[n] for n in args.configs}, "runs": {}}
    for name in args.configs:
        run = result["runs"][name] = fingerprint(name, args.steps)
        print(f"{name:30s} {run['params_sha256'][:16]} finite {run['finite']}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.check:
        if (before.get("versions"), before["machine"]) != (versions, result["machine"]):
            print(f"note: {args.check} was made with {before.get('versions')} on {before['machine']}; a fingerprint "
                  "holds on the same machine and versions only")
        return compare(before, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
