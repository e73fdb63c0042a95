"""MetricStore: deferred entries reduce to the pooled mean / minimum / count of every entry, with no device work
per add (the reason it exists: a launch per metric and micro-step showed in step time)."""

from __future__ import annotations

import pytest
import torch

from dfpo_trl.metrics import store as metric_store
from dfpo_trl.metrics.store import MetricStore


def _fill(store: MetricStore, generator: torch.Generator, entries: int) -> dict[str, list[tuple[float, float]]]:
    """Random entries of mixed dtypes and count types; returns what was added, for a direct reference."""
    added: dict[str, list[tuple[float, float]]] = {"m": [], "n": [], "lo": [], "events": []}
    for _ in range(entries):
        total = torch.rand((), generator=generator) * 10
        count = float(torch.randint(0, 4, (), generator=generator))
        store.add_mean("train", "m", total, count)  # float32 total, host count
        added["m"].append((float(total), count))
        ints = torch.randint(0, 5, (), generator=generator)
        int_count = torch.randint(1, 6, (), generator=generator)
        store.add_mean("train", "n", ints, int_count)  # int64 total and count
        added["n"].append((float(ints), float(int_count)))
        low = torch.randn((), generator=generator, dtype=torch.float64)
        store.add_min("train", "lo", low, count)
        added["lo"].append((float(low), count))
        store.add_sum("train", "events", ints > 2)  # a bool count of events
        added["events"].append((float(ints > 2), 1.0))
    return added


def _reference(added: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    out = {}
    for name in ("m", "n"):
        out[name] = sum(t for t, _ in added[name]) / sum(c for _, c in added[name])
    out["lo"] = min(t for t, c in added["lo"] if c > 0)
    out["events"] = sum(t for t, _ in added["events"])
    return out


@pytest.mark.parametrize("compact_after", [4096, 7])
def test_flush_pools_every_entry(monkeypatch: pytest.MonkeyPatch, compact_after: int) -> None:
    """Mean = Σ total / Σ count, min over entries with a count, sum of events; also across compactions."""
    monkeypatch.setattr(metric_store, "COMPACT_AFTER", compact_after)
    store = MetricStore()
    added = _fill(store, torch.Generator().manual_seed(0), 25)
    if compact_after == 7:
        assert sum(len(p.totals) for p in store._entries["train"].values()) < 7
    out = store.flush("train", "cpu")
    reference = _reference(added)
    assert out.keys() == reference.keys()
    for name, value in reference.items():
        assert out[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert store.flush("train", "cpu") == {}  # cleared


def test_min_without_count_and_mean_over_nothing_are_left_out() -> None:
    store = MetricStore()
    store.add_min("eval", "lo", torch.tensor(-5.0), 0.0)
    store.add_mean("eval", "m", torch.tensor(0.0), torch.tensor(0))
    assert store.flush("eval", "cpu") == {}


def test_kind_mismatch_is_refused() -> None:
    store = MetricStore()
    store.add_mean("train", "x", torch.tensor(1.0), 1.0)
    with pytest.raises(ValueError, match="'x' is a 'mean' metric, not 'min'"):
        store.add_min("train", "x", torch.tensor(1.0))


def test_adding_launches_no_operator() -> None:
    """An add records the tensor; no torch operator runs until the flush (a launch per add cost step time)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func not in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                CountOps.calls += 1
            return func(*args, **(kwargs or {}))

    store = MetricStore()
    values = [torch.tensor(float(i)) for i in range(20)]
    one = torch.tensor(1.0)
    with CountOps():
        for i, value in enumerate(values):
            store.add_mean("train", "m", value, 2.0)
            store.add_min("train", "lo", value, one if i else 1.0)
            store.add_sum("train", "s", value)
    assert CountOps.calls == 0
    out = store.flush("train", "cpu")
    assert out == {"m": pytest.approx(sum(range(20)) / 40), "lo": 0.0, "s": float(sum(range(20)))}
