"""Time each DFPO group transform on (groups, G) inputs.

Median time per call (ms) of every transform, written with the device and torch version to --out;
torch.utils.benchmark.Timer synchronises CUDA around each measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import torch
import torch.utils.benchmark as benchmark
from dfpo_trl import get_transform, registered_transforms
from dfpo_trl.testing.measures import sign_aware_post_clip

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def make_inputs(groups: int, group_size: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Realistic inputs: post-clip ratios around 1 and GRPO advantages of 0/1 rewards (many ties)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    s = torch.exp(0.3 * torch.randn(groups, group_size, generator=gen))
    rewards = (torch.rand(groups, group_size, generator=gen) < 0.4).float()
    adv = rewards - rewards.mean(dim=-1, keepdim=True)
    adv = adv / (adv.std(dim=-1, keepdim=True) + 1e-4)
    s_bar = sign_aware_post_clip(s, adv, 0.2, 0.28)
    return s_bar.to(device=device, dtype=dtype), adv.to(device=device, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=10000)
    parser.add_argument("--G", type=int, default=32, dest="group_size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds of measurement per transform")
    parser.add_argument("--out", default="benchmarks/results/transforms_timing.json")
    args = parser.parse_args()

    w, adv = make_inputs(args.groups, args.group_size, args.device, DTYPES[args.dtype])
    results = {}
    with torch.no_grad():
        for name in registered_transforms():
            apply = get_transform(name).apply
            apply(w, adv, 0.5, 1e-6)  # warm-up (kernel caching, lazy init)
            timer = benchmark.Timer(stmt="apply(w, adv, 0.5, 1e-6)", globals={"apply": apply, "w": w, "adv": adv},
                                    num_threads=torch.get_num_threads())
            measurement = timer.blocked_autorange(min_run_time=args.min_run_time)
            median_ms, iqr_ms = measurement.median * 1e3, measurement.iqr * 1e3
            results[name] = {"median_ms": median_ms, "iqr_ms": iqr_ms}
            print(f"{name:>20s}: median {median_ms:8.4f} ms  (IQR {iqr_ms:.4f} ms)")

    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor()
    report = {"groups": args.groups, "G": args.group_size, "dtype": args.dtype, "device": args.device,
              "device_name": device_name, "torch": torch.__version__, "results": results}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
