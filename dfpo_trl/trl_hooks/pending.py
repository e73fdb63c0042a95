"""The trainer's two pieces of TRL convention: the config (the default TRL's trainers build when given none), and the
one piece of state between DFPO's overrides that TRL's call structure forces (:class:`PendingCall`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DFPOConfig
from .compat import get_config_model_id

__all__ = ["OnForward", "PendingCall", "chain_forwards", "default_config", "trainer_config"]

#: What runs around one policy forward: (unwrapped model, the call's (args, kwargs), the forward itself) -> its output.
OnForward = Callable[[torch.nn.Module, Any, Callable[[], Any]], Any]


def default_config(model: Any) -> DFPOConfig:
    """The config of a trainer built without ``args``, named as ``GRPOTrainer`` names its default
    (``GRPOConfig(f"{model_name}-GRPO")``): ``DFPOConfig(f"{model_name}-DFPO")``, every DFPO option off."""
    model_name = model if isinstance(model, str) else get_config_model_id(model.config)
    return DFPOConfig(f"{model_name.split('/')[-1]}-DFPO")


def trainer_config(config: Any, model: Any) -> DFPOConfig:
    """The config a ``DFPOTrainer`` trains with: ``config`` (its ``args``), which must be a ``DFPOConfig``, or
    :func:`default_config` when none is given."""
    if config is None:
        return default_config(model)
    if not isinstance(config, DFPOConfig):
        raise TypeError(
            f"DFPOTrainer needs args=DFPOConfig(...), got {type(config).__name__}; DFPOConfig takes every "
            "GRPOConfig field plus the DFPO ones."
        )
    return config


@dataclass
class PendingCall:
    """The one piece of state between DFPO's overrides, forced by TRL's call structure: TRL calls
    ``_calculate_rewards`` and ``_get_per_token_logps_and_entropies`` from inside its rollout and its loss, so what
    DFPO must do or learn there is left here by the outer override (:meth:`DFPOTrainer._expecting`) for the
    duration of TRL's call. ``on_forward`` runs around the next policy forward of ``model`` (any model when None),
    once (DelTA's h in the rollout; the loss-input rewrite in the loss); ``rewards`` is the rollout's per-completion
    reward, for ``step_reward``."""

    on_forward: OnForward | None = None
    model: torch.nn.Module | None = None
    rewards: torch.Tensor | None = None


def chain_forwards(*steps: OnForward | None) -> OnForward | None:
    """One ``on_forward`` that runs ``steps`` around the same forward, the first outermost (it sees what the later
    ones return); None steps are left out, and None when none is left."""
    present = [step for step in steps if step is not None]
    if len(present) <= 1:
        return present[0] if present else None
    outer, inner = present[0], chain_forwards(*present[1:])
    return lambda model, arguments, forward: outer(model, arguments, lambda: inner(model, arguments, forward))
