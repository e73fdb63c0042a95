"""MetricStore: the only path of DFPO's metrics into TRL's logs, device tensors until a logging step.

Reading a metric on the host (``.item()``, ``.tolist()``, ``float(t)``) makes the host wait for the device; in
the loss path that is a sync per micro-step, and inside a backward hook a sync in the middle of DDP's
overlapped backward. So the trainer only *adds* 0-dim tensors here, and they are read once per logging step
(:meth:`MetricStore.flush`), after one all-reduce over all processes. A metric then means the same at any world
size: the mean over every group (or token, or shared position) of the logging interval on every process, not
one process's view.

Adding launches no device work at all: an entry is kept as the (detached) tensor the caller made, and every
entry of the interval is reduced at once at the flush, a few kernels per dtype however many entries there are
(why not per add: docs/source/concepts/decisions.md, "Metrics"). A long logging interval is folded into one entry per
metric every
:data:`COMPACT_AFTER` entries, so memory stays bounded.

Five pooled kinds: ``mean`` (Σ total / Σ count, pooled over micro-steps and processes), ``min`` and ``max`` (the
minimum / maximum over entries with a positive count), ``sum`` (a count of events) and ``std`` (the population
standard deviation of the pooled values, from Σ (x − c), Σ (x − c)² and the count; c a centre near the values, so
the difference of moments keeps its digits). At TRL's ``log``, :meth:`MetricStore.flush_into`
appends one value per metric to TRL's own ``_metrics``, which TRL averages and logs with its own.

Three per-call kinds, for values that stand in for a metric TRL itself logs once per loss call (the clip
fractions, metrics/clip.py): ``call_mean`` (Σ total / max(Σ count, 1) over processes, divided in float32 as TRL
divides, so equal inputs give TRL's value bit for bit), ``call_min`` and ``call_max`` (over processes, NaN meaning
"no value", as TRL's nanmin/nanmax). Each entry stays one value: at the flush every entry is reduced over processes
on its own and appended to TRL's list, so TRL averages them over the logging interval exactly as it averages its
own per-call values. Every process must add the same number of entries (the loss calls of a step run in lockstep,
as TRL's own per-call reductions require); the flush checks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from accelerate.utils import gather_object
from torch import Tensor

from ..profiling import profiled

Kind = Literal["mean", "min", "max", "sum", "std", "std_squares", "call_mean", "call_min", "call_max"]
CALL_KINDS: tuple[Kind, ...] = ("call_mean", "call_min", "call_max")
Name = tuple[str, str, int]  # (metric, kind, number of per-call values; 0 for the pooled kinds)
NamesGather = Callable[[list[Name]], list[list[Name]]]
EXTREMES: tuple[Kind, ...] = ("min", "max")
STD_SQUARES = "\x00squares"
"""Suffix of the hidden entry that holds a ``std`` metric's Σ (x − c)² (never logged under its own name)."""

COMPACT_AFTER = 4096
"""Pending entries of one mode after which they are folded into one per metric (on the device, no host read)."""


@dataclass
class _Pending:
    """One metric's entries since the last flush: totals (0-dim tensors) and counts (tensors or host floats)."""

    kind: Kind
    totals: list[Tensor] = field(default_factory=list)
    counts: list[Tensor | float] = field(default_factory=list)


