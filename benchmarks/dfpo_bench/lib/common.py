"""What every benchmark script shares: the machine and package labels a result records, atomic JSON records,
stopping a launched process group, and a ``dfpo-train`` run in-process (torch imported only where needed)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import platform
import signal
import subprocess
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, torch threads={torch.get_num_threads()})"


def versions() -> dict[str, str]:
    """The installed versions of the packages a run's numbers depend on ("absent" when not installed)."""
    import importlib.metadata as md

    out = dict.fromkeys(("torch", "transformers", "trl", "vllm", "accelerate"), "absent")
    for name in out:
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def load_json(path: pathlib.Path) -> Any:
    """A result file's JSON, or None when the run has not written it (the reports skip what is missing)."""
    return json.loads(path.read_text()) if path.exists() else None


def save_figure(fig: Any, fig_dir: pathlib.Path, name: str, out: pathlib.Path, dpi: int) -> str:
    """Save a matplotlib figure as ``fig_dir/name`` and close it; its path as RESULTS.md (``out``) links it: relative
    to the report's folder when the figure is inside it."""
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    path = fig_dir / name
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return str(path.relative_to(out.parent)) if path.is_relative_to(out.parent) else str(path)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Atomic JSON write (a reader never sees a half file; a killed job leaves the previous version)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def quiet() -> None:
    """Keep logs short: transformers/TRL warnings once, no progress bars."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``), SIGKILL it after
    ``grace_s`` seconds, and reap ``proc``: an ``accelerate launch`` (or vLLM's server) leaves children behind
    otherwise. A group already gone is no error."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        proc.poll()
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def child_pythonpath(*first: str) -> str:
    """The import path a job's child process gets: ``first``, then this checkout's library and its benchmarks package
    (the GPU kit installs neither), then what the job had."""
    return os.pathsep.join(p for p in (*first, str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)


def run_head(module: str, argv: list[str]) -> dict[str, Any]:
    """What a GPU job's record starts with: its command, the checkout (``provenance``), versions, card and date."""
    from dfpo_bench.lib import provenance

    return {"command": f"python -m {module} " + " ".join(argv), **provenance.checkout_state(ROOT),
            "versions": versions(), "card": device_name("cuda"), "date": time.strftime("%Y-%m-%d")}


# what every dfpo-train run writes to its output_dir (docs/source/guides/cli.md, "Outputs")
SUMMARY_FILE = "dfpo_summary.json"


def train_in_process(argv: list[str], output_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``dfpo-train argv`` in this process (``dfpo_trl.cli.dfpo_train``, so that a job's instruments see the run) and
    the summary it wrote to ``output_dir``; a run that exits non-zero raises, naming its exit code."""
    from dfpo_trl.cli import dfpo_train

    code = dfpo_train(argv)
    if code != 0:
        raise RuntimeError(f"dfpo-train {' '.join(map(str, argv))} exited with {code}")
    return load_json(pathlib.Path(output_dir) / SUMMARY_FILE)


def card() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - only a label
        return "unknown"
