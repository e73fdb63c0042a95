"""One line when TRL's vLLM importance-sampling ratio shrinks the loss.

TRL 1.16 multiplies each row's loss by exp(trainer log-prob − vLLM's sampling log-prob), summed over the completion
in its sequence modes. vLLM returns its log-probs after top-k / top-p / min-p (``processed_logprobs``), renormalised
over the tokens it kept, while the trainer scores the untruncated tempered distribution, so under truncated sampling
each token adds log K ≤ 0 (K: the kept tokens' mass) and the sequence ratio falls exponentially with length.
Measured with trained weights at the recipes' settings: benchmarks/RESULTS.md, "Trained weights";
``vllm_importance_sampling_support="truncated"`` takes the ratio against the support vLLM sampled from instead
(trl_hooks/sampling_support.py), the choice the recipes make (docs/source/concepts/decisions.md, "vLLM's
importance-sampling ratio under truncated sampling").

:class:`RatioWatch` reads TRL's ratio after each rollout and logs one warning, the first time its mean falls below
:data:`SHRINK_BELOW`, naming the fields that change it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHRINK_BELOW = 0.5  # a rollout mean below this halves the update or more
RATIO_KEY = "importance_sampling_ratio"


def rollout_ratio_sums(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(Σ ratio, count) over what TRL's ``sampling/importance_sampling_ratio/mean`` averages: every row in the
    sequence modes (``ratio`` (B, 1)), the loss tokens in the token modes (``ratio`` (B, T), ``mask`` (B, T))."""
    values = ratio.reshape(-1) if ratio.size(-1) == 1 else ratio[mask.bool()]
    values = values.double()
    return torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=torch.float64,
                                                   device=values.device)])


def truncates(args: Any) -> bool:
    """Whether the run samples from a truncated distribution (vLLM then renormalises its log-probs)."""
    return (args.top_k or 0) > 0 or (args.top_p if args.top_p is not None else 1.0) < 1.0 or (args.min_p or 0.0) > 0


def shrink_message(mean: float, args: Any) -> str | None:
    """The one line for a rollout whose mean ratio is ``mean``, or None when it does not shrink the loss."""
    if not math.isfinite(mean) or mean >= SHRINK_BELOW:
        return None
    head = (f"TRL's vLLM importance-sampling ratio averaged {mean:.3g} over this rollout "
            f"(vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}): it multiplies each row's loss, "
            "and a sequence-level ratio falls exponentially with the completion's length.")
    if truncates(args) and getattr(args, "vllm_importance_sampling_support", "full") == "full":
        return (f"{head} Sampling is truncated (top_k={args.top_k}, top_p={args.top_p}, min_p={args.min_p}) and "
                "vLLM renormalises its log-probs over the kept tokens, so the ratio measures the truncation, not a "
                "mismatch: set vllm_importance_sampling_support: truncated (the recipes do), which takes the ratio "
                "against the support vLLM sampled from.")
    return (f"{head} Set vllm_importance_sampling_mode: token_truncate (a per-token ratio does not compound over "
            "the length), or vllm_importance_sampling_correction: false.")


class RatioWatch:
    """Checks each training rollout's ratio until it has warned once (every process computes the same gathered mean,
    so every process stops checking at the same rollout)."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, output: dict[str, Any], mask: torch.Tensor, args: Any, accelerator: Any) -> str | None:
        """Log and return the line for this rollout (None when the ratio is absent, fine, or already warned of).
        Collective where TRL computed a ratio: call it on every process after the same rollout."""
        ratio = output.get(RATIO_KEY)
        if self.warned or ratio is None:
            return None
        sums = accelerator.gather(rollout_ratio_sums(ratio, mask).unsqueeze(0)).sum(0)
        count = float(sums[1])
        message = shrink_message(float(sums[0]) / count if count else float("nan"), args)
        if message is not None:
            self.warned = True
            if accelerator.is_main_process:
                logger.warning(message)
        return message
