"""MetricStore: deferred entries reduce to the pooled mean / minimum / count of every entry, with no device work
per add (the reason it exists: a launch per metric and micro-step showed in step time)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from dfpo_trl.metrics import store as metric_store
from dfpo_trl.metrics.store import MetricStore


def _fill(store: MetricStore, generator: torch.Generator, entries: int) -> dict[str, list[tuple[float, float]]]:
    """Random entries of mixed dtypes and count types; returns what was added, for a direct reference."""
    added: dict[str, list[tuple[float, float]]] = {"m": [], "n": [], "lo": [], "hi": [], "events": [], "spread": []}
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
        store.add_max("train", "hi", -low, count)
        added["hi"].append((float(-low), count))
        store.add_sum("train", "events", ints > 2)  # a bool count of events
        added["events"].append((float(ints > 2), 1.0))
        values = 1 + 0.01 * torch.randn(int(count), generator=generator, dtype=torch.float64)  # ratios near 1
        store.add_std("train", "spread", (values - 1).sum(), ((values - 1) ** 2).sum(), count)
        added["spread"] += [(float(v), 1.0) for v in values]
    return added


def _reference(added: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    out = {}
    for name in ("m", "n"):
        out[name] = sum(t for t, _ in added[name]) / sum(c for _, c in added[name])
    out["lo"] = min(t for t, c in added["lo"] if c > 0)
    out["hi"] = max(t for t, c in added["hi"] if c > 0)
    out["events"] = sum(t for t, _ in added["events"])
    out["spread"] = float(torch.tensor([v for v, _ in added["spread"]], dtype=torch.float64).std(correction=0))
    return out


@pytest.mark.parametrize("compact_after", [4096, 9])
def test_flush_pools_every_entry(monkeypatch: pytest.MonkeyPatch, compact_after: int) -> None:
    """Mean = Σ total / Σ count, min / max over entries with a count, sum of events, the population std of every
    value added; also across compactions."""
    monkeypatch.setattr(metric_store, "COMPACT_AFTER", compact_after)
    store = MetricStore()
    added = _fill(store, torch.Generator().manual_seed(0), 25)
    if compact_after == 9:  # 7 names (a std metric keeps two): folded to one entry each, then filling again
        assert sum(len(p.totals) for p in store._entries["train"].values()) < 9
    out = store.flush("train", "cpu")
    reference = _reference(added)
    assert out.keys() == reference.keys()
    for name, value in reference.items():
        assert out[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert store.flush("train", "cpu") == {}  # cleared


def test_min_without_count_and_mean_over_nothing_are_left_out() -> None:
    store = MetricStore()
    store.add_min("eval", "lo", torch.tensor(-5.0), 0.0)
    store.add_max("eval", "hi", torch.tensor(5.0), 0.0)
    store.add_std("eval", "spread", torch.tensor(0.0), torch.tensor(0.0), 0.0)
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


def test_per_call_entries_are_reduced_one_by_one() -> None:
    """A per-call metric logs one value per entry (as TRL logs its own once per loss call): a mean per entry with
    TRL's clamp (nothing counted gives 0, not NaN), divided in float32; NaN extremes are "no value"."""
    store = MetricStore()
    for total, count, low, high in ((1.0, 3.0, 0.5, 0.25), (0.0, 0.0, float("nan"), float("nan")), (2.0, 8, 0.0, 1.0)):
        store.add_call_mean("train", "m", torch.tensor(total), torch.tensor(count))
        store.add_call_min("train", "lo", torch.tensor(low))
        store.add_call_max("train", "hi", torch.tensor(high))
    store.add_mean("train", "pooled", torch.tensor(3.0), 4.0)
    out = store.flush("train", "cpu")
    assert out["m"] == [float(torch.tensor(1.0) / torch.tensor(3.0)), 0.0, 0.25]
    assert out["lo"][0] == 0.5 and math.isnan(out["lo"][1]) and out["lo"][2] == 0.0
    assert out["hi"][0] == 0.25 and math.isnan(out["hi"][1]) and out["hi"][2] == 1.0
    assert out["pooled"] == 0.75
    assert store.flush("train", "cpu") == {}
    trl_metrics: dict[str, list[float]] = defaultdict(list, {"m": [9.0]})
    store.add_call_mean("train", "m", torch.tensor(1.0), 2.0)
    store.add_call_mean("train", "m", torch.tensor(1.0), 4.0)
    store.flush_into(trl_metrics, "train", SimpleNamespace(num_processes=1, device="cpu"))
    assert trl_metrics == {"m": [9.0, 0.5, 0.25]}


def test_compaction_keeps_every_per_call_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metric_store, "COMPACT_AFTER", 5)
    store = MetricStore()
    for i in range(12):
        store.add_call_mean("train", "m", torch.tensor(float(i)), 4.0)
        store.add_call_max("train", "hi", torch.tensor(float(i)))
        store.add_mean("train", "pooled", torch.tensor(float(i)), 1.0)
    assert sum(len(p.totals) for p in store._entries["train"].values()) < 12
    out = store.flush("train", "cpu")
    assert out["m"] == [i / 4 for i in range(12)] and out["hi"] == [float(i) for i in range(12)]
    assert out["pooled"] == pytest.approx(sum(range(12)) / 12)


def test_processes_with_different_numbers_of_calls_are_refused() -> None:
    """Each per-call value is reduced over processes on its own: a process with another number of calls would pair
    the wrong values (or hang the all-reduce), so the flush refuses before any collective."""
    store = MetricStore()
    store.add_call_mean("train", "m", torch.tensor(1.0), 1.0)
    other = [[("m", "call_mean", 2)]]
    with pytest.raises(ValueError, match=r"'m' .* \[1, 2\] per-call values"):
        store.flush("train", "cpu", gather_names=lambda names: [names, *other])


def _flush_on_two_processes(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    store = MetricStore()
    # two calls: rank 0 counts (1 of 4, 0 of 2), rank 1 (3 of 4, nothing); extremes with NaN on one rank
    for total, count, low, high in (((1.0, 4.0, 0.5, float("nan")), (0.0, 2.0, float("nan"), float("nan"))),
                                    ((3.0, 4.0, 0.25, 0.75), (0.0, 0.0, float("nan"), float("nan"))))[rank]:
        store.add_call_mean("train", "m", torch.tensor(total), torch.tensor(count))
        store.add_call_min("train", "lo", torch.tensor(low))
        store.add_call_max("train", "hi", torch.tensor(high))
    store.add_mean("train", "pooled", torch.tensor(float(rank)), 1.0)

    def gather(names: list) -> list:
        per_process: list = [None, None]
        dist.all_gather_object(per_process, names)
        return per_process

    torch.save(store.flush("train", "cpu", gather), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_per_call_entries_are_reduced_over_processes(tmp_path) -> None:
    """Over two gloo processes each call's value is TRL's: sums over both processes' counts, min / max over both."""
    from tiny import free_port, spawn_ranks

    spawn_ranks(_flush_on_two_processes, (free_port(), str(tmp_path)), nprocs=2, timeout_s=120)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["m"] == [0.5, 0.0] and out["pooled"] == 0.5
        assert out["lo"][0] == 0.25 and math.isnan(out["lo"][1])
        assert out["hi"][0] == 0.75 and math.isnan(out["hi"][1])
