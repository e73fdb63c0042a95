"""The check :func:`~dfpo_trl.transforms.register_transform` runs on a new transform: its function on a
few fixed groups like those training meets (the all-zero-advantage group included), against the properties it
declares (shape, finite values, non-negative weights, its balance condition within a relative tolerance). A first
look, not a proof; the residual metrics watch the rest (docs/source/guides/custom_transform.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .entry import BALANCE_EQUAL, BALANCE_ZERO_SUM, GroupTransform

__all__ = ["probe_problem"]

# The probe of register_transform: a few groups like those training meets, including the degenerate one.
_PROBE_SEED, _PROBE_GROUPS = 20_604, 6
_PROBE_RELATIVE_TOLERANCE = 1e-4  # |Σ Â s̃| / Σ |Â s̃|: 840 float32 eps, far above the rounding of G terms


class _Probe(NamedTuple):
    w: torch.Tensor  # post-clip weights near 1, as off-policy s̄ are
    centred: torch.Tensor  # TRL's advantages: centred, both signs in every group but the last (all 0)
    a: torch.Tensor  # the gradient target's coefficients: centred Â x a positive factor c, 0 outside U
    survives: torch.Tensor  # U, two-sided in every group with signal


def _probe(group_size: int) -> _Probe:
    gen = torch.Generator().manual_seed(_PROBE_SEED + group_size)
    shape = (_PROBE_GROUPS, group_size)
    w = torch.exp(0.3 * torch.randn(shape, generator=gen))
    rewards = torch.randn(shape, generator=gen)
    rewards[:, 0] = rewards.amax(dim=-1) + 1.0  # the largest reward: above the mean, Â > 0
    rewards[:, 1] = rewards.amin(dim=-1) - 1.0  # the smallest: Â < 0, so every group (and U) has both signs
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    centred[-1] = 0.0  # uniform rewards
    survives = torch.rand(shape, generator=gen) > 0.25
    survives[:, :2] = True
    a = torch.where(survives, centred * (0.5 + torch.rand(shape, generator=gen)), 0.0)
    return _Probe(w, centred, a, survives)


def probe_problem(entry: GroupTransform) -> str | None:
    """What ``entry`` breaks of its declared properties on the probe batches (G = 2 and 5), or None.

    Checks a floating-point result of w's shape, finite where the inputs are, ≥ 0 when ``nonnegative``, and the
    declared balance: ``"zero_sum"`` on centred Â and on the gradient target's coefficients a, ``"equal"`` within
    every group, ``subset_balance`` Σ_U a_i s̃_i = 0. A probe is a first look, not a proof: the metrics
    (``transform/orth_residual``) watch training."""
    for group_size in (2, 5):
        probe = _probe(group_size)
        cases = [("", "centred advantages", entry.apply, (probe.w, probe.centred, 0.5, 1e-6), probe.centred)]
        if entry.balance == BALANCE_ZERO_SUM:  # claims Σ Â s̃ = 0 for uncentred coefficients too
            cases.append(("", "gradient coefficients a", entry.apply, (probe.w, probe.a, 0.5, 1e-6), probe.a))
        if entry.subset_balance is not None:  # Σ_U a_i s̃_i = 0 over the survivors (a = 0 outside them)
            cases.append(("subset_balance ", "gradient coefficients a and survivors U", entry.subset_balance,
                          (probe.w, probe.a, probe.survives), probe.a))
        for part, case, fn, args, adv in cases:
            where = f"on the probe's {case} (G = {group_size})"
            try:
                with torch.no_grad():
                    out = fn(*args)
            except Exception as exc:  # the user's function: report whatever it raised, and where
                return f"{part}raised {type(exc).__name__}: {exc} {where}"
            balance = BALANCE_ZERO_SUM if part else entry.balance
            problem = _result_problem(entry, out, probe.w, adv, where, balance)
            if problem is not None:
                return part + problem
    return None


def _result_problem(
    entry: GroupTransform, out: Any, w: torch.Tensor, adv: torch.Tensor, where: str, balance: str
) -> str | None:
    """What one probe result breaks of ``balance`` and the entry's other declarations, or None."""
    if not isinstance(out, torch.Tensor) or out.shape != w.shape:
        return f"returned {getattr(out, 'shape', type(out).__name__)} for w of shape {tuple(w.shape)} {where}"
    out = out.to(torch.float64)
    if not torch.isfinite(out).all():
        bad = (~torch.isfinite(out)).any(dim=-1).nonzero().flatten().tolist()
        degenerate = " (the group whose advantages are all 0)" if _PROBE_GROUPS - 1 in bad else ""
        return f"returned NaN or Inf in groups {bad}{degenerate} {where}"
    if entry.nonnegative and (out < 0).any():
        return (f"declares nonnegative=True but returned {out.min().item():.3g} {where}; declare nonnegative=False "
                "(the gradient target then hands TRL negative-weight rows in the score form)")
    adv = adv.to(torch.float64)
    if balance == BALANCE_ZERO_SUM:
        terms = adv * out
        residual = terms.sum(dim=-1).abs()
        allowed = _PROBE_RELATIVE_TOLERANCE * terms.abs().sum(dim=-1) + 1e-30
        if (residual > allowed).any():
            group = int((residual - allowed).argmax())
            claim = "must balance" if balance != entry.balance else "declares balances='zero_sum'"
            return (f"{claim} but |sum_i A_i w_i| = {residual[group].item():.3g} in group {group} {where}; fix "
                    "the function, or declare what it guarantees (balances='none' or 'equal')")
    if balance == BALANCE_EQUAL:
        spread = out.amax(dim=-1) - out.amin(dim=-1)
        allowed = _PROBE_RELATIVE_TOLERANCE * out.abs().amax(dim=-1) + 1e-30
        if (spread > allowed).any():
            group = int((spread - allowed).argmax())
            return (f"declares balances='equal' but the weights of group {group} span {spread[group].item():.3g} "
                    f"{where}; return one weight per group, or declare balances='zero_sum' or 'none'")
    return None
