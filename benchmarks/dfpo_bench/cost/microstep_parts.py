"""What ``microstep_profile.py`` measures inside a micro-step: ``torch.profiler``'s table by label (the library's
own labels on DFPO's parts, ``PROFILE_LABELS``, and TRL's methods wrapped here) and the kernels under each, and the
host syncs (item, tolist, blocking copies) dfpo_trl makes at logging and non-logging steps; run through
``microstep_profile.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import pathlib
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

ROOT = pathlib.Path(__file__).resolve().parents[3]

import dfpo_trl  # noqa: E402
import torch  # noqa: E402
from dfpo_trl.testing.measures import PROFILE_LABELS  # noqa: E402


class Runner(Protocol):
    """What the profilers drive (``microstep_profile.Runner``): one method's trainer, micro-step by micro-step."""

    trainer: Any
    batches: Iterator[Any]

    def micro_step(self) -> dict[str, float]: ...

    def generates_next(self) -> bool: ...

    def ends_optimizer_step(self) -> bool: ...

    def is_logging_step(self) -> bool: ...

PACKAGE = str(pathlib.Path(dfpo_trl.__file__).resolve().parent)
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
HOST_COPIES = ("tensor", "as_tensor")  # host data made into a tensor on a named device: a blocking copy on CUDA


# ------------------------------------------------------------------------------------------------ profile
@dataclass(frozen=True)
class Label:
    """A TRL method wrapped for the profile: its class, its name, its label."""

    owner: Any
    attribute: str
    label: str


def profile_labels() -> list[Label]:
    """TRL's methods on the loss path that DFPOTrainer overrides or calls, each :func:`checked`. DFPO's own parts
    carry their labels in the library (``dfpo_trl.testing.measures.PROFILE_LABELS``); TRL's code carries none, so
    its methods are wrapped here (TRL's class, not the library's)."""
    from trl import GRPOTrainer

    trl_methods = ("training_step", "_prepare_inputs", "_compute_loss", "_get_per_token_logps_and_entropies", "log")
    return checked([Label(GRPOTrainer, m, f"trl.{m}") for m in trl_methods])


def checked(labels: list[Label]) -> list[Label]:
    """``labels``, once each owner defines its attribute: a renamed or moved method would otherwise drop out of the
    profile unnoticed, so a missing one raises ``LookupError`` naming it."""
    missing = [label.label for label in labels if label.attribute not in vars(label.owner)]
    if missing:
        raise LookupError(f"profile labels whose callable is gone (renamed or moved? update this list): {missing}")
    return labels


def _labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        with torch.profiler.record_function(label):
            return fn(*a, **k)

    return wrapper


@contextlib.contextmanager
def labels_installed(labels: list[Label]) -> Iterator[None]:
    """Wrap every label's method (restored on exit: the timing rounds run TRL's code unwrapped)."""
    originals = [(label, label.owner.__dict__[label.attribute]) for label in labels]
    try:
        for label, original in originals:
            if isinstance(original, staticmethod):
                raise TypeError(f"{label.label}: static methods are not wrapped")
            setattr(label.owner, label.attribute, _labelled(original, label.label))
        yield
    finally:
        for label, original in originals:
            setattr(label.owner, label.attribute, original)


def _kernels_under(event: Any, labelled: set[int], names: set[str]) -> tuple[int, float]:
    """(count, µs) of the device kernels ``event`` and its descendants launched, stopping at deeper labels. The
    device-side span kineto records for a label itself (``gpu_user_annotation``, named as the label) is no kernel."""
    kernels = [k for k in event.kernels if k.name not in names]
    count = len(kernels)
    micros = sum(k.duration for k in kernels)
    for child in event.cpu_children:
        if id(child) in labelled:
            continue
        c, us = _kernels_under(child, labelled, names)
        count, micros = count + c, micros + us
    return count, micros


def attribute_labels(events: list[Any], dfpo_labels: set[str], all_labels: set[str]) -> dict[str, dict[str, float]]:
    """Per label: calls, inclusive and self CPU µs, self kernels and kernel µs; plus, for ``trl._compute_loss``,
    the DFPO self time nested inside it (``dfpo_nested_us``). Self = not covered by a deeper label of the same
    thread (record_function ranges nest per thread)."""
    ours = [e for e in events if e.name in all_labels and e.device_type == torch.autograd.DeviceType.CPU]
    labelled = {id(e) for e in ours}
    stats: dict[str, dict[str, float]] = {}
    by_thread: dict[int, list[Any]] = {}
    for e in ours:
        by_thread.setdefault(e.thread, []).append(e)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        stack: list[tuple[Any, dict[str, float]]] = []
        for e in thread_events:
            while stack and stack[-1][0].time_range.end <= e.time_range.start:
                _close(stack.pop(), stack, stats, dfpo_labels, labelled, all_labels)
            stack.append((e, {"children_us": 0.0, "dfpo_nested_us": 0.0}))
        while stack:
            _close(stack.pop(), stack, stats, dfpo_labels, labelled, all_labels)
    return stats


