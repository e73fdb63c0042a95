"""dfpo_bench.studies.start_precision.rounding against hand-counted cases: weights on the bf16 grid, a change below
half a bf16 step (rounds back to the base), one above it (kept), an unchanged weight, and a tied tensor counted once."""

from __future__ import annotations

import pytest
import torch

from dfpo_bench.studies.start_precision import rounding


def test_rounding_counts_what_bf16_returns_to_the_base_by_hand() -> None:
    base = torch.tensor([1.0, 1.0, 1.0, 0.5])  # all on the bf16 grid (bf16 spacing at 1.0 is 2^-7)
    step = 2.0 ** -7
    tuned = base + torch.tensor([step / 8, step, 0.0, 0.0])  # reverts, survives exactly, unchanged, unchanged
    tied = torch.tensor([2.0])
    out = rounding({"w": base, "embed": tied, "head": tied}, {"w": tuned, "embed": tied, "head": tied})
    assert out["weights"] == 5 and out["base_on_bf16_grid"] == 1.0
    assert out["changed_by_sft"] == pytest.approx(2 / 5) and out["changed_reverted_by_bf16"] == pytest.approx(1 / 2)
    # kept = <round(w) - b, w - b> / |w - b|^2 = step^2 / (step^2 + (step / 8)^2)
    assert out["update_kept_by_bf16"] == pytest.approx(1 / (1 + 1 / 64), rel=1e-12)
    off_grid = base + torch.tensor([step / 3, 0.0, 0.0, 0.0])
    assert rounding({"w": off_grid}, {"w": off_grid})["base_on_bf16_grid"] == pytest.approx(3 / 4)
