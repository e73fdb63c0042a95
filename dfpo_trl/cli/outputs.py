"""What a run writes to ``output_dir``: the summary (JSON and printed), the figure and the saved model
(docs/source/guides/cli.md).

An earlier run's results are set aside in ``previous_run/``, ``previous_run.1/``, ... once the run's first
optimizer step has ended, never deleted (:mod:`.files`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.method import method_in_use
from . import logger
from .files import PLOT_FILE, PREVIOUS_RUN_DIR, SUMMARY_FILE, set_aside_previous_outputs
from .plotting import plot_metrics

if TYPE_CHECKING:
    from ..config import DFPOConfig
    from .args import DFPOScriptArguments

__all__ = [
    "PLOT_FILE", "PREVIOUS_RUN_DIR", "SUMMARY_FILE", "format_summary", "method_label", "save_model",
    "set_aside_previous_outputs", "write_outputs",
]  # fmt: skip


def method_label(args: DFPOConfig) -> str:
    """The method a config trains with, as the summary and the figure name it (e.g. "DFPO min_replace")."""
    return method_in_use(args).label


def _file_stamps(directory: str) -> dict[str, tuple[int, int]]:
    """(modification time, size) of each file directly in ``directory``: what a save wrote is what changed."""
    path = Path(directory)
    if not path.is_dir():
        return {}
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in path.iterdir() if p.is_file()}


def save_model(trainer: Any, output_dir: str) -> list[str]:
    """Save the trained model to ``output_dir`` (without transformers' one-shard progress bar), every file with the
    permissions the umask gives (:func:`umask_permissions`); returns the names of the files the save wrote."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar says nothing
    before = _file_stamps(output_dir)
    try:
        trainer.save_model(output_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    saved = sorted(n for n, stamp in _file_stamps(output_dir).items() if before.get(n) != stamp)
    umask_permissions(Path(output_dir), saved)
    return saved


def umask_permissions(folder: Path, names: Sequence[str]) -> None:
    """Give each file the permissions a plain ``open()`` gives under the umask (0644 under 022): transformers writes
    ``model.safetensors`` through a private temporary file (0600), unlike the config and tokenizer files beside it,
    so another user of a shared output folder could read everything but the weights."""
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        path = folder / name
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def write_outputs(
    trainer: Any,
    script_args: DFPOScriptArguments,
    training_args: DFPOConfig,
    model_label: str,
    heldout_cb: Any,
    curves: Any,
    times: dict[str, float],
    start: float,
    interrupted: bool = False,
    saved: Sequence[str] = (),
    drift_cb: Any = None,
    stop_signal: str | None = None,
    earlier_run: str | None = None,
) -> dict[str, Any]:
    """Write the summary (and the figure) to ``output_dir``; print the summary unless the run was interrupted (by
    ``stop_signal``). ``earlier_run``: the aside folder the earlier run's results in ``output_dir`` went to."""
    out = Path(training_args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = None
    if script_args.plot:
        try:
            plot_path = str(
                plot_metrics(
                    trainer.state.log_history,
                    out / PLOT_FILE,
                    title=method_label(training_args),
                    heldout=heldout_cb.results if heldout_cb is not None else None,
                )
            )
        except ImportError as exc:
            logger.warning("no %s: %s (pip install matplotlib)", PLOT_FILE, exc)
    heldout = heldout_cb.results if heldout_cb is not None else {}
    eval_before = float(heldout.get("before_seconds") or 0.0)
    eval_after = float(heldout.get("after_seconds") or 0.0)
    eval_during = float(heldout.get("periodic_seconds") or 0.0)  # eval_every's measurements along the run
    total = time.monotonic() - start
    finished = datetime.now(UTC)
    time_split = {  # seconds; the held-out evaluations run inside train(), so training excludes them
        "model_conversion": round(times["model"], 1),
        "setup": round(times["setup"], 1),
        "eval_before": round(eval_before, 1),
        "training": round(times["train_call"] - eval_before - eval_during - eval_after, 1),
        "eval_during": round(eval_during, 1),
        "eval_after": round(eval_after, 1),
        "save_and_plot": round(total - times["model"] - times["setup"] - times["train_call"], 1),
        "total": round(total, 1),
    }
    summary = {
        "model": model_label,
        "task": script_args.task,
        "method": method_label(training_args),
        "group_transform": training_args.group_transform,
        "importance_sampling_level": training_args.importance_sampling_level,
        "loss_type": training_args.loss_type,
        "transform_gradient": training_args.transform_gradient,
        "num_generations": training_args.num_generations,
        "interrupted": interrupted,
        "signal": stop_signal,  # what interrupted the run: "SIGINT" (Ctrl-C), "SIGTERM", or None
        "steps": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "learning_rate": training_args.learning_rate,
        "heldout": heldout_cb.results if heldout_cb is not None else None,
        "drift": drift_cb.results if drift_cb is not None else None,
        **curves.results,
        # the one training time is time_split["training"]; log_history's last row also has transformers' own
        # train_runtime, which counts the held-out evaluation before training (docs/source/guides/cli.md)
        "time_split": time_split,
        "seed": training_args.seed,
        "versions": package_versions(),
        "started_utc": _utc(finished - timedelta(seconds=total)),
        "finished_utc": _utc(finished),
        "plot": plot_path,
        "output_dir": str(out),
        "earlier_run": earlier_run,  # where this run moved the earlier run's results (previous_run*/), or None
        # every file this run wrote to output_dir: what the next run moves aside (previous_run*/, guides/cli.md)
        "files": sorted({SUMMARY_FILE, *([PLOT_FILE] if plot_path else []), *saved}),
        "log_history": trainer.state.log_history,  # every logged step, as TRL's trainer_state.json keeps it
    }
    # whole or not at all: a second Ctrl-C may end the process here (signals.further_interrupts_wait)
    partial = out / f".{SUMMARY_FILE}.tmp-{os.getpid()}"
    partial.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(partial, out / SUMMARY_FILE)
    if not interrupted:
        print(format_summary(summary), flush=True)
    return summary


# The packages whose versions decide what a run computes, recorded in its summary.
VERSIONED_PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "peft")


def package_versions() -> dict[str, str]:
    """Python's, dfpo_trl's and :data:`VERSIONED_PACKAGES`' versions ("absent" for one not installed)."""
    from .. import __version__

    out = {"python": platform.python_version(), "dfpo_trl": __version__}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _utc(moment: datetime) -> str:
    """ISO 8601 in UTC to the second, e.g. 2026-11-27T04:40:12Z."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _heldout_line(heldout: dict[str, Any]) -> str:
    """Held-out accuracy before -> after training; for a resumed run, where "before" came from, or the accuracy at
    the resume step, named as such, when the checkpoint did not hold the one before training
    (docs/source/guides/cli.md)."""
    before, after, resumed = heldout.get("before"), heldout.get("after"), heldout.get("resumed_at")
    since, where = "", ""
    if before is None and heldout.get("at_resume") is not None:
        before, since = heldout["at_resume"], f" since step {resumed}"
        where = "; measured at the resume, the checkpoint holds no accuracy before training"
    elif resumed is not None:
        where = f"; resumed at step {resumed}, the accuracy before training is the checkpoint's"
    delta = after - before if before is not None and after is not None else None
    label = heldout.get("metric", "greedy accuracy")  # "avg@k" through vLLM (vllm_eval)
    return (f"held-out {label:<18}{_fmt(before)} -> {_fmt(after)}  ({_fmt(delta, '+.3f')}{since}, "
            f"{heldout['n']} fixed problems{where})")


def _heldout_curve_line(heldout: dict[str, Any]) -> str | None:
    """The held-out accuracy at each step it was measured (step 0: before training), when it was measured along
    the run (``eval_every``) and not only before and after."""
    curve = heldout.get("curve") or []
    if len(curve) <= 2:
        return None
    points = ", ".join(f"{int(step)}: {_fmt(value, '.2f')}" for step, value in curve)
    return f"held-out curve (step: acc) {points}"


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable final summary printed at the end of a run."""
    lines = ["", "=" * 72, f"DFPO run summary: {summary['method']} on task {summary['task']!r}", "-" * 72]
    lines.append(f"model                      {summary['model']}")
    lines.append(f"optimizer steps            {summary['steps']}  (G = {summary['num_generations']})")
    heldout = summary.get("heldout")
    if heldout:
        lines.append(_heldout_line(heldout))
        curve_line = _heldout_curve_line(heldout)
        if curve_line:
            lines.append(curve_line)
    per = "step" if summary.get("reward_curve") == "step_reward" else "rollout"
    lines.append(
        f"training reward, EMA {_fmt(summary.get('reward_ema_alpha'), 'g'):<5}{_fmt(summary.get('reward_ema_first'))} "
        f"-> {_fmt(summary.get('reward_ema_last'))}  (peak {_fmt(summary.get('reward_ema_peak'))}; one point per {per})"
    )
    threshold = summary.get("reward_threshold")
    reached = summary.get("steps_to_threshold")
    lines.append(
        f"steps to reward >= {_fmt(threshold, 'g'):<8}{'never' if reached is None else reached}  "
        "(EMA 0.3 of the training reward, eq. 19)"
    )
    lines.append(f"Jitter2 of reward curve    {_fmt(summary.get('reward_jitter2'), '.4f')}  (eq. 20)")
    split = summary["time_split"]
    parts = [
        ("model_conversion", "model/conversion"), ("setup", "setup"), ("eval_before", "eval before"),
        ("training", "training"), ("eval_during", "eval during"), ("eval_after", "eval after"),
        ("save_and_plot", "save+plot"),
    ]  # fmt: skip
    parts = [(key, label) for key, label in parts if key in split and (key != "eval_during" or split[key])]
    lines.append(
        f"wall time                  {_fmt(split['total'], '.0f')} s: "
        + ", ".join(f"{label} {_fmt(split[key], '.0f')}" for key, label in parts)
    )
    if summary.get("plot"):
        lines.append(f"metrics plot               {summary['plot']}")
    lines.append(f"summary                    {Path(summary['output_dir']) / SUMMARY_FILE}")
    if summary.get("earlier_run"):
        lines.append(f"earlier run moved to       {summary['earlier_run']}/")
    lines.append("=" * 72)
    return "\n".join(lines)

