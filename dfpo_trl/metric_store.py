"""DFPO's metrics as device tensors until a logging step, reduced over every process there.

Reading a metric on the host (``.item()``, ``.tolist()``, ``float(t)``) makes the host wait for the device; in
the loss path that is a sync per micro-step, and inside a backward hook a sync in the middle of DDP's
overlapped backward. So the trainer only *adds* 0-dim tensors here (a running sum and count, a running
minimum), and reads them once per logging step (:meth:`MetricStore.flush`), after one all-reduce over all
processes. A metric then means the same at any world size: the mean over every group (or token, or shared
position) of the logging interval on every process, not one process's view.

Three kinds: ``mean`` (Σ total / Σ count, pooled over micro-steps and processes), ``min`` (the minimum over
entries with a positive count) and ``sum`` (a count of events).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

Kind = Literal["mean", "min", "sum"]
NamesGather = Callable[[list[tuple[str, str]]], list[list[tuple[str, str]]]]


class MetricStore:
    """Per-mode (``"train"``, ``"eval"``) accumulators of named metrics, each a (kind, total, count) of 0-dim
    float64 tensors on the device that produced them."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, tuple[Kind, Tensor, Tensor]]] = {"train": {}, "eval": {}}

    def _add(self, mode: str, name: str, kind: Kind, total: Tensor, count: Tensor | float) -> None:
        total = total.detach().to(torch.float64)
        count = torch.as_tensor(count, dtype=torch.float64, device=total.device)
        if kind == "min":  # an entry without a count must not lower the minimum
            total = torch.where(count > 0, total, torch.full_like(total, float("inf")))
        store = self._entries.setdefault(mode, {})
        if name not in store:
            store[name] = (kind, total.clone(), count.clone())
            return
        known, running, seen = store[name]
        if known != kind:
            raise ValueError(f"metric {name!r} is a {known!r} metric, not {kind!r}")
        running = torch.minimum(running, total) if kind == "min" else running + total.to(running.device)
        store[name] = (kind, running, seen + count.to(seen.device))

    def add_mean(self, mode: str, name: str, total: Tensor, count: Tensor | float) -> None:
        """Add Σ of ``count`` values (``total``) to a pooled mean."""
        self._add(mode, name, "mean", total, count)

    def add_min(self, mode: str, name: str, value: Tensor, count: Tensor | float = 1.0) -> None:
        """Lower a running minimum by ``value`` (ignored when ``count`` is 0: no entries behind it)."""
        self._add(mode, name, "min", value, count)

    def add_sum(self, mode: str, name: str, total: Tensor) -> None:
        """Add to a count of events."""
        self._add(mode, name, "sum", total, 1.0)

    def pending(self, mode: str) -> list[str]:
        return sorted(self._entries.get(mode, {}))

    def flush(
        self, mode: str, device: torch.device | str, gather_names: NamesGather | None = None
    ) -> dict[str, float]:
        """Every metric of ``mode`` reduced over all processes, as Python floats (one host read), and clear.

        With ``gather_names`` (several processes), the metric names are first united across processes so that
        every process all-reduces the same tensors in the same order; a process without a metric contributes an
        empty entry. Metrics without any count are left out (a mean over nothing is not 0)."""
        entries = self._entries.get(mode, {})
        self._entries[mode] = {}
        names = sorted((name, kind) for name, (kind, _, _) in entries.items())
        if gather_names is not None:
            names = sorted({item for per_process in gather_names(names) for item in per_process})
        if not names:
            return {}
        stats = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
        minima = torch.full((len(names),), float("inf"), dtype=torch.float64, device=device)
        for row, (name, kind) in enumerate(names):
            if name not in entries:
                continue
            _, total, count = entries[name]
            if kind == "min":
                minima[row] = total.to(device)
            else:
                stats[row, 0] = total.to(device)
            stats[row, 1] = count.to(device)
        if gather_names is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            dist.all_reduce(minima, op=dist.ReduceOp.MIN)
        values = torch.stack([stats[:, 0], stats[:, 1], minima], dim=1).cpu().tolist()  # the one host read
        out: dict[str, float] = {}
        for (name, kind), (total, count, minimum) in zip(names, values, strict=True):
            if count <= 0:
                continue
            out[name] = minimum if kind == "min" else total if kind == "sum" else total / count
        return out