def _close(item: tuple[Any, dict[str, float]], stack: list[tuple[Any, dict[str, float]]],
           stats: dict[str, dict[str, float]], dfpo_labels: set[str], labelled: set[int], names: set[str]) -> None:
    event, acc = item
    inclusive = event.time_range.end - event.time_range.start
    own = max(inclusive - acc["children_us"], 0.0)
    nested_dfpo = acc["dfpo_nested_us"] + (own if event.name in dfpo_labels else 0.0)
    kernels, kernel_us = _kernels_under(event, labelled, names)
    entry = stats.setdefault(event.name, {"calls": 0, "cpu_inclusive_us": 0.0, "cpu_self_us": 0.0, "ops": 0,
                                          "kernels": 0, "kernel_us": 0.0, "dfpo_nested_us": 0.0})
    entry["calls"] += 1
    entry["ops"] += sum(1 for child in event.cpu_children if id(child) not in labelled)
    entry["cpu_inclusive_us"] += inclusive
    entry["cpu_self_us"] += own
    entry["kernels"] += kernels
    entry["kernel_us"] += kernel_us
    entry["dfpo_nested_us"] += acc["dfpo_nested_us"]
    if stack:
        parent = stack[-1][1]
        parent["children_us"] += inclusive
        parent["dfpo_nested_us"] += nested_dfpo


def profile_methods(runners: dict[str, Runner], args: argparse.Namespace) -> dict[str, Any]:
    """Per method: the labelled profile of ``--profile-cycles`` rollouts' non-generating micro-steps."""
    from torch.profiler import ProfilerActivity, profile

    labels = profile_labels()
    dfpo_labels = set(PROFILE_LABELS)
    all_labels = {label.label for label in labels} | dfpo_labels | {"micro_step"}
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    out: dict[str, Any] = {}
    with labels_installed(labels):
        for name, runner in runners.items():
            totals: dict[str, dict[str, float]] = {}
            steps = 0
            wall = 0.0
            for _ in range(args.profile_cycles):
                runner.micro_step()  # the rollout, outside the profile
                with profile(activities=activities) as prof:
                    while not runner.generates_next():
                        with torch.profiler.record_function("micro_step"):
                            parts = runner.micro_step()
                        wall += parts["training_step"] + parts["log"]
                        steps += 1
                for label, entry in attribute_labels(list(prof.events()), dfpo_labels, all_labels).items():
                    into = totals.setdefault(label, dict.fromkeys(entry, 0.0))
                    for key, value in entry.items():
                        into[key] += value
            table = {
                label: {
                    "calls": e["calls"] / steps, "cpu_ms": e["cpu_inclusive_us"] / steps / 1e3,
                    "cpu_self_ms": e["cpu_self_us"] / steps / 1e3, "torch_ops": e["ops"] / steps,
                    "cuda_kernels": e["kernels"] / steps,
                    "cuda_ms": e["kernel_us"] / steps / 1e3, "dfpo": label in dfpo_labels,
                }
                for label, e in sorted(totals.items())
            }
            compute = totals.get("trl._compute_loss")
            out[name] = {
                "micro_steps": steps,
                "wall_ms": 1e3 * wall / steps,  # training_step + log, with the profiler on
                "dfpo_self_cpu_ms": sum(v["cpu_self_ms"] for v in table.values() if v["dfpo"]),
                "dfpo_self_torch_ops": sum(v["torch_ops"] for v in table.values() if v["dfpo"]),
                "dfpo_self_cuda_kernels": sum(v["cuda_kernels"] for v in table.values() if v["dfpo"]),
                "dfpo_self_cuda_ms": sum(v["cuda_ms"] for v in table.values() if v["dfpo"]),
                "trl_compute_loss_minus_dfpo_cpu_ms": None if compute is None else
                (compute["cpu_inclusive_us"] - compute["dfpo_nested_us"]) / steps / 1e3,
                "labels": table,
            }
    return out


