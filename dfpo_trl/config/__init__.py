"""The configuration, at the bottom of the import graph: every other package reads its options and rules, and it
imports nothing of ``dfpo_trl`` but the transform registry below it (:mod:`dfpo_trl.transforms`).

``fields`` (:class:`DFPOConfig`, each field documented once), ``options`` (each closed option's values, the table of
TRL's loss types), ``rules`` (the shape of a validation rule), ``checks`` (each field's rule), ``trl_field_rules``
(TRL's fields', standard library only), ``delta_rules`` (DelTA's options'), ``combinations`` (the rules between
fields), ``method`` (the method a config trains with) and ``docs`` (the reference page of the DFPO fields).

``DFPOConfig`` is imported on first use (PEP 562): ``dfpo-train`` reads ``options``, ``rules``, ``trl_field_rules``
and ``method`` before it imports torch and TRL, which ``fields`` imports (docs/source/guides/cli.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fields import DFPOConfig

__all__ = ["DFPOConfig"]


def __getattr__(name: str) -> Any:
    """Import :mod:`.fields` when ``DFPOConfig`` is first read here, and keep the name."""
    if name != "DFPOConfig":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(".fields", __name__).DFPOConfig
    globals()[name] = value
    return value
