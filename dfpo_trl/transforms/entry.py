"""What one entry of the transform registry is (:class:`GroupTransform`) and the balance conditions it may declare.

Below both the registry (:mod:`dfpo_trl.transforms`, which re-exports these names) and the check it runs
on a new entry (:mod:`dfpo_trl.transforms.probe`), so neither imports the other's module to read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "BALANCE_CONDITIONS",
    "BALANCE_EQUAL",
    "BALANCE_NONE",
    "BALANCE_ZERO_SUM",
    "GroupFunction",
    "GroupTransform",
    "SubsetBalance",
]

#: No balance condition (GSPO's ``none``, the ``scale`` ablation): ``cancellation_target="gradient"`` refuses it.
BALANCE_NONE = "none"
#: Σ_i Â_i s̃_i = 0 for every advantage vector with both signs, centred or not, so the gradient target can run the
#: transform on a_i = Â_i c_i 1[i ∈ U] instead of Â (eq. C1): Orth-Proj, Positive Orth-Proj, Truncate-and-Rebalance.
BALANCE_ZERO_SUM = "zero_sum"
#: s̃ is one value per group, so Σ_i Â_i s̃_i = s̃ Σ_i Â_i = 0 because TRL centres Â in each group (Min-Replace,
#: eq. 50). The a_i do not sum to 0, so the gradient target needs the transform's own ``subset_balance``.
BALANCE_EQUAL = "equal"
BALANCE_CONDITIONS: tuple[str, ...] = (BALANCE_NONE, BALANCE_ZERO_SUM, BALANCE_EQUAL)

#: A group function as users write it: (w, Â), both (num_groups, G), to s̃ of the same shape.
GroupFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: A transform's balanced form on the survivors U for ``cancellation_target="gradient"``: (w, a, members) → s̃,
#: with Σ_{i∈U} a_i s̃_i = 0 for two-sided U and s̃_i = w_i outside U (as :func:`min_replace_on_subset`).
SubsetBalance = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GroupTransform(NamedTuple):
    """One entry of the registry: what the objective, the config checks and the metrics read about a transform.

    ``apply`` takes (w, Â, scale_factor, truncate_floor) on (num_groups, G) tensors; ``balance`` is one of
    :data:`BALANCE_CONDITIONS`; ``nonnegative``: s̃ ≥ 0 whenever w > 0 (otherwise the gradient target hands TRL
    the rows whose φ < 0 in the score representation, docs/source/concepts/cancellation.md); ``subset_balance``: the
    balanced form on U that the gradient target uses instead of running ``apply`` on a; ``source`` the equation (or who
    registered it); ``builtin``: shipped with dfpo_trl."""

    name: str
    apply: Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]
    balance: str
    source: str
    nonnegative: bool = True
    subset_balance: SubsetBalance | None = None
    builtin: bool = False

    @property
    def balances(self) -> bool:
        """Whether the transform guarantees Σ_i Â_i s̃_i = 0 (the condition that restores cancellation)."""
        return self.balance != BALANCE_NONE

    @property
    def retargetable(self) -> bool:
        """Whether ``cancellation_target="gradient"`` can balance a instead of Â with it (eq. C1)."""
        return self.balance == BALANCE_ZERO_SUM or (self.balances and self.subset_balance is not None)
