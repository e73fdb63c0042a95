"""The error and warning of TRL's compatibility check, apart from the check itself (``compat.py`` runs it at import),
so that ``from dfpo_trl import TRLCompatibilityError`` works under a TRL that fails it."""

from __future__ import annotations

__all__ = ["TRLCompatibilityError", "UntestedTRLWarning"]


class TRLCompatibilityError(ImportError):
    """The installed TRL lacks a method, parameter or attribute dfpo_trl hooks (a release DFPO does not support)."""


class UntestedTRLWarning(UserWarning):
    """The installed TRL is outside the tested range, though every touch point checks out."""