# --------------------------------------------------------------------------------------------- host syncs
@contextlib.contextmanager
def host_syncs_from_dfpo(cuda: bool) -> Iterator[list[str]]:
    """Record ``file:line what`` of each host read of a tensor made directly by dfpo_trl code, and on CUDA of every
    synchronising CUDA call, at the innermost frame outside torch (prefixed ``other: `` when that is not dfpo_trl:
    TRL's own syncs run under DFPOTrainer's methods too, and are not DFPO's)."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def recording(name: str) -> Callable[..., Any]:
        original = originals[name]

        def read(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                seen.append(f"{_short(caller.f_code.co_filename)}:{caller.f_lineno} host read .{name}")
            return original(self, *a, **k)

        return read

    factories = {name: getattr(torch, name) for name in HOST_COPIES}

    def copying(name: str) -> Callable[..., Any]:
        original = factories[name]

        def make(data: Any, *a: Any, **k: Any) -> Any:
            caller = sys._getframe(1)
            if (k.get("device") is not None and not isinstance(data, torch.Tensor)
                    and caller.f_code.co_filename.startswith(PACKAGE)):
                seen.append(f"{_short(caller.f_code.co_filename)}:{caller.f_lineno} host data to device "
                            f"(torch.{name}: a blocking copy on CUDA)")
            return original(data, *a, **k)

        return make

    def on_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None):
        if "synchroniz" not in str(message):
            return
        caller = _calling_frame(traceback.extract_stack()[:-1])
        if caller is not None:
            owner = "" if caller.filename.startswith(PACKAGE) else "other: "
            seen.append(f"{owner}{_short(caller.filename)}:{caller.lineno} cuda sync")

    for name in HOST_READS:
        setattr(torch.Tensor, name, recording(name))
    for name in HOST_COPIES:
        setattr(torch, name, copying(name))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        if cuda:
            torch.cuda.set_sync_debug_mode(1)
        try:
            yield seen
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            for name, original in factories.items():
                setattr(torch, name, original)


TORCH_DIR = str(pathlib.Path(torch.__file__).resolve().parent)


def _calling_frame(stack: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, the warnings module and this file: the code that made the sync."""
    for frame in reversed(stack):
        name = frame.filename
        if not (name.startswith(TORCH_DIR) or name == __file__ or name.endswith("warnings.py")):
            return frame
    return None


def _short(filename: str) -> str:
    """A path from its package's folder on (``dfpo_trl/...``, ``trl/...``)."""
    path = pathlib.Path(filename).resolve()
    for root in (pathlib.Path(PACKAGE).parent, pathlib.Path(TORCH_DIR).parent):
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return str(path)


def count_syncs(runners: dict[str, Runner], args: argparse.Namespace) -> dict[str, Any]:
    """Per method: host syncs from dfpo_trl per non-generating micro-step in ``training_step`` and in ``log``, with
    ``logging_steps`` 1 (every step logs) and with a ``logging_steps`` no step reaches (no step logs)."""
    out: dict[str, Any] = {}
    cuda = args.device.startswith("cuda")
    for name, runner in runners.items():
        entry: dict[str, Any] = {}
        saved = runner.trainer.args.logging_steps
        for case, logging_steps in (("logging_steps", 1), ("non_logging_steps", 10**9)):
            runner.trainer.args.logging_steps = logging_steps
            runner.micro_step()  # the rollout, not counted
            loss_path: list[str] = []
            at_log: list[str] = []
            steps = 0
            while not runner.generates_next():
                t = runner.trainer
                ends, logging = runner.ends_optimizer_step(), runner.is_logging_step()
                with host_syncs_from_dfpo(cuda) as seen:
                    loss = t.training_step(t.model, next(runner.batches), None)
                    runner.sync()
                loss_path += seen
                if ends:
                    t.optimizer.step()
                    t.model.zero_grad(set_to_none=True)
                    t.state.global_step += 1
                if logging:
                    value = float(loss.detach())  # the loop's own read, outside the count
                    with host_syncs_from_dfpo(cuda) as seen:
                        t.log({"loss": value})
                    at_log += seen
                steps += 1
            ours = [site for site in loss_path if not site.startswith("other: ")]
            ours_at_log = [site for site in at_log if not site.startswith("other: ")]
            entry[case] = {
                "micro_steps": steps,
                # dfpo_trl's host reads and CUDA syncs, per micro-step
                "training_step_per_step": len(ours) / steps, "log_per_step": len(ours_at_log) / steps,
                "training_step_sites": sorted(set(ours)), "log_sites": sorted(set(ours_at_log)),
                # every CUDA sync (TRL's, transformers', ...) by the code that made it, for comparison
                "all_cuda_syncs_training_step_per_step": sum("cuda sync" in x for x in loss_path) / steps,
                "all_cuda_syncs_log_per_step": sum("cuda sync" in x for x in at_log) / steps,
                "other_sites": sorted({x[len("other: "):] for x in loss_path + at_log if x.startswith("other: ")}),
            }
        runner.trainer.args.logging_steps = saved
        out[name] = entry
    return out