class MetricStore:
    """Per-mode (``"train"``, ``"eval"``) pending entries of named metrics, reduced at :meth:`flush`."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, _Pending]] = {"train": {}, "eval": {}}
        self._sizes: dict[str, int] = {"train": 0, "eval": 0}

    def _add(self, mode: str, name: str, kind: Kind, total: Tensor, count: Tensor | float) -> None:
        with profiled("dfpo/metric_store.add"):
            self._append(mode, name, kind, total, count)
            if self._sizes[mode] >= COMPACT_AFTER:
                self._compact(mode)

    def _append(self, mode: str, name: str, kind: Kind, total: Tensor, count: Tensor | float) -> None:
        store = self._entries.setdefault(mode, {})
        pending = store.get(name)
        if pending is None:
            pending = store[name] = _Pending(kind)
        elif pending.kind != kind:
            raise ValueError(f"metric {name!r} is a {pending.kind!r} metric, not {kind!r}")
        pending.totals.append(total.detach())
        pending.counts.append(count.detach() if isinstance(count, Tensor) else float(count))
        self._sizes[mode] = self._sizes.get(mode, 0) + 1

    def add_mean(self, mode: str, name: str, total: Tensor, count: Tensor | float) -> None:
        """Add Σ of ``count`` values (``total``) to a pooled mean."""
        self._add(mode, name, "mean", total, count)

    def add_min(self, mode: str, name: str, value: Tensor, count: Tensor | float = 1.0) -> None:
        """Lower a running minimum by ``value`` (ignored when ``count`` is 0: no entries behind it)."""
        self._add(mode, name, "min", value, count)

    def add_max(self, mode: str, name: str, value: Tensor, count: Tensor | float = 1.0) -> None:
        """Raise a running maximum by ``value`` (ignored when ``count`` is 0: no entries behind it)."""
        self._add(mode, name, "max", value, count)

    def add_std(self, mode: str, name: str, deviations: Tensor, squares: Tensor, count: Tensor | float) -> None:
        """Add ``count`` values to a pooled standard deviation: ``deviations`` = Σ (x − c), ``squares`` =
        Σ (x − c)², for a centre c fixed for the metric (e.g. 1 for ratios)."""
        self._add(mode, name, "std", deviations, count)
        self._add(mode, name + STD_SQUARES, "std_squares", squares, count)

    def add_sum(self, mode: str, name: str, total: Tensor) -> None:
        """Add to a count of events."""
        self._add(mode, name, "sum", total, 1.0)

    def add_call_mean(self, mode: str, name: str, total: Tensor, count: Tensor | float) -> None:
        """Add one loss call's value of a per-call mean: Σ total / max(Σ count, 1) over processes, logged on its own
        (TRL's ``global_masked_mean``: a call with nothing to count gives 0)."""
        self._add(mode, name, "call_mean", total, count)

    def add_call_min(self, mode: str, name: str, value: Tensor) -> None:
        """Add one loss call's value of a per-call minimum over processes (NaN: no value on this process)."""
        self._add(mode, name, "call_min", value, 1.0)

    def add_call_max(self, mode: str, name: str, value: Tensor) -> None:
        """Add one loss call's value of a per-call maximum over processes (NaN: no value on this process)."""
        self._add(mode, name, "call_max", value, 1.0)

    def _names(self, mode: str) -> list[Name]:
        """This process's pending metrics of ``mode``: name, kind and, for a per-call kind, its number of values."""
        return sorted(
            (name, p.kind, sum(_numel(t) for t in p.totals) if p.kind in CALL_KINDS else 0)
            for name, p in self._entries.get(mode, {}).items()
        )

    def _take_calls(self, mode: str, names: list[Name], device: torch.device | str) -> tuple[Tensor, Tensor]:
        """The per-call entries of ``names`` (in that order), taken out of the store: ``sums`` (float64) holds each
        ``call_mean``'s totals then its counts, ``minima`` (float64) each ``call_min``'s values and each
        ``call_max``'s values negated, NaN as +inf, so one all-reduce (sum) and one (min) cover them all."""
        entries = self._entries.get(mode, {})
        sums: list[Tensor] = []
        minima: list[Tensor] = []
        for name, kind, _ in names:
            pending = entries.pop(name, None)
            if pending is None:
                continue
            totals = _stack(pending.totals, device)
            if kind == "call_mean":
                sums += [totals, _stack(pending.counts, device)]
            else:
                values = totals if kind == "call_min" else -totals
                minima.append(torch.where(torch.isnan(values), torch.inf, values))
        empty = torch.zeros(0, dtype=torch.float64, device=device)
        return torch.cat([empty, *sums]), torch.cat([empty, *minima])

    def _reduce_local(
        self, mode: str, names: list[tuple[str, str]], device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        """This process's entries of ``mode`` reduced per name (in the order of ``names``) and cleared:
        ``sums`` (len, 2) float64 = Σ total, Σ count; ``minima`` (len,) = min over entries with a positive count.

        Entries are stacked per dtype (one stack, one cast, one index-add each), not reduced one by one."""
        entries = self._entries.get(mode, {})
        self._entries[mode], self._sizes[mode] = {}, 0
        sums = torch.zeros(len(names) * 2, dtype=torch.float64, device=device)
        minima = torch.full((len(names),), float("inf"), dtype=torch.float64, device=device)
        by_dtype: dict[torch.dtype, tuple[list[Tensor], list[int]]] = {}
        host_values: list[float] = []
        host_slots: list[int] = []
        for row, (name, kind) in enumerate(names):
            pending = entries.get(name)
            if pending is None:
                continue
            if kind in EXTREMES:  # an entry without a count must not move the extreme
                sign = 1.0 if kind == "min" else -1.0  # a maximum is kept as the minimum of the negated values
                # every entry at once: min and an integer count's sum are exact, so this equals the entry-by-entry
                # reduction bit for bit
                if not any(isinstance(count, Tensor) for count in pending.counts):  # host counts: filter here
                    kept = [t for t, count in zip(pending.totals, pending.counts, strict=True) if count > 0]
                    if kept:
                        minima[row] = (sign * _stack(kept, device)).amin()
                    sums[2 * row + 1] = math.fsum(pending.counts)
                    continue
                totals, counts = _stack(pending.totals, device), _stack(pending.counts, device)
                minima[row] = torch.where(counts > 0, sign * totals, torch.inf).amin()
                sums[2 * row + 1] = counts.sum()
                continue
            for slot, values in ((2 * row, pending.totals), (2 * row + 1, pending.counts)):
                for value in values:
                    if isinstance(value, Tensor):
                        tensors, slots = by_dtype.setdefault(value.dtype, ([], []))
                        tensors.append(_scalar_on(value, device))
                        slots.append(slot)
                    else:
                        host_values.append(value)
                        host_slots.append(slot)
        for tensors, slots in by_dtype.values():
            index = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
            sums.index_add_(0, index, torch.stack(tensors).to(torch.float64))
        if host_values:
            index = torch.tensor(host_slots, dtype=torch.long).to(device, non_blocking=True)
            sums.index_add_(0, index, torch.tensor(host_values, dtype=torch.float64).to(device, non_blocking=True))
        return sums.view(-1, 2), minima

    def _compact(self, mode: str) -> None:
        """Fold every pending entry of ``mode`` into one per metric, on the device (no host read); a per-call
        metric's entries become one entry holding all its values."""
        entries = self._entries.get(mode, {})
        if not entries:
            return
        device = next(iter(entries.values())).totals[0].device
        calls = {name: pending for name, pending in entries.items() if pending.kind in CALL_KINDS}
        for pending in calls.values():
            pending.totals = [_stack(pending.totals, device)]
            pending.counts = [_stack(pending.counts, device)] if pending.kind == "call_mean" else []
        names = sorted((name, pending.kind) for name, pending in entries.items() if name not in calls)
        sums, minima = self._reduce_local(mode, names, device)
        self._entries[mode], self._sizes[mode] = calls, len(calls)
        for row, (name, kind) in enumerate(names):
            total = minima[row] if kind == "min" else -minima[row] if kind == "max" else sums[row, 0]
            self._append(mode, name, kind, total, sums[row, 1])  # one entry per metric: no further compaction

    def flush(
        self, mode: str, device: torch.device | str, gather_names: NamesGather | None = None
    ) -> dict[str, float | list[float]]:
        """Every metric of ``mode`` reduced over all processes, as Python floats (one host read), and clear: one
        float per pooled metric, a list of one float per entry for a per-call metric.

        With ``gather_names`` (several processes), the metric names are first united across processes so that
        every process all-reduces the same tensors in the same order; a process without a pooled metric
        contributes an empty entry. Metrics without any count are left out (a mean over nothing is not 0)."""
        names = self._names(mode)
        if gather_names is not None:
            names = _united(gather_names(names))
        if not names:
            self._entries[mode], self._sizes[mode] = {}, 0
            return {}
        call_names = [item for item in names if item[1] in CALL_KINDS]
        call_sums, call_minima = self._take_calls(mode, call_names, device)
        pooled = [(name, kind) for name, kind, _ in names if kind not in CALL_KINDS]
        stats, minima = self._reduce_local(mode, pooled, device)
        sums, lows = torch.cat([stats.flatten(), call_sums]), torch.cat([minima, call_minima])
        if gather_names is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(lows, op=dist.ReduceOp.MIN)
        values = torch.cat([sums, lows]).cpu().tolist()  # the one host read
        sums_host, lows_host = values[: sums.numel()], values[sums.numel():]
        out: dict[str, float | list[float]] = {}
        squares = {name.removesuffix(STD_SQUARES): sums_host[2 * row] for row, (name, kind) in enumerate(pooled)
                   if kind == "std_squares"}
        for row, (name, kind) in enumerate(pooled):
            total, count, minimum = sums_host[2 * row], sums_host[2 * row + 1], lows_host[row]
            if count <= 0 or kind == "std_squares":
                continue
            if kind == "std":
                out[name] = math.sqrt(max(squares[name] / count - (total / count) ** 2, 0.0))
            elif kind in EXTREMES:
                out[name] = minimum if kind == "min" else -minimum
            else:
                out[name] = total if kind == "sum" else total / count
        call_sums_host, call_lows_host = sums_host[stats.numel():], lows_host[minima.numel():]
        for name, kind, calls in call_names:
            if kind == "call_mean":
                totals, counts = call_sums_host[:calls], call_sums_host[calls: 2 * calls]
                call_sums_host = call_sums_host[2 * calls:]
                quotient = torch.tensor(totals, dtype=torch.float32) / torch.tensor(counts).clamp(min=1.0).float()
                out[name] = quotient.tolist()  # host tensors, divided in float32 as TRL divides its own
            else:
                sign = 1.0 if kind == "call_min" else -1.0
                lows_of_name, call_lows_host = call_lows_host[:calls], call_lows_host[calls:]
                out[name] = [sign * value if math.isfinite(value) else math.nan for value in lows_of_name]
        return out

    def flush_into(self, trl_metrics: dict[str, list[float]], mode: str, accelerator: Any) -> None:
        """Move the pending metrics of ``mode`` into TRL's ``_metrics[mode]`` (one value each, reduced over all
        processes: the same meaning at any world size). Collective: every process must call it together, as
        every process calls TRL's ``log``."""
        gather = None
        if accelerator.num_processes > 1:
            def gather(names: list[Name]) -> list[list[Name]]:
                return [[tuple(item) for item in per] for per in gather_object([names])]
        for name, value in self.flush(mode, accelerator.device, gather).items():
            if isinstance(value, list):
                trl_metrics[name].extend(value)
            else:
                trl_metrics[name].append(value)


def _scalar_on(value: Tensor, device: torch.device | str) -> Tensor:
    """A 0-dim entry as a 0-dim tensor on ``device``, with no operator call when it already is one there (the flush
    runs at every logging step: each call is host time)."""
    if value.dim() != 0:
        value = value.reshape(())
    return value if value.device == torch.device(device) else value.to(device, non_blocking=True)


def _numel(value: Tensor | float) -> int:
    return value.numel() if isinstance(value, Tensor) else 1


def _stack(values: list[Tensor | float], device: torch.device | str) -> Tensor:
    """Entries (0-dim or, after a compaction, 1-dim tensors, or host floats) as one float64 vector on ``device``,
    in order; a host float is copied without waiting for the device."""
    parts = [(v if isinstance(v, Tensor) else torch.tensor([v], dtype=torch.float64)).reshape(-1)
             .to(device, non_blocking=True) for v in values]
    return torch.cat(parts).to(torch.float64)


def _united(per_process: list[list[Name]]) -> list[Name]:
    """The metrics of every process, united. A per-call metric must have the same number of values on every
    process (each value is reduced over processes on its own), and a name one kind everywhere."""
    names = sorted({tuple(item) for names in per_process for item in names})
    by_name: dict[str, list[Name]] = {}
    for item in names:
        by_name.setdefault(item[0], []).append(item)
    for name, items in by_name.items():
        counts = [dict((n[0], n[2]) for n in names_of).get(name, 0) for names_of in per_process]
        if len(items) > 1 or (items[0][1] in CALL_KINDS and len(set(counts)) > 1):
            raise ValueError(
                f"metric {name!r} is added as {sorted({kind for _, kind, _ in items})} with {counts} per-call "
                "values on the processes: a per-call metric needs one value per loss call on every process"
            )
    return names
