"""The one line on TRL's vLLM importance-sampling ratio (dfpo_trl/trl_hooks/sampling_ratio.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dfpo_trl.trl_hooks.sampling_ratio import SHRINK_BELOW, RatioWatch, rollout_ratio_sums, shrink_message, truncates

RECIPE_8B = SimpleNamespace(top_k=20, top_p=0.8, min_p=0.0, vllm_importance_sampling_mode="sequence_mask")
UNTRUNCATED = SimpleNamespace(top_k=0, top_p=1.0, min_p=None, vllm_importance_sampling_mode="sequence_mask")


class OneProcess:
    """``accelerator.gather`` and ``is_main_process`` of a single process."""

    is_main_process = True

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class TwoProcesses(OneProcess):
    """A gather that appends a second process's (sum, count)."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, self.other.unsqueeze(0)])


def test_rollout_mean_is_trls_mean_over_rows_or_loss_tokens():
    """Sequence modes average every row (TRL's (B, 1) ratio); token modes the loss tokens only."""
    rows = torch.tensor([[0.5], [0.25], [1.0]])
    assert rollout_ratio_sums(rows, torch.ones(3, 4)).tolist() == [1.75, 3.0]
    tokens = torch.tensor([[0.5, 9.0], [0.25, 0.75]])
    mask = torch.tensor([[1, 0], [1, 1]])
    assert rollout_ratio_sums(tokens, mask).tolist() == [1.5, 3.0]


def test_truncation_is_any_of_top_k_top_p_min_p():
    assert truncates(RECIPE_8B)
    assert not truncates(UNTRUNCATED)
    assert truncates(SimpleNamespace(top_k=0, top_p=1.0, min_p=0.05))
    assert truncates(SimpleNamespace(top_k=0, top_p=0.95, min_p=None))


def test_the_line_names_the_fields_for_each_cause():
    truncated = shrink_message(0.106, RECIPE_8B)
    assert "0.106" in truncated and "top_k=20" in truncated and "top_p=0.8" in truncated
    assert "vllm_importance_sampling_support: truncated" in truncated
    other = shrink_message(0.3, UNTRUNCATED)
    assert "token_truncate" in other and "vllm_importance_sampling_correction: false" in other
    # already against the truncated support: what is left is the engines' mismatch, not the truncation
    mismatch = shrink_message(0.3, SimpleNamespace(**vars(RECIPE_8B), vllm_importance_sampling_support="truncated"))
    assert "token_truncate" in mismatch and "vllm_importance_sampling_support" not in mismatch
    assert shrink_message(SHRINK_BELOW, RECIPE_8B) is None
    assert shrink_message(float("nan"), RECIPE_8B) is None


def test_watch_warns_once_from_the_gathered_mean(caplog: pytest.LogCaptureFixture):
    """One process alone at 0.4 would warn; with a second at 0.8 over as many rows the mean is 0.6: no line."""
    watch = RatioWatch()
    output = {"importance_sampling_ratio": torch.full((4, 1), 0.4)}
    mask = torch.ones(4, 3)
    assert watch.check(output, mask, RECIPE_8B, TwoProcesses(torch.tensor([3.2, 4.0], dtype=torch.float64))) is None
    with caplog.at_level("WARNING", logger="dfpo_trl.trl_hooks.sampling_ratio"):
        line = watch.check(output, mask, RECIPE_8B, OneProcess())
        assert line is not None and "0.4" in line
        assert watch.check(output, mask, RECIPE_8B, OneProcess()) is None  # once per run
    assert [r.getMessage() for r in caplog.records] == [line]
    assert RatioWatch().check({}, mask, RECIPE_8B, OneProcess()) is None  # no ratio: correction off
